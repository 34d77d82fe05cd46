"""A trained LoRA outside the trainer: ``--lora`` on ``flowalign eval`` / ``sample``, and ``flowalign export``.

The run under test is a real 2-iteration ``flowalign train`` of the shipped toy model with its final evaluation on
12 held-out prompts, run in a pseudo-terminal so that its progress bars show. Everything else loads that run's
checkpoint: the toy evaluation of ``--lora CHECKPOINT --weights ema`` must give the trainer's "after" column and
images exactly; the exported LoRA folder (plain ``load_lora_weights``) and the merged pipeline (plain
``from_pretrained``) must sample what the LoRA model samples, to fp32 tolerance.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flowalign import cli
from flowalign.training.checkpoint_files import save_checkpoint
from flowalign.config import load_config, to_dict
from flowalign.evaluation.toy_eval import evaluate, generate
from flowalign.export import export_lora
from flowalign.lora_loading import LORA_FILE, apply_lora, base_model_path, load_model, resolve_lora
from flowalign.models import wrap_pipeline
from flowalign.models.loading import load_flow_model
from flowalign.models.tiny import tiny_flux_pipeline, tiny_sd3_pipeline
from flowalign.samplers import rollout
from flowalign.training.config import TrainConfig
REPO = Path(__file__).resolve().parents[1]
WORDS = "a photo of an the red green blue yellow purple white circle square triangle circles squares two".split()
TOY = REPO / "assets" / "toy-sd3"
BIN = Path(sys.executable).parent
EVAL = {"images_per_prompt": 2, "steps": 3, "seed": 10_000}  # the run's train.eval_* below; seed = train.seed + 10000


def run_in_terminal(args: list[str], cwd: Path, timeout: float = 600) -> tuple[int, str]:
    """Run a command with stdout and stderr on a pseudo-terminal (so tqdm draws its bars); (status, output)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(args, stdin=child, stdout=child, stderr=child, cwd=cwd, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    return process.wait(timeout=timeout), b"".join(chunks).decode("utf-8", "replace")


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flowalign"), *args], cwd=cwd, capture_output=True, text=True)


def tiny_checkpoint(root: Path, build=tiny_sd3_pipeline, *, ema: bool = True) -> tuple[Path, Path]:
    """(checkpoint, model directory): a tiny pipeline and a checkpoint of random LoRA weights (EMA = half of them),
    written by ``save_checkpoint`` with a real resolved config, as the trainer writes one."""
    model_dir = root / f"tiny-{build.__name__}"
    build(WORDS, seed=0).save_pretrained(model_dir)
    config = load_config(TrainConfig, None, [f"model.path={model_dir}", "model.lora_rank=4", "model.lora_alpha=8",
                                             f"optim.ema_decay={0.99 if ema else 0}"])  # as a run with(out) EMA
    model = load_flow_model(model_dir)
    model.add_lora(rank=4, alpha=8)
    model.freeze_base()
    torch.manual_seed(3)
    trainable = {n: p for n, p in model.transformer.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for param in trainable.values():
            param.normal_(0, 0.2)
    checkpoint = save_checkpoint(
        root / "run", 1, trainable=trainable, optimizer=torch.optim.SGD(trainable.values(), lr=0.1), state={},
        config_yaml=yaml.safe_dump(to_dict(config)), ema={n: p.detach() * 0.5 for n, p in trainable.items()} if ema
        else None, write_model=model.save_trained)
    return checkpoint, model_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-iteration toy run (EMA 0.5, so EMA and last weights differ) with its final evaluation."""
    root = tmp_path_factory.mktemp("trained")
    prompts = root / "eval12.jsonl"
    prompts.write_text("".join((REPO / "assets/prompts/test.jsonl").read_text().splitlines(keepends=True)[:12]))
    settings = {
        "model.path": TOY, "data.train_prompts": REPO / "assets/prompts/train.jsonl", "data.eval_prompts": prompts,
        "train.iterations": 2, "data.prompts_per_iteration": 2, "data.group_size": 4, "sampling.batch_size": 8,
        "optim.lr": 1e-2, "optim.ema_decay": 0.5, "train.tracker": "none", "train.sample_every": 0,
        "train.eval_images_per_prompt": EVAL["images_per_prompt"], "train.eval_steps": EVAL["steps"],
        "train.out_dir": root / "run",
    }
    status, output = run_in_terminal([str(BIN / "flowalign"), "train", str(REPO / "configs/methods/flow_grpo_fast.yaml"),
                                      *(f"{k}={v}" for k, v in settings.items())],
                                     cwd=root)
    assert status == 0, output[-3000:]
    checkpoint = root / "run" / "checkpoint-000002"
    return {"root": root, "prompts": prompts, "run": root / "run", "checkpoint": checkpoint, "output": output}


def ode_samples(model, prompts=("a photo of a red circle", "two squares"), steps=3, seed=5) -> torch.Tensor:
    """Final ODE latents for fixed prompts and seeded noise."""
    noise = model.prepare_noise(len(prompts), generator=[torch.Generator().manual_seed(seed + i)
                                                          for i in range(len(prompts))])
    with torch.no_grad():
        cond = model.encode(list(prompts))
        return rollout(model.velocity_fn(cond), noise, model.sigmas(steps), torch.zeros(steps)).final


# ----------------------------------------------------------------------------------- the trainer's own "after"


@pytest.mark.slow  # the trained run: about a minute
def test_eval_toy_with_the_checkpoint_reproduces_the_trainers_after_column_exactly(trained, tmp_path):
    report = json.loads((trained["run"] / "eval" / "before_after.json").read_text())
    out = tmp_path / "eval"
    status, output = run_in_terminal(
        [str(BIN / "flowalign"), "eval", "toy", "--lora", str(trained["checkpoint"]), "--weights", "ema",
         "--prompts", str(trained["prompts"]), "--images-per-prompt", "2", "--steps", "3", "--seed", "10000",
         "--out", str(out)], cwd=trained["root"])
    assert status == 0, output[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["summary"] == report["after"]
    assert result["config"]["model"] == str(TOY) and result["config"]["lora_weights"] == "ema"
    # The same images, bit for bit: the grids are PNGs of the first 64 images with the same captions.
    grid = (out / "grid.png").read_bytes()
    assert grid == (trained["run"] / "eval" / "grid_after.png").read_bytes()
    assert grid != (trained["run"] / "eval" / "grid_before.png").read_bytes()  # the LoRA changed the images
    assert "ema weights" in (out / "summary.md").read_text()
    assert "eval: 100%" in output and "24/24" in output  # flowalign eval toy's progress bar


@pytest.mark.slow  # the trained run: about a minute
def test_the_trainers_final_evaluation_shows_progress_bars(trained):
    output = trained["output"]
    assert output.count("eval: 100%") >= 2 and "24/24" in output  # before and after, 12 prompts x 2 images


def test_evaluate_draws_a_bar_when_asked_and_none_when_told_not_to(capsys):
    model = wrap_pipeline(tiny_sd3_pipeline(WORDS, seed=0))
    metadata = [{"prompt": "a red circle", "tag": "single_object", "include": [{"class": "circle", "count": 1}]}]
    evaluate(model, metadata, steps=1, images_per_prompt=3, batch_size=2, progress=True)
    shown = capsys.readouterr().err
    assert "eval: 100%" in shown and "3/3" in shown
    generate(model, metadata, steps=1, images_per_prompt=3, batch_size=2, progress=False)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------ loading weights


@pytest.mark.slow  # the trained run: about a minute
def test_ema_last_and_the_lora_folder(trained):
    checkpoint = trained["checkpoint"]
    assert resolve_lora(checkpoint).weights == "ema"  # the default when the checkpoint has an EMA
    samples = {w: ode_samples(load_model(str(TOY), resolve_lora(checkpoint, w))) for w in ("ema", "last")}
    folder = ode_samples(load_model(str(TOY), resolve_lora(checkpoint / "lora")))
    base = ode_samples(load_flow_model(TOY))
    torch.testing.assert_close(folder, samples["last"], rtol=1e-5, atol=1e-5)  # lora/ holds the last weights
    assert not torch.allclose(samples["ema"], samples["last"], atol=1e-4)
    assert not torch.allclose(samples["ema"], base, atol=1e-4)


@pytest.mark.slow  # the trained run: about a minute
def test_sample_takes_the_lora_and_defaults_to_the_checkpoints_model(trained, tmp_path):
    from flowalign.inference.sample import SampleConfig, run_sample

    config = SampleConfig(lora=str(trained["checkpoint"]), guidance="none", steps=2, max_prompts=2,
                          prompts=str(trained["prompts"]), out_dir=str(tmp_path / "sample"))
    summary = run_sample(config)
    assert summary["config"]["model"] == str(TOY) and summary["config"]["lora_weights"] == "ema"
    plain = run_sample(SampleConfig(guidance="none", steps=2, max_prompts=2, prompts=str(trained["prompts"]),
                                    out_dir=str(tmp_path / "plain")))
    assert summary["mean_reward"] is not None and plain["config"]["lora"] is None
    lora_image = (tmp_path / "sample" / "images" / "0000.png").read_bytes()
    assert lora_image != (tmp_path / "plain" / "images" / "0000.png").read_bytes()


# Every guided sampler with a set of 2 candidates within a small budget (2 steps, 2 prompts).
GUIDED_WITH_LORA = {
    "none": [],
    "bon": ["--budget", "8"],
    "fk": ["--budget", "8"],
    "dts": ["--budget", "8"],
    "rgs": ["--budget", "8", "--rgs-reward", "toy_geneval_soft", "--rgs-gradient", "x0"],
    "euphonium": ["--budget", "8", "--rgs-reward", "toy_geneval_soft", "--rgs-gradient", "x0"],
    "satisdive": ["--budget", "12", "--rgs-reward", "toy_geneval_soft"],  # 2 steps, scoring step 1: 2 (2 + 4)
}


@pytest.mark.slow  # the trained run: about a minute, shared with the tests above
@pytest.mark.parametrize("guidance", sorted(GUIDED_WITH_LORA))
def test_every_guided_sampler_runs_on_a_trained_lora(trained, tmp_path, guidance):
    """Training and inference-time alignment compose: ``--lora CHECKPOINT`` under every guided sampler gives other
    images than the base model under the same sampler and seeds."""
    common = ["sample", "--guidance", guidance, "--candidates", "2", "--steps", "2", "--max-prompts", "2",
              "--prompts", str(trained["prompts"]), *GUIDED_WITH_LORA[guidance]]
    assert cli.main([*common, "--lora", str(trained["checkpoint"]), "--out", str(tmp_path / "lora")]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "base")]) == 0
    lora = json.loads((tmp_path / "lora" / "results.json").read_text())
    assert lora["config"]["lora_weights"] == "ema" and lora["images_per_prompt"] == 2
    assert all(row["nfe"] <= int(GUIDED_WITH_LORA[guidance][1]) if GUIDED_WITH_LORA[guidance] else 4
               for row in lora["results"])
    images = sorted((tmp_path / "lora" / "images").glob("*.png"))
    assert len(images) == 4
    assert any(image.read_bytes() != (tmp_path / "base" / "images" / image.name).read_bytes() for image in images)


# ---------------------------------------------------------------------------------------------------- export


@pytest.mark.slow  # the trained run: about a minute
def test_exported_lora_folder_loads_with_plain_diffusers(trained, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    out = export_lora(trained["checkpoint"], tmp_path / "lora")  # default: the EMA
    assert (out / LORA_FILE).is_file()
    assert json.loads((out / "flowalign_export.json").read_text())["weights"] == "ema"
    pipe = StableDiffusion3Pipeline.from_pretrained(TOY)
    pipe.load_lora_weights(str(out))
    expected = ode_samples(load_model(str(TOY), resolve_lora(trained["checkpoint"], "ema")))
    torch.testing.assert_close(ode_samples(wrap_pipeline(pipe)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the trained run: about a minute
def test_merged_export_samples_what_the_lora_model_samples(trained, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    out = export_lora(trained["checkpoint"], tmp_path / "merged", weights="last", merge=True)
    pipe = StableDiffusion3Pipeline.from_pretrained(out)  # a plain pipeline: no adapter, no peft
    assert not any("lora" in name for name, _ in pipe.transformer.named_parameters())
    merged = ode_samples(wrap_pipeline(pipe))
    expected = ode_samples(load_model(str(TOY), resolve_lora(trained["checkpoint"], "last")))
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, ode_samples(load_flow_model(TOY)), atol=1e-3)


def test_flux_export_merged_and_as_lora_folder(tmp_path):
    from diffusers import FluxPipeline

    checkpoint, model_dir = tiny_checkpoint(tmp_path, tiny_flux_pipeline)
    expected = ode_samples(load_model(str(model_dir), resolve_lora(checkpoint)))
    assert not torch.allclose(expected, ode_samples(load_flow_model(model_dir)), atol=1e-3)
    merged = FluxPipeline.from_pretrained(export_lora(checkpoint, tmp_path / "merged", merge=True))
    torch.testing.assert_close(ode_samples(wrap_pipeline(merged)), expected, rtol=1e-4, atol=1e-4)
    pipe = FluxPipeline.from_pretrained(model_dir)
    pipe.load_lora_weights(str(export_lora(checkpoint, tmp_path / "lora")))
    torch.testing.assert_close(ode_samples(wrap_pipeline(pipe)), expected, rtol=1e-5, atol=1e-5)


def test_geneval_and_hpd_generate_with_the_lora(tmp_path):
    """``eval geneval`` and ``eval hpd`` with ``--lora`` (and no ``--model``) sample the LoRA model's images."""
    from PIL import Image

    from flowalign.evaluation.geneval_eval import GenEvalRunConfig, run_geneval
    from flowalign.evaluation.hpd_eval import HPD_STYLES, HPDRunConfig, run_hpd
    from flowalign.evaluation.images import to_uint8
    from flowalign.reward_models.hps import HPSv2
    from reward_fixtures import register_tiny_open_clip, tiny_open_clip_checkpoint

    checkpoint, model_dir = tiny_checkpoint(tmp_path)
    lora_model = load_model(str(model_dir), resolve_lora(checkpoint))
    base = load_flow_model(model_dir)
    metadata = [{"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"},
                {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}],
                 "prompt": "a photo of a red square"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(entry) + "\n" for entry in metadata))
    settings = dict(steps=2, images_per_prompt=1, seed=4, batch_size=2)
    expected = to_uint8(generate(lora_model, metadata, **settings))
    assert not np.array_equal(expected, to_uint8(generate(base, metadata, **settings)))

    run_geneval(GenEvalRunConfig(metadata=str(prompts), lora=str(checkpoint), detector="toy", device="cpu",
                                 out_dir=str(tmp_path / "geneval"), **settings))
    record = json.loads((tmp_path / "geneval" / "results.json").read_text())
    assert record["config"]["lora_weights"] == "ema"
    assert "(ema weights)" in (tmp_path / "geneval" / "summary.md").read_text()
    for p in range(2):
        with Image.open(tmp_path / "geneval" / "images" / f"{p:05d}" / "samples" / "00000.png") as image:
            assert np.array_equal(np.asarray(image.convert("RGB")), expected[p])

    styles = tmp_path / "hpd"
    styles.mkdir()
    for style in HPD_STYLES:
        (styles / f"{style}.json").write_text(json.dumps([entry["prompt"] for entry in metadata] * 5))  # HPD: >= 10
    tiny = tmp_path / "clip"
    tiny.mkdir()
    register_tiny_open_clip(tiny)
    scorer = HPSv2(str(tiny_open_clip_checkpoint(tiny, seed=2)), model_name="flowalign-tiny-clip", device="cpu")
    run_hpd(HPDRunConfig(prompts=str(styles), lora=str(checkpoint), lora_weights="ema", save_images=True, device="cpu",
                         out_dir=str(tmp_path / "hpd-out"), **{**settings, "seed": 0}), scorer=scorer)
    assert json.loads((tmp_path / "hpd-out" / "results.json").read_text())["config"]["model"] == str(model_dir)
    # HPD seeds image k of prompt p in style s with (seed, s * 100000 + p, k): style 0 is toy_eval's (seed, p, k).
    first = to_uint8(generate(lora_model, metadata, **{**settings, "seed": 0}))
    for p in range(2):
        with Image.open(tmp_path / "hpd-out" / "images" / HPD_STYLES[0] / f"{p:05d}_0.png") as image:
            assert np.array_equal(np.asarray(image.convert("RGB")), first[p])


# ------------------------------------------------------------------------------------------------- bad input


def test_bad_lora_paths_and_weights_are_named_before_anything_loads(tmp_path):
    checkpoint, _ = tiny_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.*does not exist"):
        resolve_lora(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="file.txt.*is a file"):
        resolve_lora(tmp_path / "file.txt")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory.*nor a LoRA folder"):
        resolve_lora(tmp_path)
    with pytest.raises(FileNotFoundError, match="run directory: pass one of its checkpoints.*checkpoint-000001"):
        resolve_lora(tmp_path / "run")
    with pytest.raises(ValueError, match="--weights last chooses the weights of a checkpoint.*lora/ folder holds"):
        resolve_lora(checkpoint / "lora", "last")
    assert resolve_lora(checkpoint).weights == "ema" and resolve_lora(checkpoint / "lora").weights is None
    no_ema, _ = tiny_checkpoint(tmp_path / "no-ema", ema=False)
    assert resolve_lora(no_ema).weights == "last"
    with pytest.raises(ValueError, match="has no ema.safetensors.*--weights last"):
        resolve_lora(no_ema, "ema")
    (no_ema / "config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="checkpoint-000001' has no config.yaml"):
        resolve_lora(no_ema)
    with pytest.raises(ValueError, match="LoRA folder .* does not name its base model: pass --model"):
        base_model_path(None, resolve_lora(checkpoint / "lora"))
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    saved["model"]["path"] = str(tmp_path / "gone")
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(FileNotFoundError, match="gone.*model.path of checkpoint.*pass --model"):
        base_model_path(None, resolve_lora(checkpoint))


def test_cli_reports_bad_lora_input_with_exit_status_2(tmp_path, capsys):
    checkpoint, _ = tiny_checkpoint(tmp_path)
    for args, message in [
        (["eval", "toy", "--lora", str(tmp_path / "nope")], "nope' does not exist"),
        (["eval", "toy", "--weights", "ema"], "--weights ema chooses a checkpoint's weights: give the checkpoint"),
        (["eval", "geneval", "--metadata", "m.jsonl", "--model", "m", "--weights", "last"], "--weights last chooses"),
        (["sample", "--lora", str(checkpoint / "lora"), "--weights", "ema"], "is a LoRA folder"),
        (["sample", "--weights", "ema"], "give the checkpoint with --lora"),
        (["eval", "hpd", "--prompts", str(tmp_path)], "give --model"),
        (["eval", "hpd", "--prompts", str(tmp_path), "--lora", str(checkpoint), "--weights", "ema"],
         "anime.json' does not exist"),  # --model from the checkpoint; prompts checked before loading
        (["export", str(checkpoint / "lora"), "--out", str(tmp_path / "x")], "already a diffusers LoRA folder"),
        (["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "nope' does not exist"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args)
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and "flowalign: error:" in error and message in error, (args, error)


def test_a_lora_that_does_not_fit_the_model_is_refused_naming_both(tmp_path):
    checkpoint, _ = tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"LoRA folder .*lora does not fit .*toy-sd3: \d+ of its \d+ LoRA "
                                         r"tensors do not match .*inputs.*pass that one as --model"):
        load_model(str(TOY), resolve_lora(checkpoint / "lora"))
    model = load_flow_model(TOY)
    with pytest.raises(ValueError, match=r"checkpoint .*checkpoint-000001 \(ema weights\) does not fit toy: "
                                         r".*wrong shapes"):
        apply_lora(model, resolve_lora(checkpoint), model_name="toy")
    assert not model.has_lora  # the failed adapter is removed again
    flux, _ = tiny_checkpoint(tmp_path / "flux", tiny_flux_pipeline)
    with pytest.raises(ValueError, match=r"checkpoint .*flux.* does not fit toy: missing \[.*unexpected "
                                         r"\['single_transformer_blocks"):
        apply_lora(model, resolve_lora(flux), model_name="toy")


def test_export_never_writes_into_an_existing_output(tmp_path, capsys):
    checkpoint, _ = tiny_checkpoint(tmp_path)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("earlier output")
    with pytest.raises(FileExistsError, match=r"taken' is a non-empty directory.*e\.g\. --out .*taken-2"):
        export_lora(checkpoint, out)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(checkpoint), "--out", str(out), "--merge"])
    assert exit_info.value.code == 2 and "non-empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "earlier output"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="'.*file' is a file"):
        export_lora(checkpoint, tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["export", str(checkpoint), "--out", str(empty), "--weights", "last"]) == 0
    assert sorted(p.name for p in empty.iterdir()) == ["README.md", "flowalign_export.json", LORA_FILE]
    assert not list(tmp_path.glob(".tmp-*"))
