"""Group advantages: hand-computed groups, global std, zero-variance groups, clipping, invalid samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowalign.advantages import group_advantages, group_normalize

EPS = 1e-4
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 4.0, 6.0]
GROUPS = [0] * 4 + [1] * 4 + [2] * 4


def test_group_std_hand_computed():
    adv, stats = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS))
    # group 0: mean 0.5, population std 0.5; group 1: constant; group 2: mean 3, population std sqrt(5)
    a0 = 0.5 / (0.5 + EPS)
    s2 = math.sqrt(5.0)
    expected = [a0, -a0, a0, -a0, 0, 0, 0, 0, -3 / (s2 + EPS), -1 / (s2 + EPS), 1 / (s2 + EPS), 3 / (s2 + EPS)]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    assert adv.dtype == torch.float32
    assert stats["num_groups"] == 3 and stats["zero_std_groups"] == 1
    assert stats["zero_std_frac"] == pytest.approx(1 / 3)
    assert stats["num_invalid"] == 0 and stats["clip_frac"] == 0.0


def test_population_std_not_unbiased():
    # With K=2 the unbiased std would be sqrt(2) times larger: population std of [0, 2] is 1.
    adv, _ = group_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]))
    torch.testing.assert_close(adv, torch.tensor([-1 / (1 + EPS), 1 / (1 + EPS)]))


def test_global_std_hand_computed():
    adv, stats = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), std="global")
    global_std = float(np.std(REWARDS))  # numpy's default is the population std
    means = [0.5] * 4 + [1.0] * 4 + [3.0] * 4
    expected = [(r - m) / (global_std + EPS) for r, m in zip(REWARDS, means)]
    expected[4:8] = [0.0] * 4
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    assert stats["zero_std_groups"] == 1


def test_zero_variance_groups_are_exactly_zero_and_counted():
    # 0.1 + 0.2 style values whose mean is not exactly representable must still cancel.
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.7, 0.7, 0.7, 0.1, 0.9])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    for std in ("group", "global"):
        adv, stats = group_advantages(rewards, groups, std=std)
        assert (adv[:6] == 0).all()
        assert stats["zero_std_groups"] == 2 and stats["zero_std_frac"] == pytest.approx(2 / 3)
        assert (adv[6:].abs() > 0.5).all()


def test_clipping():
    # K=37 with one outlier: its advantage is sqrt(36) = 6 before clipping, the others -1/6.
    rewards = torch.zeros(37)
    rewards[5] = 1.0
    adv, stats = group_advantages(rewards, torch.zeros(37, dtype=torch.long))
    assert adv[5].item() == 5.0
    torch.testing.assert_close(adv[0], torch.tensor((-1 / 37) / (6 / 37 + EPS)), rtol=1e-5, atol=0)
    assert stats["clip_frac"] == pytest.approx(1 / 37)

    adv, stats = group_advantages(torch.tensor([0.0, 0.0, 0.0, 10.0]), torch.zeros(4, dtype=torch.long), clip=1.5)
    # mean 2.5, std sqrt(18.75): the outlier gets sqrt(3) > 1.5, the rest -1/sqrt(3)
    assert adv[3].item() == 1.5
    torch.testing.assert_close(adv[:3], torch.full((3,), -1 / math.sqrt(3)), rtol=1e-4, atol=0)
    assert stats["clip_frac"] == 0.25

    unclipped, _ = group_advantages(torch.tensor([0.0, 0.0, 0.0, 10.0]), torch.zeros(4, dtype=torch.long), clip=None)
    assert unclipped[3].item() == pytest.approx(math.sqrt(3), rel=1e-4)


def test_invalid_samples_are_masked():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, float("inf"), 2.0, 4.0, 100.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    valid = torch.tensor([True, True, True, True, True, True, True, False])  # 100 is valid-but-flagged by caller
    adv, stats = group_advantages(rewards, groups, valid)
    assert torch.isfinite(adv).all()
    assert adv[1] == 0 and adv[4] == 0 and adv[7] == 0
    # group 0 over [1, 0, 1]: mean 2/3, std sqrt(2)/3; group 1 over [2, 4]: mean 3, std 1
    s0 = math.sqrt(2) / 3
    hi, lo = (1 / 3) / (s0 + EPS), (-2 / 3) / (s0 + EPS)
    expected = [hi, 0, lo, hi, 0, -1 / (1 + EPS), 1 / (1 + EPS), 0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    assert stats["num_invalid"] == 3

    global_adv, _ = group_advantages(rewards, groups, valid, std="global")
    assert torch.isfinite(global_adv).all() and global_adv[7] == 0
    global_std = float(np.std([1, 0, 1, 2, 4]))
    assert global_adv[5].item() == pytest.approx(-1 / (global_std + EPS), rel=1e-5)


def test_all_invalid_or_single_member_groups_give_zeros_not_nan():
    adv, stats = group_advantages(torch.full((4,), float("nan")), torch.tensor([0, 0, 1, 1]))
    assert (adv == 0).all()
    assert stats["zero_std_groups"] == 2 and stats["num_invalid"] == 4 and stats["clip_frac"] == 0.0

    adv, stats = group_advantages(torch.tensor([1.0, float("nan"), 3.0, 5.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[0] == 0 and adv[1] == 0  # one valid member: nothing to rank
    assert stats["zero_std_groups"] == 1


def test_groups_may_span_arbitrary_positions():
    rewards = torch.tensor(REWARDS)
    groups = torch.tensor(GROUPS)
    permutation = torch.randperm(len(REWARDS), generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([70, -3, 12])[groups]  # arbitrary, non-contiguous group ids
    for std in ("group", "global"):
        reference, _ = group_advantages(rewards, groups, std=std)
        shuffled, stats = group_advantages(rewards[permutation], ids[permutation], std=std)
        torch.testing.assert_close(shuffled, reference[permutation])
        assert stats["num_groups"] == 3


def test_normalising_a_split_group_per_process_differs():
    # Why the trainer must gather first: half a group has a different mean and std than the whole group.
    rewards, groups = torch.tensor([0.0, 1.0, 3.0, 8.0]), torch.zeros(4, dtype=torch.long)
    gathered, _ = group_advantages(rewards, groups)
    halves = [group_advantages(rewards[i : i + 2], groups[i : i + 2])[0] for i in (0, 2)]
    per_process = torch.cat(halves)
    assert not torch.allclose(gathered, per_process, atol=1e-2)


def test_group_normalize_does_not_clip():
    rewards = torch.zeros(37)
    rewards[0] = 1.0
    normalized, _ = group_normalize(rewards, torch.zeros(37, dtype=torch.long))
    assert normalized[0].item() == pytest.approx(6.0, rel=1e-3)


def test_input_errors():
    r, g = torch.tensor([0.0, 1.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="std mode"):
        group_advantages(r, g, std="batch")
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(r, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(r, torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="valid"):
        group_advantages(r, g, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="clip"):
        group_advantages(r, g, clip=0)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
