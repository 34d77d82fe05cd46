"""examples/quickstart.ipynb runs top to bottom (nbclient, a real ipykernel) and shows what it says it shows; the
README's figure script (docs/figures/default_run.py) draws its figure from that run's folder.

The notebook's parameters cell (tagged ``parameters``) is replaced by a short run: 2 iterations on small batches and
a one-image-per-tag evaluation, written under a temporary folder. The tests check the outputs: the inline images (the
reward curve, the sample grids, the before/after figures, the diffusers samples of the exported LoRA), the export
folder (which plain diffusers loaded in the notebook, and which holds the LoRA weights), and the summary's metrics.
"""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples/quickstart.ipynb"
FAST = ["data.prompts_per_iteration=2", "data.group_size=4", "sampling.num_steps=4", "train.eval_steps=2"]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (parameters,) = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert "ITERATIONS = 20" in parameters.source  # the committed notebook runs the full ~20 iterations
    out = tmp_path_factory.mktemp("notebook") / "run"
    parameters.source = (f"ITERATIONS = 2\nEVAL_IMAGES_PER_TAG = 1\nSAMPLE_EVERY = 1\nOUT = {str(out)!r}\n"
                         f"EXTRA = {FAST!r}")
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})  # Jupyter's working folder
    client.execute()
    return notebook, out


def image_outputs(cell) -> int:
    return sum("image/png" in output.get("data", {}) for output in cell.get("outputs", []))


def test_the_quickstart_notebook_runs_and_shows_its_results(executed):
    notebook, out = executed
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    # quiet_libraries(): the libraries' loading bars, deprecation warnings and notes stay out of the cells
    noise = [o.text for cell in code for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not [t for t in noise if any(word in t for word in ("Loading", "Warning", "IProgress", "No LoRA keys"))]
    shown = {cell.source.splitlines()[0]: image_outputs(cell) for cell in code if image_outputs(cell)}
    assert sum(shown.values()) >= 5, shown  # the curve, two sample grids, the before/after bars and grids, the export
    summary = json.loads("".join(o.text for o in code[-1].outputs if o.output_type == "stream"))
    assert summary["iterations"] == 2
    assert summary["eval_images"] == 66  # one image for each of the 66 held-out prompts (1 per tag, rounded up)
    assert 0.0 <= summary["before"] <= 1.0 and 0.0 <= summary["after"] <= 1.0
    assert abs(summary["gain"] - (summary["after"] - summary["before"])) < 1e-9
    assert 0.0 <= summary["reward_first"] <= 1.0
    lora = Path(summary["lora"])
    assert lora.parent == out and (lora / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((lora / "flowalign_export.json").read_text())["weights"] == "ema"
    assert sorted(p.name for p in (out / "samples").glob("iteration-*.png")) == [
        "iteration-000000.png", "iteration-000001.png"]


def test_the_readme_figure_is_drawn_from_a_runs_folder(executed, tmp_path, monkeypatch):
    _, out = executed
    monkeypatch.chdir(REPO)  # the run's config names the toy pipeline and prompts relative to the repository
    monkeypatch.syspath_prepend(str(REPO / "docs/figures"))
    import default_run

    report = json.loads((out / "eval/before_after.json").read_text())
    gains = {tag: entry["diff"] for tag, entry in report["paired"]["tags"].items()}
    assert default_run.tag_gains(out, None) == gains
    figure = default_run.main([str(out), "--images", "2", "--steps", "2", "--out", str(tmp_path / "figure.png")])
    image = Image.open(figure)
    assert image.size == (1100, 440) and figure.stat().st_size < 300_000
    assert len(default_run.rewards_per_iteration(out)) == 2
    del sys.modules["default_run"]
