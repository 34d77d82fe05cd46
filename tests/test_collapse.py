"""Collapse metrics (``collapse``): the math by hand, the held-out default, and through the trainer: in
metrics.jsonl, the tracker and the progress bar, and changing nothing else (why the golden runs leave them out)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import load_config
from flowalign.training.callbacks import collapse_postfix
from flowalign.training.collapse import auto_held_out, saturated_fraction, within_group_diversity
from flowalign.training.config import RewardSpec, TrainConfig
from flowalign.training.trainer import Trainer

from test_trainer import final_checkpoint, overrides, tiny_model  # noqa: F401  (the module-scoped tiny SD3 fixture)


def test_saturated_fraction_by_hand():
    """Channels at 0, 1/255 (within the margin), 0.5, 254.5/255 and 1: 4 of 6 are within 1/255 of 0 or 1."""
    images = torch.tensor([0.0, 1 / 255, 0.5, 254.5 / 255, 1.0, 0.3]).reshape(1, 3, 1, 2)
    assert saturated_fraction(images, 1 / 255) == (4.0, 6)
    assert saturated_fraction(images, 0.0) == (2.0, 6)


def test_within_group_diversity_by_hand():
    """Group 0: e, e, e' with e' orthogonal to e: distances 0, 1, 1 -> mean 2/3. Group 1: e, -e, e: 2, 0, 2 -> 4/3."""
    e, f = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    embeddings = torch.stack([e, e, f, e, -e, e])
    got = within_group_diversity(embeddings, torch.tensor([0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(got, torch.tensor([2 / 3, 4 / 3], dtype=torch.float64))


def test_the_held_out_reward_by_default_is_the_other_reading_of_the_toy_verifier():
    soft, partial = RewardSpec("toy_geneval_soft"), RewardSpec("toy_geneval", kwargs={"partial_credit": True})
    binary, ranked_only = RewardSpec("toy_geneval"), RewardSpec("toy_geneval", 0.0, {"partial_credit": True})
    assert auto_held_out([soft]) == ("toy_geneval", {"partial_credit": False})
    assert auto_held_out([soft, ranked_only]) == ("toy_geneval", {"partial_credit": False})  # weight 0: not trained
    assert auto_held_out([partial]) == ("toy_geneval", {"partial_credit": False})  # the default run
    assert auto_held_out([binary]) == ("toy_geneval_soft", {})
    assert auto_held_out([soft, binary]) is None  # both trained: nothing held out
    assert auto_held_out([RewardSpec("pickscore")]) is None
    # The toy video world: the other reading of its verifier.
    video_partial = RewardSpec("toy_video", kwargs={"partial_credit": True})
    assert auto_held_out([video_partial]) == ("toy_video", {"partial_credit": False})  # the video default run
    assert auto_held_out([RewardSpec("toy_video")]) == ("toy_video", {"partial_credit": True})
    assert auto_held_out(load_config(TrainConfig, None, []).reward.rewards) == ("toy_geneval", {"partial_credit": False})


def test_collapse_postfix_of_the_progress_bar():
    metrics = {"reward": 0.5, "collapse/diversity": 0.41234, "collapse/saturated_frac": 0.01,
               "collapse/held_out/toy_geneval": 0.25}
    assert collapse_postfix(metrics) == {"div": "0.412", "sat": "0.010", "held": "0.250"}
    assert collapse_postfix({"reward": 0.5}) == {}


def test_collapse_metrics_reach_metrics_jsonl_and_the_tracker_and_change_nothing_else(tiny_model, tmp_path):  # noqa: F811
    """The held-out reward here is brightness, the trained reward itself, so its value is known: the trained mean.
    With the metrics off, the weights, the optimizer and every other metric are bitwise the same."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    on = Trainer(load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "on", **{
        "train.iterations": 2, "train.tracker": "tensorboard", "collapse.held_out": "brightness"}))).train()
    off = Trainer(load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "off", **{
        "train.iterations": 2, "collapse.enabled": "false"}))).train()
    lines = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    for metrics, line in zip(on, lines):
        assert 0 < line["collapse/diversity"] <= 2 and 0 <= line["collapse/saturated_frac"] <= 1
        assert line["collapse/held_out/brightness"] == pytest.approx(metrics["rewards/brightness/mean"], rel=1e-6)
    pinned = lambda rows: [{k: v for k, v in m.items() if not k.startswith(("time/", "collapse/"))}  # noqa: E731
                           for m in rows]
    assert pinned(on) == pinned(off) and not any(k.startswith("collapse/") for k in off[0])
    a, b = (load_file(str(final_checkpoint(tmp_path / n) / "trainable.safetensors")) for n in ("on", "off"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    events = EventAccumulator(str(next((tmp_path / "on").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"collapse/diversity", "collapse/saturated_frac", "collapse/held_out/brightness"} <= set(tags)
    assert [e.value for e in events.Scalars("collapse/diversity")] == pytest.approx(
        [m["collapse/diversity"] for m in on], rel=1e-6)


def test_a_held_out_reward_that_reads_geneval_metadata_needs_it_in_the_prompts(tiny_model, tmp_path):  # noqa: F811
    from flowalign.errors import SetupError

    prompts = tmp_path / "plain.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    config = load_config(TrainConfig, None, overrides(tmp_path / "no-model", tmp_path / "run", **{
        "data.train_prompts": str(prompts), "collapse.held_out": "toy_geneval"}))
    with pytest.raises(SetupError, match="collapse.held_out = 'toy_geneval' scores a prompt by its GenEval metadata"):
        Trainer(config)
