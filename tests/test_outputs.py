"""Outputs are written whole, never over an existing output, never mixed with an earlier run's, and a path that
cannot be written is refused before any work (flowalign.outputs)."""

import pytest

from flowalign.errors import SetupError
from flowalign.outputs import OutputFolder, check_new_files, check_writable_dir, free_path, write_atomically


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with write_atomically(path) as tmp:
            tmp.write_bytes(b"new, half writ")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]
    with write_atomically(tmp_path / "sub" / "new.bin") as tmp:
        tmp.write_bytes(b"new")
    assert (tmp_path / "sub" / "new.bin").read_bytes() == b"new" and len(list((tmp_path / "sub").iterdir())) == 1


def test_an_existing_output_or_its_sidecar_is_refused_with_a_free_path(tmp_path):
    out = tmp_path / "d.safetensors"
    assert check_new_files(out, also=[out.with_suffix(".json")]) == out
    out.with_suffix(".json").write_text("{}")  # an orphan sidecar counts: it would be paired with the new weights
    with pytest.raises(SetupError, match=r"d\.json' already exists: nothing is overwritten; choose a new path, e\.g\. "
                                         r"--out .*d-2\.safetensors"):
        check_new_files(out, also=[out.with_suffix(".json")])
    (tmp_path / "d-2.safetensors").write_text("")
    assert free_path(out) == tmp_path / "d-3.safetensors"


def test_an_out_dir_that_is_a_file_lies_under_a_file_or_cannot_be_written_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SetupError, match="is a file, not a folder"):
        check_writable_dir(afile, key="train.out_dir")
    with pytest.raises(SetupError, match="lies under the file .*afile"):
        check_writable_dir(afile / "run" / "deeper", key="train.out_dir")
    # not writable, as root too (the tests run as root, which bypasses permission bits): /proc takes no new file,
    # /proc/sys is read-only for everyone
    with pytest.raises(SetupError, match="train.out_dir = '/proc/run'.*cannot write into '/proc'"):
        check_writable_dir("/proc/run", key="train.out_dir")
    with pytest.raises(SetupError, match="train.out_dir = '/proc/sys/run'.*(not writable|cannot write)"):
        check_writable_dir("/proc/sys/run", key="train.out_dir")
    assert check_writable_dir(tmp_path / "new" / "run", key="train.out_dir") == tmp_path / "new" / "run"
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_an_output_folder_with_an_earlier_run_is_refused_and_overwrite_deletes_only_its_files(tmp_path):
    out = tmp_path / "sample"
    folder = OutputFolder(out, ("results.json", "summary.md", "images/[0-9][0-9][0-9][0-9]*.png"), "flowalign sample")
    assert folder.check(overwrite=False) is False  # absent: nothing to replace
    (out / "images").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    assert folder.check(overwrite=False) is False  # the user's own files are no earlier run
    for name in ("results.json", "images/0000.png", "images/0001.png", "images/cover.png"):
        (out / name).write_text("earlier")
    with pytest.raises(SetupError) as refused:
        folder.check(overwrite=False)
    message = str(refused.value)
    assert str(out) in message and "images/0000.png" in message
    assert all(way in message for way in (f"--out {tmp_path / 'sample-2'}", "--overwrite", "move the folder away"))
    assert folder.check(overwrite=True) is True
    folder.replace_earlier()
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["images", "images/cover.png", "notes.txt"]


@pytest.mark.parametrize("argv, earlier", [
    (["sample"], "images/0003.png"),
    (["eval", "toy"], "grid.png"),
    (["eval", "geneval", "--metadata", "assets/prompts/test.jsonl", "--model", "assets/toy-sd3"], "results.json"),
    (["eval", "hpd", "--model", "assets/toy-sd3", "--prompts", "hpd"], "summary.md"),
])
def test_every_sampling_command_refuses_a_folder_with_an_earlier_run_before_loading(tmp_path, capsys, argv, earlier):
    from flowalign.cli import main

    out = tmp_path / "out"
    (out / earlier).parent.mkdir(parents=True, exist_ok=True)
    (out / earlier).write_text("an earlier run's")
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--out", str(out)])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and f"--out {str(out)!r} already holds the outputs of an earlier" in error, error
    assert all(way in error for way in ("--out", "--overwrite", "move the folder away")) and earlier in error
