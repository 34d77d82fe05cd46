"""Two processes equal one on video (torchrun with gloo on CPU), under DDP and FSDP2: the tiny Wan2.1 T2V
(5 frames, 16 px, ``video_brightness``), 2 iterations of the Flow-GRPO-Fast preset at the same global batch and seed.
The launch and the comparison are tests/test_fsdp2.py's: the rewards agree to 1e-6 and the LoRA weights to the
reduction's rounding (relative difference < 1e-3 of the update); FSDP2 shards the Wan transformer per block."""

from __future__ import annotations

import json

import pytest

from test_fsdp2 import launch, lora, one_world_per_test, relative_difference, train_here  # noqa: F401
from video_families import tiny_video_pipeline

VIDEO = {"sampling.image_size": 16, "sampling.num_frames": 5, "reward.rewards": "[{name: video_brightness}]"}


@pytest.fixture(scope="module")
def wan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "wan"
    tiny_video_pipeline("wan").save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_processes_match_one_process_on_video(engine, wan_path, tmp_path):
    extra = {**VIDEO, "distributed.engine": engine}
    history = train_here(wan_path, tmp_path / "one", **extra)
    assert history[0]["first_ratio_max"] == 1.0
    launch(wan_path, tmp_path / "two", **extra)
    one, two = (json.loads((tmp_path / n / "checkpoint-000002" / "state.json").read_text())["history"]
                for n in ("one", "two"))
    assert [m["reward"] for m in one] == pytest.approx([m["reward"] for m in two], abs=1e-6)
    assert [m["nfe"] for m in one] == [m["nfe"] for m in two]
    if engine == "fsdp2":
        assert (tmp_path / "two" / "checkpoint-000002" / "sharded" / ".metadata").is_file()
    assert relative_difference(lora(tmp_path / "two", 2), lora(tmp_path / "one", 2)) < 1e-3
