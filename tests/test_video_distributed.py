"""Two processes equal one on video (gloo on CPU, tests/forked_launch.py), under DDP and FSDP2: the tiny Wan2.1 T2V
(5 frames, 16 px, ``video_brightness``), 2 iterations of the Flow-GRPO-Fast preset at the same global batch and seed.
Both engines' 2-process runs train in one launch (tests/train_runs_worker.py); the comparison is
tests/test_fsdp2.py's: the rewards agree to 1e-6 and the LoRA weights to the reduction's rounding (relative
difference < 1e-3 of the update); FSDP2 shards the Wan transformer per block.

And FSDP2 on every video family (tests/video_families.py), full fine-tuning (and a LoRA where its adapter differs
from Wan2.1's), in one launch whose processes train the families one after another (tests/video_fsdp2_worker.py):
two processes against the contract's one-process runs (tests/video_training.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forked_launch import in_the_background
from test_fsdp2 import lora, one_world_per_test, relative_difference, settings, train_here  # noqa: F401
from test_trainer import TRAIN_CLI
from train_runs_worker import runs_in_the_background
from video_families import VIDEO_FAMILIES, tiny_video_pipeline
from video_fsdp2_worker import train_every_family
from video_training import history, last_checkpoint, video_runs  # noqa: F401 - the session's runs

VIDEO = {"sampling.image_size": 16, "sampling.num_frames": 5, "reward.rewards": "[{name: video_brightness}]"}


@pytest.fixture(scope="module")
def wan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "wan"
    tiny_video_pipeline("wan").save_pretrained(path)
    return path


@pytest.mark.slow
def test_two_processes_match_one_process_on_video_under_ddp_and_fsdp2(wan_path, tmp_path):
    """Both engines' 2-process runs in one launch (tests/train_runs_worker.py), while this process trains
    the one-process runs."""
    extra = {engine: {**VIDEO, "distributed.engine": engine} for engine in ("ddp", "fsdp2")}
    with runs_in_the_background([(TRAIN_CLI[1], settings(wan_path, tmp_path / engine / "two", **extra[engine]))
                                 for engine in extra], tmp_path / "launch"):
        for engine in extra:
            history = train_here(wan_path, tmp_path / engine / "one", **extra[engine])
            assert history[0]["first_ratio_max"] == 1.0
    for engine in extra:
        one, two = (json.loads((tmp_path / engine / n / "checkpoint-000002" / "state.json").read_text())["history"]
                    for n in ("one", "two"))
        assert [m["reward"] for m in one] == pytest.approx([m["reward"] for m in two], abs=1e-6), engine
        assert [m["nfe"] for m in one] == [m["nfe"] for m in two], engine
        assert relative_difference(lora(tmp_path / engine / "two", 2), lora(tmp_path / engine / "one", 2)) < 1e-3, engine
    assert (tmp_path / "fsdp2" / "two" / "checkpoint-000002" / "sharded" / ".metadata").is_file()


# Two FSDP2 processes against one, for every video family: the fp32 tolerances of the comparison. A gradient is summed
# over the batch in another order (each process's half, then a reduce-scatter, against one process's chunks), so it
# agrees to fp32 rounding; Adam's first steps divide each gradient element by its own magnitude, which turns a
# rounding-level difference of a near-zero element into a larger one of its update, and the second iteration's
# gradients are taken at those weights. Measured over every family: gradient norms within 2.4e-4 of each other
# (relative), trained weights within 2.4e-4 of the update's norm; a real difference (a gradient not reduced, a group
# normalised on one process) is of the order of the update itself.
GRAD_NORM_RTOL = 1e-3
UPDATE_RTOL = 1e-3


def trained_weights(checkpoint: Path, finetune: str) -> dict[str, dict[str, torch.Tensor]]:
    """What a checkpoint exports, per file: its LoRA folder's files, or a full fine-tune's transformer folders."""
    if finetune == "lora":
        return {p.name: load_file(str(p)) for p in sorted((checkpoint / "lora").glob("*.safetensors"))}
    return {p.name: load_file(str(p / "diffusion_pytorch_model.safetensors"))
            for p in sorted(checkpoint.glob("transformer*"))}


# Under FSDP2, every family's full fine-tune (every transformer weight sharded, each expert of a pair); a LoRA on the
# families whose adapter differs from Wan2.1's (the first test's LoRA under FSDP2): Wan2.2 A14B's on both experts,
# LTX-2's beside its audio stream, and HunyuanVideo 1.5's, which has no LoRA loader and exports in the transformer's
# own format. Every family's LoRA trains on one process in the contract tests (tests/test_video_families.py).
FSDP2_LORA = ("wan22", "ltx2", "hunyuan_video15")


@pytest.mark.slow
def test_two_fsdp2_processes_train_every_video_family_as_one_process(video_runs, tmp_path):
    """One launch (2 CPU processes on gloo, tests/video_fsdp2_worker.py through tests/forked_launch.py) trains every
    family's contract run under FSDP2 with full fine-tuning, and three families' with a LoRA (``FSDP2_LORA``), every
    transformer parameter (both experts of Wan2.2 A14B) sharded over the two; meanwhile this process trains the
    one-process runs (tests/video_training.py's, which the contract tests check). Two processes agree with one: the
    rewards to 1e-6, the gradient norms and the trained weights (the LoRA's ``lora_B`` matrices, which start at zero;
    every transformer weight of a full fine-tune, against the base) to the tolerances above."""
    names = list(VIDEO_FAMILIES)
    for name in names:
        video_runs.pipeline(name)
    video_runs.prompts()
    runs = [(name, "lora") for name in FSDP2_LORA] + [(name, "full") for name in names]
    with in_the_background(2, train_every_family, video_runs.root, tmp_path, runs, log_dir=tmp_path / "launch"):
        for name, finetune in runs:
            video_runs.run(name, finetune)
    assert json.loads((tmp_path / "sharded.json").read_text()) == {f"{n}-{f}": True for n, f in runs}
    for name, finetune in runs:
        one, two = video_runs.run(name, finetune), tmp_path / f"{name}-{finetune}"
        assert (last_checkpoint(two) / "sharded" / ".metadata").is_file()
        histories = history(one), history(two)
        assert [m["reward"] for m in histories[1]] == pytest.approx([m["reward"] for m in histories[0]], abs=1e-6)
        assert [m["loss"] for m in histories[1]] == pytest.approx([m["loss"] for m in histories[0]], abs=1e-6)
        assert [m["grad_norm"] for m in histories[1]] == pytest.approx([m["grad_norm"] for m in histories[0]],
                                                                        rel=GRAD_NORM_RTOL), (name, finetune)
        weights = [trained_weights(last_checkpoint(run), finetune) for run in (one, two)]
        assert weights[0].keys() == weights[1].keys() and weights[0], (name, finetune)
        base = trained_weights(video_runs.pipeline(name), finetune) if finetune == "full" else None
        for file in weights[0]:
            a, b = weights[1][file], weights[0][file]
            assert a.keys() == b.keys()
            if base is None:  # the LoRA's B matrices: their update from zero
                a, b = ({k: v for k, v in w.items() if "lora_B" in k} for w in (a, b))
            assert relative_difference(a, b, None if base is None else base[file]) < UPDATE_RTOL, (name, finetune, file)
