"""The two readings of a minibatch (``optim.minibatch_split``): a share of the trained steps at every sample
(``steps``), or every trained step of a share of the rollout chunks (``samples``, flow_grpo's released code, whose
``num_batches_per_epoch / gradient_accumulation_steps`` optimizer steps per epoch are the minibatches)."""

from __future__ import annotations

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.training.config import TrainConfig
from flowalign.training.minibatches import minibatch_units

from flowalign.models.tiny import tiny_sd3_pipeline

from test_presets import REPO, small_run, words


def test_steps_split_hand_computed():
    # shuffled steps [3, 1, 2, 0], 2 chunks, 2 minibatches: each takes 2 steps at both chunks, step by step
    assert minibatch_units("steps", [3, 1, 2, 0], 2, 0, 2) == [
        [(0, 3), (1, 3), (0, 1), (1, 1)],
        [(0, 2), (1, 2), (0, 0), (1, 0)],
    ]
    with pytest.raises(ValueError, match="do not divide the 3 trained steps"):
        minibatch_units("steps", [0, 1, 2], 2, 0, 2)


def test_samples_split_hand_computed():
    """4 chunks, 2 minibatches: a drawn permutation of each block of 2 consecutive chunks deals one chunk of the block
    to each minibatch, which trains every step of its chunks, step by step."""
    gen = torch.Generator().manual_seed(0)
    deals = [torch.randperm(2, generator=gen).tolist() for _ in range(2)]
    owner = [deals[0][0], deals[0][1], deals[1][0], deals[1][1]]
    got = minibatch_units("samples", [2, 0], 4, 0, 2, torch.Generator().manual_seed(0))
    for m in range(2):
        mine = [j for j in range(4) if owner[j] == m]
        assert len(mine) == 2 and len({j // 2 for j in mine}) == 2  # one chunk of each block
        assert got[m] == [(mine[0], 2), (mine[1], 2), (mine[0], 0), (mine[1], 0)]
    with pytest.raises(ValueError, match="do not divide the 3 rollout chunks"):
        minibatch_units("samples", [0], 3, 0, 2, torch.Generator())


def test_no_trained_step_gives_empty_minibatches_in_both_readings():
    assert minibatch_units("samples", [], 3, 0, 2, torch.Generator()) == [[], []]
    assert minibatch_units("steps", [], 3, 0, 2) == [[], []]


def test_one_minibatch_is_the_same_in_both_readings():
    steps = [4, 0, 2]
    assert minibatch_units("samples", steps, 3, 0, 1, torch.Generator()) == minibatch_units("steps", steps, 3, 0, 1)


def test_the_samples_split_does_not_depend_on_the_process_count():
    """8 global chunks, 2 minibatches: one process with all 8, or 2 processes with 4, or 4 with 2, give every global
    chunk the same minibatch, and every process the same number of chunks in each."""
    def owners(processes):
        chunks, owner = 8 // processes, {}
        for p in range(processes):
            units = minibatch_units("samples", [0], chunks, p * chunks, 2, torch.Generator().manual_seed(5))
            for m, minibatch in enumerate(units):
                assert len(minibatch) == chunks // 2
                owner.update({p * chunks + j: m for j, _ in minibatch})
        return owner

    assert owners(1) == owners(2) == owners(4) and sorted(owners(1)) == list(range(8))


def test_the_config_checks_the_split_it_names():
    flow_grpo = REPO / "configs/methods/flow_grpo.yaml"
    config = load_config(TrainConfig, flow_grpo, [])
    assert (config.optim.minibatches, config.optim.minibatch_split, config.sampling.batch_size) == (2, "samples", 16)
    layout = config.check_batch(1)
    assert (layout.micro_batches_per_process, layout.micro_batches_per_minibatch) == (4 * 9, 2 * 9)
    with pytest.raises(ConfigError, match=r"optim.minibatches = 2 does not divide the 1 rollout chunks per process "
                                          r"\(64 samples / sampling.batch_size 64\).*set sampling.batch_size to 32"):
        load_config(TrainConfig, flow_grpo, ["sampling.batch_size=null"])
    with pytest.raises(ConfigError, match=r"optim.minibatches = 2 does not divide the 9 .*minibatch_split: samples"):
        load_config(TrainConfig, flow_grpo, ["optim.minibatch_split=steps"])
    with pytest.raises(ConfigError, match="minibatch_split"):
        load_config(TrainConfig, flow_grpo, ["optim.minibatch_split=prompts"])


def test_the_flow_grpo_preset_takes_two_optimizer_steps_each_on_half_the_chunks(tmp_path):
    """A small flow_grpo iteration (2 prompts x 2 samples in 2 chunks of 2): 2 optimizer steps, the first ratio
    exactly 1, and each minibatch trains every trained step of one chunk."""
    from flowalign.training.trainer import Trainer

    tiny_sd3_pipeline(words(), seed=0).save_pretrained(tmp_path / "sd3")
    config = load_config(TrainConfig, REPO / "configs/methods/flow_grpo.yaml",
                         small_run(tmp_path / "sd3", tmp_path / "run") + ["train.iterations=1"])
    trainer = Trainer(config)
    seen = []
    original = trainer.micro_batch_loss

    def recording(batch, step):
        seen.append((trainer.optimizer_steps, int(batch.sample_ids[0]), step))
        return original(batch, step)

    trainer.micro_batch_loss = recording
    history = trainer.train()
    assert trainer.optimizer_steps == 2 and history[0]["first_ratio_max"] == 1.0
    for optimizer_step in (0, 1):
        mine = [(chunk, step) for at, chunk, step in seen if at == optimizer_step]
        assert len({chunk for chunk, _ in mine}) == 1 and sorted(step for _, step in mine) == list(range(9))
    assert {chunk for _, chunk, _ in seen} == {0, 2}  # the two chunks' first sample ids
