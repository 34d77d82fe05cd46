"""torch's intra-op thread count from the CPUs free to the process (``flowalign.training.threads``): the cgroup quota
files parsed by hand-computed cases, the quota found over the process's cgroup and its parents, the affinity mask,
and ``train.threads`` validated by name."""

import os

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.training.config import TrainConfig
from flowalign.training.threads import (affinity_count, cgroup_quotas, choose_threads, free_cpus, parse_cfs_quota,
                                        parse_cpu_max, set_threads)


@pytest.mark.parametrize("text,cpus", [("max 100000", None), ("max 100000\n", None), ("150000 100000", 1.5),
                                       ("50000 100000", 0.5), ("200000 50000", 4.0), ("100000 100000\n", 1.0)])
def test_cpu_max_is_quota_over_period_and_max_is_no_limit(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize("text", ["", "max", "150000", "abc 100000", "-5 100000", "0 100000", "100000 0",
                                  "100000 max", "1 2 3"])
def test_a_malformed_cpu_max_is_refused(text):
    with pytest.raises(ValueError, match="cpu.max"):
        parse_cpu_max(text)


def test_cgroup_v1_cfs_quota():
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("250000\n", "100000\n") == 2.5
    with pytest.raises(ValueError, match="cfs_period_us"):
        parse_cfs_quota("100", "0")


@pytest.mark.parametrize("affinity,quotas,threads", [(4, [], 4), (4, [1.5], 1), (4, [2.5, 3.0], 2), (2, [0.5], 1),
                                                     (1, [8.0], 1), (16, [4.0], 4)])
def test_free_cpus_is_the_affinity_capped_by_the_tightest_whole_quota(affinity, quotas, threads):
    assert free_cpus(affinity, quotas) == threads


def test_the_quotas_of_the_process_cgroup_and_its_parents_are_read(tmp_path):
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")  # the root: no limit
    (root / "a" / "cpu.max").write_text("150000 100000\n")  # the parent holds the tighter quota
    (root / "a" / "b" / "cpu.max").write_text("300000 100000\n")
    membership = tmp_path / "cgroup-of-self"
    membership.write_text("1:cpu:/\n0::/a/b\n")
    assert cgroup_quotas(root, membership) == [3.0, 1.5]
    assert free_cpus(8, cgroup_quotas(root, membership)) == 1
    (root / "a" / "cpu.max").write_text("garbage")  # unreadable: skipped, as no quota
    assert cgroup_quotas(root, membership) == [3.0]
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quotas(v1, tmp_path / "absent") == [2.0]
    assert cgroup_quotas(tmp_path / "nothing", tmp_path / "absent") == []


def test_the_affinity_mask_caps_the_auto_count():
    mask = os.sched_getaffinity(0)
    assert affinity_count() == len(mask)
    os.sched_setaffinity(0, {min(mask)})
    try:
        assert affinity_count() == 1
        assert choose_threads(None, 4, env={})[0] == 1
    finally:
        os.sched_setaffinity(0, mask)


def test_auto_never_raises_torchs_count_and_leaves_omp_num_threads_alone():
    free = free_cpus(affinity_count(), cgroup_quotas())
    assert choose_threads(None, 64, env={})[0] == min(64, free)
    assert choose_threads(None, 1, env={})[0] == 1
    assert choose_threads(None, 3, env={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS=3")
    assert choose_threads(5, 1, env={"OMP_NUM_THREADS": "1"}) == (5, "train.threads")
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value,message", [("0", "must be >= 1"), ("many", "expected an int or null"),
                                           ("1.5", "expected an int or null")])
def test_a_bad_train_threads_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(TrainConfig, None, [f"train.threads={value}"])
    assert error.value.key == "train.threads" and "train.threads" in str(error.value)
    assert load_config(TrainConfig, None, ["train.threads=2"]).train.threads == 2
    assert load_config(TrainConfig, None, []).train.threads is None
