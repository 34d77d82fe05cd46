"""flowalign.memory.resident: the peak resident memory since a reset, read from /proc."""

import numpy as np

from flowalign.memory.resident import reset_peak, resident


def test_the_peak_since_a_reset_holds_what_ran_in_between_and_not_before():
    early = np.ones(64 * 2**20 // 8)  # 64 MiB resident, then freed: the life-long peak holds it
    del early
    before = reset_peak()
    assert resident()["VmHWM"] < before + 32 * 2**20  # the reset forgot the earlier 64 MiB
    block = np.ones(48 * 2**20 // 8)  # 48 MiB, touched
    grown = resident()["VmHWM"] - before
    del block
    assert 40 * 2**20 < grown < 200 * 2**20
    assert resident()["VmHWM"] >= before + 40 * 2**20  # still the peak after the block is freed
