"""flowalign.memory.resident: the peak resident memory since a reset, read from /proc."""

import mmap

from flowalign.memory.resident import reset_peak, resident

MIB = 2**20


def touched(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory, every page written, in 4 KiB pages: each page is its own fault, so the
    kernel's batched counters (64 faults per thread before Linux 6.2) lag by at most 256 KiB. numpy's buffers ask for
    transparent huge pages, whose 2 MiB faults a pre-6.2 kernel may not count at all below 64 of them: the CI machine
    saw a 48 MiB numpy array add nothing to ``VmRSS``."""
    block = mmap.mmap(-1, size)
    block.madvise(mmap.MADV_NOHUGEPAGE)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_the_peak_since_a_reset_holds_what_ran_in_between_and_not_before():
    early = touched(64 * MIB)  # resident, then freed: the life-long peak holds it
    early.close()
    before = reset_peak()
    assert resident()["VmHWM"] < before + 32 * MIB  # the reset forgot the earlier 64 MiB
    block = touched(48 * MIB)
    grown = resident()["VmHWM"] - before
    block.close()
    assert 40 * MIB < grown < 200 * MIB, f"{grown / MIB:.1f} MiB"
    assert resident()["VmHWM"] >= before + 40 * MIB  # still the peak after the block is freed
