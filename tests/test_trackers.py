"""The tracker gets more than scalars: the sample grids as images every ``train.sample_every`` iterations, the
before/after grids and table at the end, under ``train.project`` / ``train.run_name`` / ``train.wandb_entity``; read
back with TensorBoard's own event reader and from wandb's offline run folder."""

import io

import pytest
from PIL import Image

from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer
from short_runs import finish_short_run, save_tiny_model, short_run


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-sd3")


def test_tensorboard_gets_the_sample_grids_and_the_before_after(tiny_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    finish_short_run(tiny_model, out, **{"train.tracker": "tensorboard", "train.sample_every": 1,
                                         "train.run_name": "first-try", "train.iterations": 2})
    assert [p.name for p in (out / "flowalign").iterdir()] == ["first-try"]  # the run's folder, nothing else
    events = EventAccumulator(str(out / "flowalign" / "first-try"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert {"samples", "eval/grid_before", "eval/grid_after"} <= set(events.Tags()["images"])
    samples = events.Images("samples")
    assert [s.step for s in samples] == [0, 1]
    for logged in samples:  # each is the grid the run wrote into samples/, pixel for pixel
        written = Image.open(out / "samples" / f"iteration-{logged.step:06d}.png").convert("RGB")
        assert Image.open(io.BytesIO(logged.encoded_image_string)).convert("RGB").tobytes() == written.tobytes()
    [after] = events.Images("eval/grid_after")
    assert after.step == 1 and Image.open(io.BytesIO(after.encoded_image_string)).size == Image.open(
        out / "eval" / "grid_after.png").size
    [table] = events.Tensors("eval/before_after/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert "| tag | before | after |" in text and "| brightness |" in text
    assert "reward" in events.Tags()["scalars"]


def test_wandb_offline_gets_the_images_in_the_runs_own_folder_with_its_names(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # a stray wandb/ would appear here
    out = tmp_path / "run"
    trainer = Trainer(load_config(TrainConfig, None, short_run(tiny_model, out, **{
        "train.tracker": "wandb", "train.sample_every": 1, "train.project": "toy-project",
        "train.run_name": "first-try", "train.wandb_entity": "my-team"})))
    try:
        trainer.train()
    finally:
        import wandb

        wandb.teardown()  # wandb keeps its settings (the run folder among them) in a process-wide singleton
    assert not (tmp_path / "wandb").exists()
    [run_folder] = (out / "flowalign" / "wandb").glob("offline-run-*")
    images = run_folder / "files" / "media" / "images"
    [sample] = images.glob("samples_0_*.png")
    assert Image.open(sample).size == Image.open(out / "samples" / "iteration-000000.png").size
    assert list(images.glob("eval/grid_before_*.png")) and list(images.glob("eval/grid_after_*.png"))
    assert list((run_folder / "files" / "media" / "table" / "eval").glob("before_after_*.table.json"))
    run = trainer.accelerator.get_tracker("wandb", unwrap=True)
    assert (run.project, run.name, run.entity) == ("toy-project", "first-try", "my-team")


def test_a_run_name_that_is_no_folder_name_is_refused_before_anything_loads():
    from flowalign.config import ConfigError

    with pytest.raises(ConfigError, match="train.run_name = '../elsewhere' names a folder"):
        load_config(TrainConfig, None, ["train.run_name=../elsewhere"]).validate()
