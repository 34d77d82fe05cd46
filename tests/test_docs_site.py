"""The documentation builds into a site with ``mkdocs build --strict`` (every nav page present, every link and anchor
resolved, every mkdocstrings directive rendered), as ``make docs`` builds it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly_and_renders_the_api(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for page in ("index.html", "install/index.html", "guides/training/index.html", "methods/tp_grpo/index.html",
                 "extending/index.html", "reference/config/index.html", "results/default_run/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference/api/index.html").read_text(encoding="utf-8")
    assert "<p>::: " not in api, "a mkdocstrings directive was left unrendered"
    assert "Trainer" in api and "register_reward" in api and "sde_step" in api
    # The exported names' Args: and Returns: render as tables (Google style), TrainConfig's fields among them, and
    # no private member is shown (filters: public).
    assert api.count("Parameters:") >= 10 and api.count("Returns:") >= 10
    assert all(f"<code>{field}</code>" in api for field in ("step_selection", "objectives", "distributed"))
    assert 'id="flowalign.training.trainer.Trainer._set_up"' not in api and "train_iteration" not in api
    assert (site / "images/default_before.png").is_file() and (site / "results/img").is_dir()

    # The math renders offline: the site carries MathJax itself (docs/hooks/mathjax.py copies it from the
    # django-static-mathjax package), a page with math loads that copy, and no page loads a script, stylesheet or font
    # from another host.
    mathjax = site / "javascripts/mathjax/tex-svg-full.js"
    assert mathjax.is_file() and mathjax.stat().st_size > 1_000_000
    flow_grpo = (site / "methods/flow_grpo/index.html").read_text(encoding="utf-8")
    assert 'class="arithmatex"' in flow_grpo and "\\mathrm{std}_t" in flow_grpo
    assert 'src="../../javascripts/mathjax/tex-svg-full.js"' in flow_grpo
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.I)
    for page in site.rglob("*.html"):
        assert not remote.search(page.read_text(encoding="utf-8")), f"{page.relative_to(site)} loads from another host"
