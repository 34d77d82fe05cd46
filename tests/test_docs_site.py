"""The documentation builds into a site with ``mkdocs build --strict`` (every nav page present, every link and anchor
resolved, every mkdocstrings directive rendered), as ``make docs`` builds it; the site renders its math with its own
copy of MathJax and loads nothing from another host; the API page shows public names only; the search index holds
the pages."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly_and_holds_together(tmp_path):
    # One build (about 10 s) serves every check; the suite's workers would each build it again for separate tests.
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    api = (site / "reference/api/index.html").read_text(encoding="utf-8")
    check_the_pages_and_the_api(site, api)
    check_the_math_renders_with_the_sites_own_mathjax_and_nothing_comes_from_another_host(site)
    check_the_api_page_shows_public_names_with_their_signatures(api)
    check_the_search_index_holds_the_pages(site)


def check_the_pages_and_the_api(site: Path, api: str):
    for page in ("index.html", "install/index.html", "guides/training/index.html", "methods/tp_grpo/index.html",
                 "extending/index.html", "reference/config/index.html", "results/default_run/index.html"):
        assert (site / page).is_file(), page
    assert "<p>::: " not in api, "a mkdocstrings directive was left unrendered"
    assert "Trainer" in api and "register_reward" in api and "sde_step" in api
    # The exported names' Args: and Returns: render as tables (Google style), TrainConfig's fields among them, and
    # no private member is shown (filters: public).
    assert api.count("Parameters:") >= 10 and api.count("Returns:") >= 10
    assert all(f"<code>{field}</code>" in api for field in ("step_selection", "objectives", "distributed"))
    assert 'id="flowalign.training.trainer.Trainer._set_up"' not in api and "train_iteration" not in api
    assert (site / "images/default_before.png").is_file() and (site / "results/img").is_dir()


def check_the_math_renders_with_the_sites_own_mathjax_and_nothing_comes_from_another_host(site: Path):
    # docs/hooks/mathjax.py copies MathJax from the django-static-mathjax package into the site, a page with math
    # loads that copy, and no page loads a script, stylesheet, font or image from another host (users may be offline).
    mathjax = site / "javascripts/mathjax/tex-svg-full.js"
    assert mathjax.is_file() and mathjax.stat().st_size > 1_000_000
    flow_grpo = (site / "methods/flow_grpo/index.html").read_text(encoding="utf-8")
    assert 'class="arithmatex"' in flow_grpo and "\\mathrm{std}_t" in flow_grpo
    assert 'src="../../javascripts/mathjax/tex-svg-full.js"' in flow_grpo
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.I)
    for page in site.rglob("*.html"):
        assert not remote.search(page.read_text(encoding="utf-8")), f"{page.relative_to(site)} loads from another host"


def check_the_api_page_shows_public_names_with_their_signatures(api: str):
    # Every object the page documents is exported by flowalign or named in the __all__ of its module or of a package
    # above it (the out-of-process rewards, modules without an __all__, are named by their full paths); the members
    # that serve the loader, the trainer or a family's adapter are left out.
    import flowalign

    exported = {id(getattr(flowalign, name)) for name in flowalign.__all__}
    by_path = {"flowalign.remote.client.RemoteReward", "flowalign.remote.judge.VLMJudge",
               "flowalign.remote.server.ServeRewardConfig", "flowalign.kernels"}
    for path in re.findall(r'<h2 id="([^"]+)" class="doc doc-heading">', api):
        if path.split(".")[0] in ("samplers", "kernels"):  # repository folders installed as flowalign.samplers, ...
            path = f"flowalign.{path}"
        module_path, _, name = path.rpartition(".")
        packages = [".".join(module_path.split(".")[:n]) for n in range(1, module_path.count(".") + 2)]
        named = any(name in getattr(importlib.import_module(package), "__all__", ()) for package in packages)
        obj = getattr(importlib.import_module(module_path), name) if module_path else None
        assert path in by_path or named or id(obj) in exported, f"the API page documents {path}, which no __all__ names"
    for internal in ("TrainConfig.migrate", "TrainConfig.check_batch", "FlowModel.checked_latents",
                     "FlowModel.run_transformer", "RemoteReward.validate_settings", "VLMJudge.ask", "Registry.closest"):
        assert not re.search(rf'id="[\w.]*\.{re.escape(internal)}"', api), internal
    text = re.sub(r"<[^>]+>", "", api)
    assert "Trainer(config: TrainConfig, *, rewards=None" in text and "Registry(kind: str" in text


def check_the_search_index_holds_the_pages(site: Path):
    # The search box's results come from this index: DiffusionNFT, the default run's method, is found on its page.
    index = json.loads((site / "search/search_index.json").read_text(encoding="utf-8"))["docs"]
    assert any(doc["location"].startswith("methods/diffusion_nft/") and "DiffusionNFT" in doc["title"] for doc in index)
