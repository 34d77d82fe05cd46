"""The video families' contract training runs, each trained once per test session and shared by the tests that read
it (tests/test_video_families.py checks each run, tests/test_video_distributed.py compares 2 FSDP2 processes with it).

A run is 2 iterations of the default method (the trainer's defaults: Flow-GRPO-Fast) on a family's tiny pipeline,
saved with ``save_pretrained``, at the contract's smallest shapes (``training_values``): LoRA or full fine-tuning
(``model.finetune``), one process, ``video_brightness``; an image-to-video family on prompts with a first frame, and
the family's own ``training`` overrides (Wan2.2 A14B: steps on both sides of the expert boundary).

The runs live under the session's base temporary directory, which every pytest-xdist worker of a session shares, so a
run is trained by whichever test needs it first and read by the others: a lock file per run orders the workers, and a
run (or saved pipeline) is written into a temporary sibling and renamed into place, so what a name holds is complete.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import small_run_values, torch_threads
from video_families import VIDEO_FAMILIES, tiny_video_pipeline

FINETUNES = ("lora", "full")
FROZEN_RECORD = "frozen.json"


def training_values(name: str, directory: Path, out: Path, prompts: Path, finetune: str, **extra) -> dict:
    """The contract run's config overrides for family ``name`` (``directory``: its saved pipeline; ``prompts``: a
    prompt file with a first frame per prompt, for an image-to-video family). An image-to-video family samples at the
    32 px of its condition images, or at the size the pipeline gives them (``sized_by_image``)."""
    family = VIDEO_FAMILIES[name]
    values = {**small_run_values(directory, out), "sampling.image_size": family.sizes[0][0],
              "sampling.num_frames": family.frames, "train.checkpoint_every": 2,
              "reward.rewards": "[{name: video_brightness}]", "model.finetune": finetune}
    if family.condition_images is not None:
        values.update({"data.train_prompts": str(prompts),
                       "sampling.image_size": family.sizes[0][0] if family.sized_by_image else 32})
    return {**values, **family.training, **extra}


def frozen_components(model) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of the state of every pipeline component outside the transformer(s): the text encoders, image
    encoders and the VAE, which no fine-tune trains."""
    return {name: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for name, module in model.pipe.components.items()
            if isinstance(module, torch.nn.Module) and not name.startswith("transformer")}


def last_checkpoint(run: Path) -> Path:
    return run / "checkpoint-000002"


def history(run: Path) -> list[dict]:
    """The run's per-iteration metrics, as its last checkpoint records them."""
    return json.loads((last_checkpoint(run) / "state.json").read_text())["history"]


@contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (created), across processes."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shared_root(tmp_path_factory) -> Path:
    """The directory every worker of this pytest session shares (the parent of an xdist worker's base temp)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "video-training"
    root.mkdir(exist_ok=True)
    return root


class SharedVideoRuns:
    """The session's saved tiny pipelines and contract runs under ``root`` (module docstring)."""

    def __init__(self, root: Path):
        self.root = root

    def _once(self, name: str, write) -> Path:
        """``root / name``, written by ``write(tmp)`` into a temporary sibling and renamed into place the first time."""
        path = self.root / name
        with locked(self.root / f".lock-{name}"):
            if not path.exists():
                tmp = self.root / f".tmp-{name}-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                write(tmp)
                os.replace(tmp, path)
        return path

    def pipeline(self, name: str) -> Path:
        """The family's tiny pipeline, saved with ``save_pretrained``."""
        return self._once(f"pipeline-{name}", lambda tmp: tiny_video_pipeline(name).save_pretrained(tmp))

    def prompts(self) -> Path:
        """Two prompts with one first frame each (tests/test_editing.py's), for the image-to-video families."""
        from test_editing import editing_prompts

        return self._once("prompts", lambda tmp: editing_prompts(tmp)) / "edits.jsonl"

    def values(self, name: str, out: Path, finetune: str, **extra) -> dict:
        return training_values(name, self.pipeline(name), out, self.prompts(), finetune, **extra)

    def run(self, name: str, finetune: str) -> Path:
        """The family's contract run (one process), trained the first time; its directory also holds
        ``frozen.json``: for each component outside the transformer, whether training left it bitwise unchanged."""

        def write(tmp: Path) -> None:
            values = self.values(name, tmp, finetune)
            # one intra-op thread, as an xdist worker and each process of a 2-process launch run: the comparisons
            # with 2 processes (tests/test_video_distributed.py) hold fp32 reduction-order tolerances measured so,
            # and a plain `pytest` of one file (torch's 2 threads) would otherwise sum in another order
            with torch_threads(1):
                trainer = Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()]))
                before = frozen_components(trainer.model)
                trainer.train()
            after = frozen_components(trainer.model)
            unchanged = {component: before[component].keys() == after[component].keys() and all(
                torch.equal(before[component][k], after[component][k]) for k in before[component])
                for component in before}
            (tmp / FROZEN_RECORD).write_text(json.dumps(unchanged, indent=1) + "\n")

        return self._once(f"run-{name}-{finetune}", write)


@pytest.fixture(scope="session")
def video_runs(tmp_path_factory) -> SharedVideoRuns:
    """The session's contract runs (import it into a test module to use it there)."""
    return SharedVideoRuns(shared_root(tmp_path_factory))
