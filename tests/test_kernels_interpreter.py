"""Runs tests/test_kernels.py in a process of its own with TRITON_INTERPRET=1 (triton must see it from the start)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="test_kernels.py runs in this process")
def test_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("FLOWALIGN_KERNELS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
