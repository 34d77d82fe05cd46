"""The installed package exposes one import package, flowalign, and never a top-level `kernels` module."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_outside_repo(code: str, tmp_path: Path) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_top_level_kernels_samplers_reward_models_are_not_importable(tmp_path):
    code = (
        "import importlib.util as u\n"
        "import flowalign.kernels, flowalign.samplers, flowalign.reward_models\n"
        "print([u.find_spec(n) is None for n in ('kernels', 'samplers', 'reward_models')])"
    )
    assert run_outside_repo(code, tmp_path) == "[True, True, True]"


def test_subpackages_map_to_the_repository_folders(tmp_path):
    code = "import flowalign.samplers as s, flowalign.kernels as k; print(s.__file__); print(k.__file__)"
    samplers_file, kernels_file = run_outside_repo(code, tmp_path).splitlines()
    assert Path(samplers_file).parent.name == "samplers" and Path(kernels_file).parent.name == "kernels"


def test_transformers_and_diffusers_import_cleanly_beside_flowalign(tmp_path):
    code = "import flowalign.kernels, transformers, diffusers, sys; print('kernels' in sys.modules)"
    assert run_outside_repo(code, tmp_path) == "False"
