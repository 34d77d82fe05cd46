"""Library code reports progress through ``logging`` (silent unless asked); the command line prints it on stdout."""

import logging
import subprocess
import sys

SCRIPT = """
import logging
from flowalign.cli import show_library_logs
log = logging.getLogger("flowalign.somewhere")
log.info("not shown: nothing asked for the library's logs")
show_library_logs()
show_library_logs()  # once per process: no second handler, no doubled lines
log.info("round %d: levels %s", 1, [0.7])
log.debug("not shown: below INFO")
log.warning("stopped by signal after iteration %d", 3)
"""


def test_the_command_line_prints_the_library_log_as_plain_lines_on_stdout():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == "round 1: levels [0.7]\nstopped by signal after iteration 3\n"
    assert done.stderr == ""


def test_toy_segmenter_progress_is_a_log_record_not_a_print(capsys, caplog, monkeypatch):
    from flowalign.toy.segmenter import SegmenterConfig, train_segmenter

    monkeypatch.setattr(logging.getLogger("flowalign"), "handlers", [])  # as in a process that never ran the CLI

    with caplog.at_level(logging.INFO, logger="flowalign"):
        train_segmenter(SegmenterConfig(steps=2, batch_size=2, threads=1), None, log_every=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "flowalign.toy.segmenter"]
    assert [line.split(" loss ")[0] for line in lines] == ["segmenter step 1/2", "segmenter step 2/2"]
    assert "segmenter step" not in capsys.readouterr().out
