"""The toy video world's model: `flowalign toy pretrain-video`, `flowalign eval toy-video`, and the video main job
(configs/video/default.yaml) end to end, on the toy Wan architecture at a handful of steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from flowalign import cli
from flowalign.evaluation.geneval import load_metadata
from flowalign.evaluation.images import cell_size
from flowalign.evaluation.toy_eval import sample_seed
from flowalign.models.loading import load_flow_model
from flowalign.toy.prompts import PROMPT_ASSET_DIR
from flowalign.toy.video_pretrain import VideoPretrainConfig, pretrain_video

REPO = Path(__file__).resolve().parents[1]
TINY_PRETRAIN = dict(vae_steps=2, vae_batch_size=2, calibration_clips=4, latent_clips=4, steps=2, batch_size=2,
                     warmup_steps=1)


@pytest.fixture(scope="module")
def toy_wan(tmp_path_factory):
    """A toy Wan pipeline after two VAE and two flow steps (the architecture of assets/toy-wan)."""
    out = tmp_path_factory.mktemp("toy-wan") / "toy-wan"
    pretrain_video(VideoPretrainConfig(out=str(out), **TINY_PRETRAIN))
    return out


def test_pretrain_video_writes_a_reproducible_wan_pipeline_through_save_pretrained(toy_wan, tmp_path):
    model = load_flow_model(toy_wan)
    assert model.family == "wan" and model.modality == "video"
    # 2x2 pixels folded into 4 channels, no further downsampling in space or time
    assert model.default_image_size == (32, 32) and model.temporal_compression == 1
    assert model.latent_shape(1) == (1, 4, 9, 16, 16)  # the family's default 9 frames; the toy clips have 5
    files = sorted(p.relative_to(toy_wan).as_posix() for p in toy_wan.rglob("*.safetensors"))
    assert files == ["text_encoder/model.safetensors", "transformer/diffusion_pytorch_model.safetensors",
                     "vae/diffusion_pytorch_model.safetensors"]
    assert sum(p.stat().st_size for p in toy_wan.rglob("*") if p.is_file()) < 30 * 2**20
    log = json.loads((toy_wan / "pretrain_log.json").read_text())
    assert log["config"]["steps"] == 2 and len(log["latents_std"]) == 4 and log["total_seconds"] > 0
    assert not list(toy_wan.parent.glob("*.tmp")) and not list(toy_wan.parent.glob("*.old"))

    again = tmp_path / "again"
    pretrain_video(VideoPretrainConfig(out=str(again), **TINY_PRETRAIN))
    for name in files:
        first, second = load_file(toy_wan / name), load_file(again / name)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "vae/config.json").read_text()) == json.loads((toy_wan / "vae/config.json").read_text())


def _exit_status(argv) -> int:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return exit_info.value.code


def test_pretrain_video_refuses_a_frame_count_the_toy_vae_cannot_take(capsys, monkeypatch):
    assert _exit_status(["toy", "pretrain-video", "--num-frames", "1", "--out", "unused"]) == 2
    assert "num_frames" in capsys.readouterr().err
    # A VAE that compresses time 4x (Wan2.1's own factor) takes 4k+1 frames only.
    from flowalign.toy import video_pretrain

    monkeypatch.setitem(video_pretrain.VIDEO_ARCHITECTURE, "vae", {**video_pretrain.VIDEO_ARCHITECTURE["vae"],
                                                                   "temporal_levels": 2})
    assert _exit_status(["toy", "pretrain-video", "--num-frames", "7", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "num_frames = 7" in err and "use 5 or 9" in err


def test_pretrain_video_continues_an_earlier_pipeline_on_its_vae(toy_wan, tmp_path):
    """``init_from``: the VAE is the parent's bit for bit (no VAE stage), the flow stage trains one more cycle from
    the parent's DiT, or from a new DiT of another patch; the log holds the parent's."""
    parent_log = json.loads((toy_wan / "pretrain_log.json").read_text())
    vae = "vae/diffusion_pytorch_model.safetensors"
    dit = "transformer/diffusion_pytorch_model.safetensors"

    continued = tmp_path / "continued"
    pretrain_video(VideoPretrainConfig(out=str(continued), init_from=str(toy_wan), seed=1, **TINY_PRETRAIN))
    log = json.loads((continued / "pretrain_log.json").read_text())
    assert log["parent"] == parent_log and log["vae_seconds"] == 0.0 and log["vae_mse"] == []
    assert log["latents_std"] == parent_log["latents_std"] and len(log["flow_loss"]) == 2
    before, after = load_file(toy_wan / vae), load_file(continued / vae)
    assert all(torch.equal(before[k], after[k]) for k in before)
    before, after = load_file(toy_wan / dit), load_file(continued / dit)
    assert before.keys() == after.keys() and not all(torch.equal(before[k], after[k]) for k in before)
    assert load_flow_model(continued).family == "wan"
    # the written configs do not carry the path the parent was loaded from
    written = [continued / "model_index.json", *continued.glob("*/config.json")]
    assert len(written) == 4 and not any("_name_or_path" in json.loads(p.read_text()) for p in written)

    finer = tmp_path / "finer"
    pretrain_video(VideoPretrainConfig(out=str(finer), init_from=str(toy_wan), reinit_transformer=True,
                                       patch_size=[1, 2, 2], **TINY_PRETRAIN))
    config = json.loads((finer / "transformer/config.json").read_text())
    parent_config = json.loads((toy_wan / "transformer/config.json").read_text())
    assert config["patch_size"] == [1, 2, 2] and parent_config["patch_size"] == [1, 4, 4]
    assert config["sample_size"] == parent_config["sample_size"]  # the adapter's default frame size
    log = json.loads((finer / "pretrain_log.json").read_text())
    assert log["architecture"]["transformer"]["patch_size"] == [1, 2, 2] and log["parent"] == parent_log
    model = load_flow_model(finer)
    latents = torch.randn(1, 4, 5, 16, 16)
    cond = model.encode(["a red circle moving to the left"])
    assert model.velocity(latents, torch.tensor([0.5]), cond).shape == latents.shape


def test_pretrain_video_refuses_bad_patches_and_continuations_before_loading(toy_wan, capsys, tmp_path):
    cases = [
        (["patch_size=[1,3,3]"], "patch_size = [1, 3, 3]"),
        (["patch_size=[1,4]"], "three positive integers"),
        ([f"init_from={tmp_path / 'nothing'}"], "init_from"),
        ([f"init_from={tmp_path / 'other'}"], "is a StableDiffusion3Pipeline, not the toy WanPipeline"),
        ([f"init_from={toy_wan}", "patch_size=[1,2,2]"], "reinit_transformer=true"),
        ([f"init_from={toy_wan}", f"out={toy_wan}"], "never replaces another run's files"),
        (["reinit_transformer=true"], "reinit_transformer = true needs init_from"),
    ]
    other = tmp_path / "other"  # a crafted folder: the files named, another pipeline class
    (other / "transformer").mkdir(parents=True)
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (other / "pretrain_log.json").write_text("{}")
    (other / "transformer/config.json").write_text(json.dumps({"patch_size": [1, 4, 4]}))
    for overrides, message in cases:
        argv = ["toy", "pretrain-video", *([] if any(o.startswith("out=") for o in overrides) else
                                           [f"out={tmp_path / 'unused'}"]), *overrides]
        assert _exit_status(argv) == 2, overrides
        assert message in capsys.readouterr().err, overrides
    assert not (tmp_path / "unused").exists()


def test_eval_toy_video_writes_verdicts_checks_and_frame_strips(toy_wan, tmp_path):
    out = tmp_path / "eval"
    argv = ["eval", "toy-video", "--model", str(toy_wan), "--max-prompts", "3", "--images-per-prompt", "2",
            "--steps", "2", "--out", str(out), "--device", "cpu"]
    assert cli.main(argv) == 0
    record = json.loads((out / "results.json").read_text())
    metadata = load_metadata(PROMPT_ASSET_DIR / "video_test.jsonl")[:3]
    assert [(r["prompt_id"], r["image_index"]) for r in record["results"]] == [(p, k) for p in range(3) for k in range(2)]
    for result in record["results"]:
        assert result["prompt"] == metadata[result["prompt_id"]]["prompt"]
        assert result["seed"] == sample_seed(0, result["prompt_id"], result["image_index"])
        assert set(result["checks"]) == {"object", "count", "color", "direction"}
        assert result["partial"] == sum(result["checks"].values()) / 4 and result["correct"] == (result["partial"] == 1)
    assert set(record["summary"]["checks"]) == {"colors", "overall"}
    assert "| colors |" in (out / "summary.md").read_text()
    with Image.open(out / "strips.png") as strips:
        cell_w, cell_h = cell_size(32, 5 * 32, 4)
        assert strips.size == (2 * cell_w, 3 * cell_h)  # 6 strips of 5 frames, 2 columns


def test_eval_toy_video_refuses_an_image_model_and_paired_without_a_lora(tmp_path, capsys, words):
    from flowalign.models.tiny import tiny_sd3_pipeline

    image_model = tmp_path / "sd3"
    tiny_sd3_pipeline(words, seed=0).save_pretrained(image_model)
    assert _exit_status(["eval", "toy-video", "--model", str(image_model), "--out", str(tmp_path / "a")]) == 2
    assert "is an image model" in capsys.readouterr().err
    assert _exit_status(["eval", "toy-video", "--paired", "--out", str(tmp_path / "b")]) == 2
    assert "--paired compares a trained LoRA" in capsys.readouterr().err


def test_the_video_main_job_trains_and_evaluates_before_and_after_on_the_held_out_prompts(toy_wan, tmp_path):
    run = tmp_path / "run"
    argv = ["train", str(REPO / "configs/video/default.yaml"), f"model.path={toy_wan}", "train.iterations=1",
            "data.group_size=2", "data.prompts_per_iteration=2", "train.eval_images_per_tag=2", "train.eval_steps=2",
            "sampling.num_steps=2", "objectives.diffusion_nft.timestep_fraction=0.5", f"train.out_dir={run}",
            f"data.train_prompts={PROMPT_ASSET_DIR / 'video_train.jsonl'}",
            f"data.eval_prompts={PROMPT_ASSET_DIR / 'video_test.jsonl'}"]
    assert cli.main(argv) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Collapse metrics on clips: toy_scene embeddings of the frames, and the binary verdict held out.
    assert {"collapse/diversity", "collapse/saturated_frac", "collapse/held_out/toy_video"} <= set(metrics[-1])
    report = json.loads((run / "eval/before_after.json").read_text())
    assert set(report["paired"]["tags"]) == {"colors", "counting"} and report["samples"] == 54
    for name in ("grid_before.png", "grid_after.png"):
        with Image.open(run / "eval" / name) as grid:
            assert grid.size[0] > grid.size[1]  # frame strips, five frames wide

    # bench/video_runs.py's record reads the same files: every field a number; its table over two seeds of that
    # record, and the results page's strips: the first row of each grid. (In a process of its own: the script puts
    # bench/ on sys.path.)
    code = (f"import json, sys, pathlib; sys.path.insert(0, {str(REPO / 'bench')!r}); import video_runs as v; "
            f"run = pathlib.Path({str(run)!r}); record = v.run_record('default', 0, run, 1.0, None); "
            "summary = v.summarise([record, {**record, 'seed': 1}]); "
            f"paths = v.strips(run, pathlib.Path({str(tmp_path)!r}), rows=1); "
            "print(json.dumps({'record': record, 'summary': summary, 'table': v.table(summary), "
            "'strips': [str(p) for p in paths]}))")
    bench = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    record = bench["record"]
    assert record["iterations"] == 1 and record["train_wall_s"] > 0 and 0 <= record["reward_first"] <= 1
    assert record["reward_last10"] == record["reward_first"] and record["paired"] == report["paired"]["overall"]
    assert record["paired_trained"] == report["rewards"]["toy_video"]["overall"]
    row = bench["summary"]["default"]
    gain = report["paired"]["overall"]["diff"]
    assert row["seeds"] == [0, 1] and row["gains"] == [gain, gain] and row["gain"] == pytest.approx(gain)
    assert row["seed_sd"] == 0 and row["before"] == report["paired"]["overall"]["mean_a"]
    assert bench["table"].splitlines()[2].startswith(f"| default | 2 | 1 | {row['before']:.3f} | {row['after']:.3f} |")
    for name, path in zip(("before", "after"), bench["strips"]):
        with Image.open(run / "eval" / f"grid_{name}.png") as grid, Image.open(path) as strip:
            assert strip.size == (grid.width, grid.height // 7)  # 54 clips: 7 rows of 8
            assert strip.tobytes() == grid.crop((0, 0, grid.width, grid.height // 7)).tobytes()

    # The trained checkpoint against its base, paired on the same seeds.
    checkpoint = sorted(run.glob("checkpoint-*"))[-1]
    out = tmp_path / "paired"
    assert cli.main(["eval", "toy-video", "--lora", str(checkpoint), "--paired", "--max-prompts", "2",
                     "--images-per-prompt", "1", "--steps", "2", "--out", str(out), "--device", "cpu"]) == 0
    paired = json.loads((out / "before_after.json").read_text())["paired"]
    record = json.loads((out / "results.json").read_text())
    assert paired["overall"]["n"] == 2 and record["paired"] == paired
    assert record["paired_partial"]["overall"]["mean_b"] == pytest.approx(
        sum(r["partial"] for r in record["results"]) / 2)


def test_the_committed_toy_wan_is_the_makefile_recipes_output_and_under_30_mb(tmp_path):
    """assets/toy-wan's pretrain_log.json, root first, holds the settings of each `make toy-wan` stage."""
    import shlex
    from dataclasses import asdict

    from flowalign.config import load_config

    recipe = [line for line in (REPO / "Makefile").read_text().splitlines()
              if line.startswith("\t$(BIN)/flowalign toy pretrain-video")]
    asset = REPO / "assets/toy-wan"
    # (init_from names the previous stage's folder; any pipeline the command wrote stands in for it here)
    stages = [[f"init_from={asset}" if token.startswith("init_from=") else token
               for token in shlex.split(line) if "=" in token] + [f"out={tmp_path}"] for line in recipe]
    chain, log = [], json.loads((asset / "pretrain_log.json").read_text())
    while log:
        chain.insert(0, log)
        log = log.get("parent")
    assert len(chain) == len(stages) == 4
    # keys added after the first stage was written default to the behaviour it was written with
    added = {"patch_size": [1, 4, 4], "init_from": "", "reinit_transformer": False}
    for index, (stage, overrides) in enumerate(zip(chain, stages)):
        expected = {k: v for k, v in asdict(load_config(VideoPretrainConfig, None, overrides)).items() if k != "out"}
        written = {**(added if index == 0 else {}), **{k: v for k, v in stage["config"].items() if k != "out"}}
        assert bool(written.pop("init_from")) == bool(expected.pop("init_from")) == (index > 0)
        assert written == expected, f"stage {index}"
    assert chain[-1]["architecture"]["transformer"]["patch_size"] == [1, 2, 2]
    assert sum(p.stat().st_size for p in asset.rglob("*") if p.is_file()) < 30 * 2**20
    model = load_flow_model(asset)
    assert model.family == "wan" and model.default_image_size == (32, 32)
