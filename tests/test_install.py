"""The installed package exposes one import package, flowalign, and never a top-level `kernels` module."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_outside_repo(code: str, tmp_path: Path) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_top_level_kernels_samplers_reward_models_are_not_importable(tmp_path):
    """Installing flowalign makes none of the three names importable (a ``kernels`` found is the hub package that
    transformers >= 5.25 requires, never the repository's folder)."""
    code = (
        "import importlib.util as u\n"
        "import flowalign.kernels, flowalign.samplers, flowalign.reward_models\n"
        "k = u.find_spec('kernels')\n"
        f"print([k is None or k.origin != {str(REPO / 'kernels' / '__init__.py')!r}, "
        "u.find_spec('samplers') is None, u.find_spec('reward_models') is None])"
    )
    assert run_outside_repo(code, tmp_path) == "[True, True, True]"


def test_subpackages_map_to_the_repository_folders(tmp_path):
    code = "import flowalign.samplers as s, flowalign.kernels as k; print(s.__file__); print(k.__file__)"
    samplers_file, kernels_file = run_outside_repo(code, tmp_path).splitlines()
    assert Path(samplers_file).parent.name == "samplers" and Path(kernels_file).parent.name == "kernels"


def test_transformers_and_diffusers_import_cleanly_beside_flowalign(tmp_path):
    code = "import flowalign.kernels, transformers, diffusers, sys; print('kernels' in sys.modules)"
    assert run_outside_repo(code, tmp_path) == "False"


def test_from_the_repository_root_import_kernels_is_the_installed_hub_package(tmp_path):
    """``python -m`` from the repository root puts it on sys.path, where the folder ``kernels/`` would shadow the
    Hugging Face hub package of that name (transformers >= 5.25 imports it): the folder hands the name over to the
    installed package, and without one the import fails as if the folder were not there."""
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("HUB = True\n")
    code = "import kernels, flowalign.kernels as k; print(kernels.__file__); print(k.sde_transition.__module__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    hub_file, module = out.stdout.splitlines()
    assert Path(hub_file) == hub / "__init__.py" and module == "flowalign.kernels.dispatch"
    alone = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=REPO,
                           capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    try:  # the hub package may be installed here (transformers >= 5.25 requires it)
        installed = importlib.metadata.distribution("kernels") is not None
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:
        assert alone.returncode == 0 and Path(alone.stdout.strip()).parent.parent != REPO, alone.stdout
    else:
        assert alone.returncode != 0 and "No module named 'kernels'" in alone.stderr


def test_every_package_folder_is_listed_for_installation():
    """A non-editable install (a wheel, ``pip install .``) ships only the packages pyproject lists: every folder with
    an ``__init__.py`` under the four installed folders must be one of them (``flowalign.prep`` once was not)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"flowalign": "flowalign", "samplers": "flowalign.samplers", "reward_models": "flowalign.reward_models",
               "kernels": "flowalign.kernels"}
    found = {".".join([package, *init.parent.relative_to(REPO / folder).parts])
             for folder, package in folders.items() for init in (REPO / folder).rglob("__init__.py")}
    assert not found - listed, f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"
