"""Video outputs (flowalign.evaluation.videos): mp4 through PyAV decoded back within the codec's loss, frame strips,
grid videos, GIFs for TensorBoard, and the files ``flowalign sample`` writes for a video model. Every video is a tiny
synthetic clip: a red square moving right on a grey ground, 5 frames of 16x16."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.evaluation.videos import (PAD, check_fps, frame_strip, gif_bytes, grid_frames, mp4_codec, read_mp4,
                                         save_frame_strip, strip_indices, video_frames, write_mp4, write_mp4_frames)

FRAMES, SIZE = 5, 16


def moving_square(frames: int = FRAMES, height: int = SIZE, width: int = SIZE, *, colour=(1.0, 0.0, 0.0),
                  step: int = 2) -> torch.Tensor:
    """``[F, 3, H, W]`` in [0, 1]: a 6x6 square of ``colour`` at x = 2 + step * f (rows 4..9) on a 0.5 grey ground."""
    video = torch.full((frames, 3, height, width), 0.5)
    for f in range(frames):
        x = 2 + step * f
        video[f, :, 4:10, x : x + 6] = torch.tensor(colour).view(3, 1, 1)
    return video


def red_centre_x(frame: np.ndarray) -> float:
    """The x of the red square's centre in a decoded ``[H, W, 3]`` uint8 frame (its red-dominant pixels)."""
    red = (frame[..., 0].astype(int) - frame[..., 1].astype(int)) > 100
    return float(np.nonzero(red)[1].mean())


@pytest.mark.parametrize("codec", [None, "mpeg4"])
def test_an_mp4_decodes_back_to_its_frames_size_and_fps_within_the_codec_loss(tmp_path, codec):
    video = moving_square()
    path = write_mp4(video, tmp_path / "clip.mp4", fps=12, codec=codec)
    decoded = read_mp4(path)
    assert decoded.frames.shape == (FRAMES, SIZE, SIZE, 3) and decoded.fps == 12
    assert decoded.codec == {"libx264": "h264", "mpeg4": "mpeg4"}[codec or mp4_codec()]
    expected = np.rint(video.permute(0, 2, 3, 1).numpy() * 255)
    error = np.abs(decoded.frames.astype(float) - expected)
    # yuv420p keeps colour at half resolution: the saturated square's edges blur over a 2x2 chroma block (about 30
    # levels there); the flat ground stays within a few levels
    assert error.mean() < 6 and error[:, 12:].max() <= 6, (error.mean(), error[:, 12:].max())
    assert np.allclose([red_centre_x(f) for f in decoded.frames], [4.5 + 2 * f for f in range(FRAMES)], atol=0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]  # no temporary file left


def test_h264_is_the_encoder_when_ffmpeg_has_it():
    import av

    av.codec.Codec("libx264", "w")  # the installed PyAV wheel ships libx264
    assert mp4_codec() == "libx264"


def test_an_odd_sized_video_is_padded_to_even_by_repeating_its_last_row_and_column(tmp_path):
    video = torch.zeros(3, 3, 13, 15)
    video[:, 1, -1, :] = 1.0  # the last row green, repeated below it
    video[:, 2, :, -1] = 1.0  # the last column blue, repeated to its right
    decoded = read_mp4(write_mp4(video, tmp_path / "odd.mp4", fps=8))
    assert decoded.frames.shape == (3, 14, 16, 3)
    assert decoded.frames[:, 13, 4:10, 1].min() > 200 and decoded.frames[:, 4:10, 15, 2].min() > 200


def test_a_fractional_fps_is_kept_exactly(tmp_path):
    assert check_fps(29.97) == Fraction(2997, 100) and check_fps(24) == 24
    assert read_mp4(write_mp4(moving_square(), tmp_path / "ntsc.mp4", fps=30000 / 1001)).fps == Fraction(30000, 1001)


@pytest.mark.parametrize("fps", [0, -1, float("nan"), float("inf"), True, "16", 5000])
def test_a_bad_fps_is_refused_naming_it(fps):
    with pytest.raises(ValueError, match=r"train\.video_fps must be a number of frames per second"):
        check_fps(fps, "train.video_fps")


def test_a_failed_write_leaves_the_old_mp4_whole_and_no_temporary_file(tmp_path):
    path = write_mp4(moving_square(), tmp_path / "clip.mp4", fps=8)
    before = path.read_bytes()
    with pytest.raises(Exception):
        write_mp4(moving_square(), path, fps=8, codec="no-such-encoder")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]
    with pytest.raises(ValueError, match=r"expected a video shaped \[F, 3, H, W\]"):
        write_mp4(torch.zeros(3, 16, 16), tmp_path / "image.mp4")
    with pytest.raises(ValueError, match="a video needs at least one frame"):
        write_mp4_frames(iter([]), tmp_path / "empty.mp4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]


def test_reading_refuses_a_video_over_its_limits_before_decoding(tmp_path):
    path = write_mp4(moving_square(), tmp_path / "clip.mp4", fps=8)
    with pytest.raises(ValueError, match="exceed the limit of 100 pixels"):
        read_mp4(path, max_pixels=100)
    with pytest.raises(ValueError, match="5 frames exceed the limit of 4"):
        read_mp4(path, max_frames=4)


@pytest.mark.parametrize("count, most, expected", [(5, 0, [0, 1, 2, 3, 4]), (5, 8, [0, 1, 2, 3, 4]), (9, 3, [0, 4, 8]),
                                                   (10, 4, [0, 3, 6, 9]), (81, 5, [0, 20, 40, 60, 80]), (5, 1, [0])])
def test_a_strip_shows_every_frame_or_evenly_spaced_ones_from_first_to_last(count, most, expected):
    assert strip_indices(count, most) == expected


def test_a_frame_strip_is_the_frames_side_by_side_and_its_png_is_exact(tmp_path):
    video = moving_square(9)
    strip = frame_strip(video, 3)
    pixels = np.rint(video.permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8)
    assert strip.shape == (SIZE, 3 * SIZE, 3)
    assert np.array_equal(strip, np.concatenate([pixels[0], pixels[4], pixels[8]], axis=1))
    path = save_frame_strip(video, tmp_path / "strip.png", 3)
    assert np.array_equal(np.asarray(Image.open(path)), strip) and len(list(tmp_path.iterdir())) == 1


def test_a_grid_video_tiles_the_videos_per_frame_row_major(tmp_path):
    videos = torch.stack([moving_square(colour=c) for c in ((1, 0, 0), (0, 1, 0), (0, 0, 1))])
    grid = np.stack(list(grid_frames(videos, columns=2)))
    cell = SIZE + 2 * PAD
    assert grid.shape == (FRAMES, 2 * cell, 2 * cell, 3) and grid.dtype == np.uint8
    for index in range(3):
        row, col = divmod(index, 2)
        y, x = row * cell + PAD, col * cell + PAD
        assert np.array_equal(grid[:, y : y + SIZE, x : x + SIZE], video_frames(videos[index]))
    assert (grid[:, cell + PAD :, cell + PAD :] == 255).all()  # the empty fourth cell is white
    decoded = read_mp4(write_mp4_frames(grid_frames(videos, columns=2), tmp_path / "grid.mp4", fps=8))
    assert decoded.frames.shape == grid.shape and np.abs(decoded.frames.astype(float) - grid).mean() < 6


def test_a_gif_plays_every_frame_at_the_fps_and_shrinks_to_a_largest_side():
    import io

    gif = Image.open(io.BytesIO(gif_bytes(video_frames(moving_square()), fps=10)))
    assert (gif.format, gif.n_frames, gif.size, gif.info["duration"], gif.info["loop"]) == ("GIF", FRAMES, (SIZE, SIZE),
                                                                                          100, 0)
    xs = []
    for f in range(FRAMES):
        gif.seek(f)
        xs.append(red_centre_x(np.asarray(gif.convert("RGB"))))
    assert xs == [4.5 + 2 * f for f in range(FRAMES)]
    wide = video_frames(torch.zeros(2, 3, 10, 40))
    assert Image.open(io.BytesIO(gif_bytes(wide, fps=10, max_side=20))).size == (20, 5)


def test_flowalign_sample_writes_an_mp4_and_a_frame_strip_per_video_and_their_results(tmp_path):
    """``write_outputs`` for a video model (``modality == "video"``, decoded ``[P, F, 3, H, W]``): the decision
    comes from the modality and the tensor's shape, with no model class involved."""
    from flowalign.inference.sample import SAMPLE_OUTPUTS, SampleConfig, write_outputs
    from flowalign.outputs import OutputFolder

    videos = torch.stack([moving_square(colour=c) for c in ((1, 0, 0), (0, 1, 0))])
    metadata = [{"prompt": "a red square moving right", "tag": "motion"}, {"prompt": "a green square", "tag": "x"}]
    config = SampleConfig(out_dir=str(tmp_path / "out"), strip_frames=3)
    summary = write_outputs(config, metadata, videos, torch.tensor([0.5, 0.25]), torch.tensor([10, 10]),
                            modality="video", model_fps=12)
    out = tmp_path / "out"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "grid.mp4", "grid.png", "results.json", "summary.md", "videos/0000.mp4", "videos/0000.png", "videos/0001.mp4",
        "videos/0001.png"]
    written = json.loads((out / "results.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert {k: written[k] for k in ("modality", "frames", "fps", "video_codec", "prompts", "mean_reward")} == {
        "modality": "video", "frames": FRAMES, "fps": 12.0, "video_codec": mp4_codec(), "prompts": 2,
        "mean_reward": 0.375}
    assert written["config"]["strip_frames"] == 3 and written["config"]["fps"] is None
    assert [(r["prompt_id"], r["reward"], r["video"], r["frame_strip"]) for r in written["results"]] == [
        (0, 0.5, "videos/0000.mp4", "videos/0000.png"), (1, 0.25, "videos/0001.mp4", "videos/0001.png")]
    decoded = read_mp4(out / "videos/0001.mp4")
    assert decoded.frames.shape == (FRAMES, SIZE, SIZE, 3) and decoded.fps == 12
    assert np.asarray(Image.open(out / "videos/0001.png")).shape == (SIZE, 3 * SIZE, 3)
    grid = read_mp4(out / "grid.mp4")
    assert grid.frames.shape == (FRAMES, SIZE + 2 * PAD, 2 * (SIZE + 2 * PAD), 3)
    assert "videos of 5 frames at 12 fps" in (out / "summary.md").read_text()
    # every file it wrote is one an --overwrite of the next run deletes
    assert len(OutputFolder(out, SAMPLE_OUTPUTS, "flowalign sample").earlier_outputs()) == 8


def test_flowalign_sample_writes_a_set_of_videos_per_prompt_at_the_configured_fps(tmp_path):
    from flowalign.inference.sample import SampleConfig, write_outputs

    videos = torch.stack([moving_square(), moving_square(step=1)]).unsqueeze(0)  # one prompt, a set of two
    config = SampleConfig(out_dir=str(tmp_path), fps=8, strip_frames=0)
    summary = write_outputs(config, [{"prompt": "p"}], videos, torch.tensor([[0.1, 0.2]]), torch.tensor([20]),
                            modality="video", model_fps=12)
    assert summary["fps"] == 8.0 and summary["images_per_prompt"] == 2
    assert [(r["image_index"], r["filename"], r["frame_strip"]) for r in summary["results"]] == [
        (0, "videos/0000_00.mp4", "videos/0000_00.png"), (1, "videos/0000_01.mp4", "videos/0000_01.png")]
    assert read_mp4(tmp_path / "videos/0000_01.mp4").fps == 8
    assert np.asarray(Image.open(tmp_path / "videos/0000_01.png")).shape == (SIZE, FRAMES * SIZE, 3)


def test_a_video_models_samples_must_have_a_frame_axis(tmp_path):
    from flowalign.inference.sample import SampleConfig, write_outputs

    with pytest.raises(ValueError, match=r"a video model's decoded samples must be \[P, F, 3, H, W\], got shape "
                                         r"\[2, 3, 16, 16\]"):
        write_outputs(SampleConfig(out_dir=str(tmp_path)), [{"prompt": "a"}, {"prompt": "b"}], torch.zeros(2, 3, 16, 16),
                      torch.zeros(2), torch.zeros(2), modality="video")


@pytest.mark.parametrize("argv, message", [
    (["--fps", "0"], "fps must be a number of frames per second in (0, 1000], got 0"),
    (["--strip-frames", "-1"], "strip_frames must be an integer >= 0"),
])
def test_flowalign_sample_refuses_a_bad_fps_or_strip_before_loading(tmp_path, capsys, argv, message):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--out", str(tmp_path / "o"), "--model", str(tmp_path / "no-model"), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def run_log_of_a_video_model(out, *, tracker: str, fps=None, strip_frames: int = 3):
    """The trainer's ``RunLog`` over a real accelerate ``Accelerator`` whose tracker writes into ``out``, for a model
    that declares ``modality = "video"`` and ``fps = 10``: the parts of a trainer that the sample grids read."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from flowalign.training.callbacks import TRACKER_FOLDER, RunLog
    from flowalign.training.config import TrainConfig
    from flowalign.training.run_files import TrackedFolder

    config = TrainConfig()
    config.train.tracker, config.train.out_dir = tracker, str(out)
    config.train.video_fps, config.train.strip_frames = fps, strip_frames
    accelerator = Accelerator(log_with=None if tracker == "none" else tracker, project_dir=str(out))
    trainer = SimpleNamespace(config=config, out_dir=out, accelerator=accelerator, is_main=True,
                              model=SimpleNamespace(modality="video", fps=10))
    log = RunLog(trainer)
    log.tracked = TrackedFolder(log.files, out / TRACKER_FOLDER)  # as RunLog.start: before the tracker writes
    if log.tracking:
        accelerator.init_trackers(TRACKER_FOLDER)
    return log


def sample_batch(count: int = 3):
    """An iteration's batches and scores as ``RunLog.save_samples`` reads them: prompts, rewards and videos."""
    from types import SimpleNamespace

    colours = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    videos = torch.stack([moving_square(colour=colours[i % 3]) for i in range(count)])
    batches = [SimpleNamespace(sample_metadata=[{"prompt": f"square {i}"} for i in range(count)])]
    return batches, SimpleNamespace(images=videos, display=torch.linspace(0, 1, count))


def test_a_video_runs_sample_grid_is_a_grid_mp4_a_strip_png_and_a_tensorboard_gif(tmp_path):
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowalign.training.run_files import RunFiles

    log = run_log_of_a_video_model(tmp_path, tracker="tensorboard")
    batches, scores = sample_batch(3)
    log.save_samples(4, batches, scores)
    log.end()
    grid = read_mp4(tmp_path / "samples/iteration-000004.mp4")
    cell = SIZE + 2 * PAD
    assert grid.frames.shape == (FRAMES, cell, 3 * cell, 3) and grid.fps == 10  # the model's fps
    assert np.allclose([red_centre_x(f[PAD : PAD + SIZE, PAD : PAD + SIZE]) for f in grid.frames],
                       [4.5 + 2 * f for f in range(FRAMES)], atol=0.5)
    strips = Image.open(tmp_path / "samples/iteration-000004.png")
    assert strips.width == 2 * (3 * SIZE * 4 + 2 * PAD)  # two columns of 3-frame strips, frames upscaled 4 times
    recorded = {str(p.relative_to(tmp_path)) for p in RunFiles(tmp_path).recorded()}
    assert {"samples/iteration-000004.mp4", "samples/iteration-000004.png"} <= recorded
    assert any(name.startswith("flowalign/") and "tfevents" in name for name in recorded)
    events = EventAccumulator(str(tmp_path / "flowalign"), size_guidance={"images": 0})
    events.Reload()
    [image] = events.Images("samples")
    assert (image.step, image.width, image.height) == (4, 3 * cell, cell)  # under GIF_SIDE: not shrunk
    gif = Image.open(io.BytesIO(image.encoded_image_string))
    assert (gif.format, gif.n_frames, gif.info["duration"]) == ("GIF", FRAMES, 100)


def test_a_video_runs_sample_grid_takes_train_video_fps_and_needs_no_tracker(tmp_path):
    log = run_log_of_a_video_model(tmp_path, tracker="none", fps=5, strip_frames=0)
    batches, scores = sample_batch(2)
    log.save_samples(10, batches, scores)
    assert read_mp4(tmp_path / "samples/iteration-000010.mp4").fps == 5
    assert Image.open(tmp_path / "samples/iteration-000010.png").width == 2 * (FRAMES * SIZE * 4 + 2 * PAD)
    assert not (tmp_path / "flowalign").exists()


@pytest.mark.parametrize("key, value, message", [
    ("train.video_fps", "0", "train.video_fps must be a number of frames per second"),
    ("train.strip_frames", "-1", "train.strip_frames"),
])
def test_a_bad_video_fps_or_strip_frames_is_refused_naming_the_key(key, value, message):
    from flowalign.config import ConfigError, load_config
    from flowalign.training.config import TrainConfig

    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, [f"{key}={value}"]).validate()


def test_a_video_runs_sample_grid_goes_to_wandb_as_its_mp4(tmp_path, monkeypatch):
    """wandb, where installed (the tracking extra), in offline mode: the logged video is the grid mp4 itself."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    run = tmp_path / "run"
    log = run_log_of_a_video_model(run, tracker="wandb")
    batches, scores = sample_batch(2)
    log.save_samples(7, batches, scores)
    log.end()
    [logged] = (tmp_path / "wandb-dir").rglob("files/media/videos/samples_*.mp4")
    assert logged.read_bytes() == (run / "samples/iteration-000007.mp4").read_bytes()


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory):
    """The tiny Wan2.1 pipeline (flowalign.models.tiny.wan) saved with 16 px frames by default (the transformer's
    ``sample_size``, which the Wan adapter reads): 9 frames (its default) of 16x16."""
    from flowalign.models.tiny.wan import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("a red square moving left right".split(), seed=0)
    pipe.transformer.register_to_config(sample_size=4)
    path = tmp_path_factory.mktemp("tiny-wan") / "pipe"
    pipe.save_pretrained(path)
    return path


def test_flowalign_sample_on_the_tiny_wan_model_writes_its_videos(tmp_path, tiny_wan_dir):
    from flowalign.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na red square moving right\n")
    out = tmp_path / "out"
    main(["sample", "--model", str(tiny_wan_dir), "--prompts", str(prompts), "--reward", "brightness",
          "--reward-frames", '{"aggregate": "min"}', "--steps", "2", "--budget", "2", "--strip-frames", "3",
          "--out", str(out)])
    summary = json.loads((out / "results.json").read_text())
    assert {k: summary[k] for k in ("modality", "frames", "fps", "prompts")} == {
        "modality": "video", "frames": 9, "fps": 16.0, "prompts": 2}
    for row in summary["results"]:
        decoded = read_mp4(out / row["video"])
        assert decoded.frames.shape == (9, SIZE, SIZE, 3) and decoded.fps == 16
        strip = np.asarray(Image.open(out / row["frame_strip"]))  # frames 0, 4 and 8, exact
        frames = np.concatenate([decoded.frames[i] for i in (0, 4, 8)], axis=1).astype(float)
        assert strip.shape == (SIZE, 3 * SIZE, 3) and np.abs(frames - strip).mean() < 6
    assert read_mp4(out / "grid.mp4").frames.shape == (9, SIZE + 2 * PAD, 2 * (SIZE + 2 * PAD), 3)
    for row in summary["results"]:  # the image reward's score of the clip: its darkest frame's brightness
        frames = torch.from_numpy(read_mp4(out / row["video"]).frames).float() / 255
        assert row["reward"] == pytest.approx(float(frames.mean(dim=(1, 2, 3)).min()), abs=0.02)


def test_flowalign_sample_refuses_a_reward_that_does_not_fit_the_models_modality(tmp_path, tiny_wan_dir, capsys):
    from flowalign.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\n")
    base = ["sample", "--model", str(tiny_wan_dir), "--prompts", str(prompts), "--steps", "2", "--budget", "2"]
    with pytest.raises(SystemExit) as exit_info:  # an image reward on clips, with no frame aggregation
        main(base + ["--reward", "brightness", "--out", str(tmp_path / "a")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--reward = 'brightness' scores images" in err and "--reward-frames '{\"aggregate\": \"mean\"}'" in err
    with pytest.raises(SystemExit) as exit_info:  # a video reward told to score frames
        main(base + ["--reward", "video_brightness", "--reward-frames", '{"aggregate": "mean"}',
                     "--out", str(tmp_path / "b")])
    assert exit_info.value.code == 2 and "--reward-frames is set, but 'video_brightness' is a video reward" in \
        capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
