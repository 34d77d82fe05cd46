"""The ``flowalign`` command line.

Commands are grouped (``flowalign GROUP COMMAND [options]``); each leaf command is registered by a small
``_add_*`` function that declares its options and sets ``handler``, a function of the parsed arguments. Handlers
import their modules lazily, so a command's heavy dependencies load only when it runs (the eval options do read
their defaults from ``EvalConfig``). To add a command: write ``_add_<name>(group)`` and call it from
``build_parser``.

Bad input (a missing model directory, a number out of range, ...) prints ``flowalign: error: ...`` and exits with
status 2, without a traceback. Only set-up errors count as bad input (``flowalign.errors``): a ``CommandError`` from a
handler, a ``SetupError`` (every ``ConfigError`` is one), or an error raised inside ``setup_phase()``. A failure after
the work has begun (iteration 200 of a training run) keeps its traceback and exits with status 1.

The library reports progress through ``logging`` (loggers under ``flowalign``) and prints nothing itself but the
results its commands exist for; the command line shows those log records, INFO and above, as plain lines on stdout.

Commands:

* ``flowalign train [CONFIG] [key=value ...]``: GRPO fine-tuning (``flowalign.training.trainer``).
* ``flowalign eval toy``: GenEval-style evaluation on the toy world (``flowalign.evaluation.toy_eval``).
* ``flowalign eval geneval``: GenEval on any model or image folder (``flowalign.evaluation.geneval_eval``).
* ``flowalign eval hpd``: the HPD v2 benchmark with HPS v2.1 (``flowalign.evaluation.hpd_eval``).
* ``flowalign toy pretrain``: pre-train the toy SD3 model (``flowalign.toy.pretrain``).
* ``flowalign toy segmenter``: train the shape segmenter of the differentiable toy reward (``flowalign.toy.segmenter``).
* ``flowalign calibrate [CONFIG] [key=value ...] --out FILE``: DenseGRPO's per-step noise calibration
  (``flowalign.training.calibrate``), written as a config for ``flowalign train``.
* ``flowalign sample --guidance none|rgs|fk|dts|bon --budget NFE [--cfg SCALE]``: reward-guided sampling
  (``flowalign.inference.sample``).
* ``flowalign registers train``: latent reward registers (``flowalign.training.registers``).
* ``flowalign export CHECKPOINT --out DIR [--weights ema|last] [--merge]``: a trained LoRA for diffusers
  (``flowalign.export``). ``sample`` and every ``eval`` command take ``--lora DIR [--weights ema|last]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["build_parser", "main"]

PROG = "flowalign"


class CommandError(Exception):
    """Bad input detected by a handler; reported as ``flowalign: error: ...`` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with errors reported as ``flowalign: error: ...`` (subcommand parsers use this class too)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


# ------------------------------------------------------------------------------------------- option types


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def json_object(text: str) -> dict:
    """A JSON object (``'{"device": "cpu"}'``) as a dict, e.g. a reward's constructor arguments."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"device\": \"cpu\"}}', got {text!r} "
                                         f"({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {type(value).__name__} {text!r}")
    return value


def sigma_band(text: str) -> tuple[float, float]:
    """``SIGMA:SCALE`` (e.g. ``0.8:0.3``) as a pair of finite numbers."""
    try:
        sigma, scale = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIGMA:SCALE such as 0.8:0.3, got {text!r}") from None
    if not (math.isfinite(sigma) and math.isfinite(scale)):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got {text!r}")
    return sigma, scale


# ---------------------------------------------------------------------------------------------- commands


def _add_sampling_args(parser, defaults) -> None:
    """The options of ``SamplingRun`` (shared by every ``eval`` command), with ``defaults``' values."""
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="ODE steps")
    parser.add_argument("--images-per-prompt", type=positive_int, default=defaults.images_per_prompt)
    parser.add_argument("--guidance", type=non_negative_float, default=defaults.guidance_scale,
                        help="guidance scale (CFG with negative prompt '' when > 1)")
    parser.add_argument("--seed", type=non_negative_int, default=defaults.seed)
    parser.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    parser.add_argument("--resolution", type=positive_int, default=None, help="image size (default: the model's)")
    parser.add_argument("--max-prompts", type=positive_int, default=None,
                        help="evaluate only the first M prompts (of each style for HPD)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=defaults.dtype)
    parser.add_argument("--out", default=defaults.out_dir, help="output directory")
    _add_lora_args(parser)


def _add_lora_args(parser) -> None:
    """``--lora`` / ``--weights``: a LoRA trained by ``flowalign train`` on top of ``--model`` (flowalign.export)."""
    from flowalign.export import WEIGHTS

    parser.add_argument("--lora", default=None, metavar="DIR",
                        help="a trained LoRA: a checkpoint directory (checkpoint-NNNNNN) or a diffusers LoRA folder "
                        "(e.g. a checkpoint's lora/, its last weights); --model defaults to the checkpoint's model")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="a checkpoint's EMA or last weights (default: ema when it has them, else last)")


def _sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``SamplingRun``'s fields from the options ``_add_sampling_args`` added."""
    return dict(steps=args.steps, images_per_prompt=args.images_per_prompt, guidance_scale=args.guidance,
                seed=args.seed, batch_size=args.batch_size, resolution=args.resolution, max_prompts=args.max_prompts,
                device=args.device, dtype=args.dtype, out_dir=args.out, lora=args.lora, lora_weights=args.weights)


def _add_eval_toy(group) -> None:
    from flowalign.evaluation.toy_eval import EvalConfig  # its defaults are the CLI defaults

    defaults = EvalConfig()
    parser = group.add_parser(
        "toy",
        help="GenEval-style evaluation on the toy world",
        description="Sample the toy prompts with the ODE, detect shapes, judge with GenEval's rules; writes "
        "results.json, summary.md and grid.png to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None,
                        help="diffusers pipeline directory (default: a --lora checkpoint's model, else assets/toy-sd3)")
    parser.add_argument("--prompts", default=None, help="GenEval metadata jsonl (default: assets/prompts/test.jsonl)")
    parser.add_argument("--images-per-tag", type=positive_int, default=None,
                        help="tag-balanced: this many images per tag, split evenly over its prompts (replaces "
                        "--images-per-prompt; equal tag sizes minimise the standard error of GenEval's overall)")
    _add_sampling_args(parser, defaults)
    parser.set_defaults(handler=_run_eval_toy)


def _run_eval_toy(args: argparse.Namespace) -> None:
    from flowalign.evaluation.toy_eval import EvalConfig, run_eval

    run_eval(EvalConfig(model=args.model, prompts=args.prompts, images_per_tag=args.images_per_tag,
                        **_sampling_settings(args)))


def _add_eval_geneval(group) -> None:
    from flowalign.evaluation.geneval_eval import GenEvalRunConfig

    parser = group.add_parser(
        "geneval",
        help="GenEval: generate into GenEval's folder layout (or score an existing folder) and judge",
        description="With --model, sample every prompt of --metadata into <out>/images (or --images) in GenEval's "
        "layout (<dir>/00000/metadata.jsonl, samples/00000.png); without --model, score the existing folder "
        "--images. Writes results.json and summary.md to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="diffusers pipeline directory or hub id (omit to only score, "
                        "or to generate with a --lora checkpoint's model)")
    parser.add_argument("--metadata", required=True, help="GenEval evaluation_metadata.jsonl")
    parser.add_argument("--images", default=None, help="image folder to write or to score (default: <out>/images)")
    parser.add_argument("--detector", choices=("mask2former", "toy"), default="mask2former")
    parser.add_argument("--detector-model", default=None,
                        help="Mask2Former directory or hub id (default: facebook/mask2former-swin-small-coco-instance)")
    parser.add_argument("--clip-weights", default="openai",
                        help="colour classifier's CLIP ViT-L-14 weights: a local file or the open_clip tag 'openai'")
    parser.add_argument("--class-names", default=None, help="GenEval's object_names.txt (label id order)")
    _add_sampling_args(parser, GenEvalRunConfig(metadata=""))
    parser.set_defaults(handler=_run_eval_geneval)


def _run_eval_geneval(args: argparse.Namespace) -> None:
    from flowalign.evaluation.geneval_eval import GenEvalRunConfig, run_geneval

    if args.model is None and args.lora is None and args.images is None:
        raise CommandError("give --model to generate images, or --images DIR to score an existing GenEval folder")
    run_geneval(GenEvalRunConfig(
        metadata=args.metadata, model=args.model, images=args.images, detector=args.detector,
        detector_model=args.detector_model, clip_weights=args.clip_weights, class_names=args.class_names,
        **_sampling_settings(args),
    ))


def _add_eval_hpd(group) -> None:
    from flowalign.evaluation.hpd_eval import HPDRunConfig

    parser = group.add_parser(
        "hpd",
        help="HPD v2: HPS v2.1 of generated images, per style (mean of 10 chunk means, std) and Average",
        description="Sample the HPD v2 prompts (--prompts DIR with anime.json, concept-art.json, paintings.json, "
        "photo.json) and score them with HPS v2.1; writes results.json and summary.md to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None,
                        help="diffusers pipeline directory or hub id (required unless --lora is a checkpoint)")
    parser.add_argument("--prompts", required=True, help="directory with the four style JSON files")
    parser.add_argument("--hps-checkpoint", default=None,
                        help="HPS_v2.1_compressed.pt (default: download from the hub repository xswu/HPSv2)")
    parser.add_argument("--save-images", action="store_true", help="also save the images under <out>/images")
    _add_sampling_args(parser, HPDRunConfig(prompts=""))
    parser.set_defaults(handler=_run_eval_hpd)


def _run_eval_hpd(args: argparse.Namespace) -> None:
    from flowalign.evaluation.hpd_eval import HPDRunConfig, run_hpd

    if args.model is None and args.lora is None:
        raise CommandError("give --model (the pipeline to evaluate), or --lora with a training checkpoint")
    run_hpd(HPDRunConfig(model=args.model, prompts=args.prompts, hps_checkpoint=args.hps_checkpoint,
                         save_images=args.save_images, **_sampling_settings(args)))


def _add_train(commands) -> None:
    parser = commands.add_parser(
        "train",
        help="GRPO fine-tuning (the main job; with no config: the toy-world default run)",
        description="Fine-tune with GRPO. CONFIG is a YAML file (optional); KEY=VALUE overrides use dotted keys, "
        "e.g. optim.lr=3e-4 sampling.noise_level=0.9. `flowalign train --help-config` lists every key.",
    )
    parser.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE", help="a YAML config, then dotted overrides")
    parser.add_argument("--resume", default=None, metavar="CHECKPOINT|latest", help="continue a run")
    parser.add_argument("--help-config", action="store_true", help="print every config key with its help and exit")
    parser.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> None:
    from flowalign.config import format_help, load_config
    from flowalign.training.config import TrainConfig

    if args.help_config:
        print(format_help(TrainConfig))
        return
    path, overrides = _config_and_overrides(args.items)
    if args.resume is not None:
        overrides.append(f"train.resume={args.resume}")
    config = load_config(TrainConfig, path, overrides)  # every check runs before any model loads
    from flowalign.training.trainer import GRPOTrainer

    trainer = GRPOTrainer(config)  # set-up: its mistakes are SetupErrors (exit 2)
    trainer.train()  # a failure from here on is no user error: it keeps its traceback


def _add_calibrate(commands) -> None:
    parser = commands.add_parser(
        "calibrate",
        help="calibrate per-step noise levels (DenseGRPO) and write them as a train config",
        description="Sample trajectories with the training config, score the ODE completion of every state, and "
        "move each stochastic step's noise level up (signs of dR balanced) or down (unbalanced); the result is a "
        "YAML config with sampling.noise_table for `flowalign train`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE", help="a YAML config, then dotted overrides")
    parser.add_argument("--out", required=True, help="the calibrated config to write (YAML)")
    parser.add_argument("--rounds", type=positive_int, default=10, help="calibration rounds")
    parser.add_argument("--eps1", type=non_negative_float, default=2.0, help="sign-balance tolerance")
    parser.add_argument("--eps2", type=non_negative_float, default=0.01, help="noise-level step per round")
    parser.set_defaults(handler=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> None:
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    path, overrides = _config_and_overrides(args.items)
    config = load_config(TrainConfig, path, overrides)
    from flowalign.training.calibrate import calibrate, write_calibrated_config

    levels, history = calibrate(config, rounds=args.rounds, eps1=args.eps1, eps2=args.eps2)  # set-up: the trainer's
    out = write_calibrated_config(args.out, levels, history, base=path, overrides=overrides, eps1=args.eps1,
                                  eps2=args.eps2)
    print(f"wrote {out}: sampling.noise_table = {levels}")


def _config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [KEY=VALUE ...]`` -> (config path or None, overrides); a named config must exist."""
    path, overrides = None, list(items)
    if overrides and "=" not in overrides[0]:
        path = overrides.pop(0)
        if not Path(path).is_file():
            raise CommandError(f"config file {path!r} does not exist")
    return path, overrides


def _add_toy_pretrain(group) -> None:
    parser = group.add_parser(
        "pretrain",
        help="pre-train the toy SD3 model",
        description="Pre-train the small SD3 pipeline of the toy world and save it with save_pretrained.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="assets/toy-sd3", help="output pipeline directory")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--vae-steps", type=positive_int, default=None, help="VAE training steps (default: config)")
    parser.add_argument("--steps", type=positive_int, default=None, help="transformer training steps (default: config)")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="batch size (default: config)")
    parser.set_defaults(handler=_run_toy_pretrain)


def _run_toy_pretrain(args: argparse.Namespace) -> None:
    from flowalign.toy.pretrain import main as pretrain_main

    pretrain_main(args)


def _add_toy_segmenter(group) -> None:
    from flowalign.toy.segmenter import SegmenterConfig

    defaults = SegmenterConfig()
    parser = group.add_parser(
        "segmenter",
        help="train the toy shape segmenter behind the differentiable toy_geneval_soft reward",
        description="Train the per-pixel shape segmenter (flowalign.toy.segmenter) on random rendered scenes and save "
        "model.safetensors and config.json (settings and held-out pixel accuracy) to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="assets/toy-segmenter", help="output directory")
    parser.add_argument("--seed", type=non_negative_int, default=defaults.seed)
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="training steps")
    parser.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    parser.add_argument("--threads", type=positive_int, default=defaults.threads, help="torch CPU threads")
    parser.set_defaults(handler=_run_toy_segmenter)


def _run_toy_segmenter(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from flowalign.errors import setup_phase
    from flowalign.toy.segmenter import SegmenterConfig, train_segmenter

    with setup_phase():
        config = SegmenterConfig(seed=args.seed, steps=args.steps, batch_size=args.batch_size, threads=args.threads)
    train_segmenter(config, args.out)
    report = json.loads((Path(args.out) / "config.json").read_text())["held_out"]
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in report.items()))


def _add_sample(commands) -> None:
    from flowalign.inference.sample import RGS_GRADIENTS, SampleConfig
    from flowalign.samplers.fk import POTENTIALS
    from flowalign.samplers.guided import GUIDANCE

    defaults = SampleConfig()
    parser = commands.add_parser(
        "sample",
        help="reward-guided sampling under an NFE budget (best-of-N, FK steering, DTS*, RGS)",
        description="Sample every prompt with a guidance method that spends at most --budget NFEs per prompt; "
        "writes images/, grid.png, results.json (each chosen sample's reward and NFEs) and summary.md to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None,
                        help="diffusers pipeline directory (default: a --lora checkpoint's model, else assets/toy-sd3)")
    _add_lora_args(parser)
    parser.add_argument("--prompts", default=None, help="GenEval metadata jsonl (default: assets/prompts/test.jsonl)")
    parser.add_argument("--guidance", choices=GUIDANCE, default=defaults.guidance)
    parser.add_argument("--budget", type=positive_int, default=defaults.budget, help="NFEs per prompt")
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="sampler steps per trajectory")
    parser.add_argument("--reward", default=defaults.reward, help="registered image reward that scores samples")
    parser.add_argument("--binary-reward", action="store_true", help="toy_geneval without partial credit")
    parser.add_argument("--registers", default=None, help="register checkpoint: RGS's gradient from register heads")
    parser.add_argument("--cfg", type=non_negative_float, default=defaults.cfg, metavar="SCALE",
                        help="classifier-free guidance scale (negative prompt ''), for every --guidance method; > 1 "
                        "costs 2 NFEs per sample and step; 1 = off")
    parser.add_argument("--rgs-reward", default=None,
                        help="differentiable image reward for RGS's gradient on the decoded x0_hat (toy_geneval_soft, "
                        "pickscore, hps, clipscore, aesthetic, imagereward); instead of --registers")
    parser.add_argument("--rgs-reward-kwargs", type=json_object, default={}, metavar="JSON",
                        help="--rgs-reward's constructor arguments as a JSON object, e.g. local weights: "
                        "'{\"model\": \"/w/PickScore_v1\", \"processor\": \"/w/CLIP-H\", \"device\": \"cuda\"}'")
    parser.add_argument("--rgs-gradient", choices=RGS_GRADIENTS, default=defaults.rgs_gradient,
                        help="--rgs-reward's gradient: through the velocity (full, one backward NFE per guided step) "
                        "or on x0_hat alone (x0, no extra NFE)")
    parser.add_argument("--noise-level", type=non_negative_float, default=defaults.noise_level,
                        help="SDE noise level of FK particles and tree search")
    parser.add_argument("--lam", type=non_negative_float, default=defaults.lam, help="FK / DTS inverse temperature")
    parser.add_argument("--potential", choices=POTENTIALS, default=defaults.potential, help="FK potential")
    parser.add_argument("--fk-resample-start", type=non_negative_int, default=defaults.fk_resample_start,
                        help="first step at which FK scores x0_hat and may resample (then every step but the last)")
    parser.add_argument("--max-children", type=_int_at_least(2), default=defaults.max_children,
                        help="DTS children per node")
    parser.add_argument("--dts-soft", action="store_true", help="DTS (Boltzmann selection) instead of DTS*")
    parser.add_argument("--rgs-bands", type=sigma_band, nargs="+", default=defaults.rgs_bands, metavar="SIGMA:SCALE",
                        help="RGS correction scale above each sigma, highest first (no gradient below the last)")
    parser.add_argument("--seed", type=non_negative_int, default=defaults.seed)
    parser.add_argument("--max-prompts", type=positive_int, default=None)
    parser.add_argument("--batch-prompts", type=positive_int, default=defaults.batch_prompts)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=defaults.out_dir, help="output directory")
    parser.set_defaults(handler=_run_sample)


def _run_sample(args: argparse.Namespace) -> None:
    from flowalign.inference.sample import SampleConfig, run_sample

    config = SampleConfig(
        model=args.model, prompts=args.prompts, guidance=args.guidance, budget=args.budget, steps=args.steps,
        lora=args.lora, lora_weights=args.weights,
        seed=args.seed, reward=args.reward, partial_credit=not args.binary_reward, registers=args.registers,
        rgs_reward=args.rgs_reward, rgs_reward_kwargs=args.rgs_reward_kwargs, rgs_gradient=args.rgs_gradient,
        cfg=args.cfg,
        noise_level=args.noise_level, lam=args.lam, potential=args.potential,
        fk_resample_start=args.fk_resample_start, max_children=args.max_children,
        dts_soft=args.dts_soft, rgs_bands=args.rgs_bands, max_prompts=args.max_prompts,
        batch_prompts=args.batch_prompts, out_dir=args.out, device=args.device,
    )
    summary = run_sample(config)
    line = f"{summary['prompts']} prompts, mean reward {summary['mean_reward']}, mean NFEs {summary['mean_nfe']:.1f}"
    if "geneval" in summary:
        line += f", toy GenEval overall {summary['geneval']['overall']:.3f}"
    print(f"wrote {args.out}: {line}")


def _add_export(commands) -> None:
    from flowalign.export import WEIGHTS

    parser = commands.add_parser(
        "export",
        help="export a training checkpoint's LoRA for diffusers (a LoRA folder, or a pipeline with it merged)",
        description="Write a checkpoint's EMA or last LoRA weights to --out: a diffusers LoRA folder "
        "(pytorch_lora_weights.safetensors, for pipe.load_lora_weights), or with --merge a full pipeline directory "
        "with the LoRA folded into the transformer (plain StableDiffusion3Pipeline / FluxPipeline.from_pretrained). "
        "--out must not exist or be empty.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory (checkpoint-NNNNNN)")
    parser.add_argument("--out", required=True, help="the directory to write (new or empty)")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="EMA or last weights (default: ema when the checkpoint has them, else last)")
    parser.add_argument("--merge", action="store_true", help="write a full pipeline with the LoRA merged")
    parser.add_argument("--model", default=None, help="the base pipeline (default: the checkpoint's model.path)")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                        help="dtype of the base weights (default: the checkpoint's model.dtype)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> None:
    from flowalign.devices import resolve_device
    from flowalign.export import export_lora

    from flowalign.errors import setup_phase

    try:
        with setup_phase():  # reading the checkpoint, loading the model: every failure is the input's
            out = export_lora(args.checkpoint, args.out, weights=args.weights, merge=args.merge, model=args.model,
                              dtype=args.dtype, device=resolve_device(args.device))
    except FileExistsError as error:
        raise CommandError(str(error)) from None
    kind = "pipeline with the LoRA merged" if args.merge else "diffusers LoRA folder"
    print(f"wrote {out} ({kind})")


def _add_registers_train(group) -> None:
    from flowalign.training.registers import RegisterTrainConfig

    defaults = RegisterTrainConfig()
    parser = group.add_parser(
        "train",
        help="train latent reward registers on the model's own samples (pairwise Thurstone loss)",
        description="Sample K trajectories per prompt with the frozen model, label the final images with --reward, "
        "and fit register heads on pairs of noisy states of the same prompt; reports held-out pairwise accuracy "
        "by sigma band (report.md / report.json next to --out).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--prompts", default=None, help="training metadata jsonl (default: assets/prompts/train.jsonl)")
    parser.add_argument("--eval-prompts", default=None, help="held-out metadata jsonl (default: test.jsonl)")
    parser.add_argument("--eval-prompt-count", type=positive_int, default=defaults.eval_prompt_count)
    parser.add_argument("--val-prompt-count", type=non_negative_int, default=defaults.val_prompt_count,
                        help="training prompts held back to pick the best iteration (0: keep the last)")
    parser.add_argument("--eval-every", type=positive_int, default=defaults.eval_every,
                        help="validate every this many iterations (and at the last)")
    parser.add_argument("--reward", default=defaults.reward)
    parser.add_argument("--iterations", type=positive_int, default=defaults.iterations)
    parser.add_argument("--prompts-per-iteration", type=positive_int, default=defaults.prompts_per_iteration)
    parser.add_argument("--samples-per-prompt", type=_int_at_least(2), default=defaults.samples_per_prompt)
    parser.add_argument("--steps", type=positive_int, default=defaults.steps)
    parser.add_argument("--updates-per-iteration", type=positive_int, default=defaults.updates_per_iteration)
    parser.add_argument("--lr", type=non_negative_float, default=defaults.lr)
    parser.add_argument("--weight-decay", type=non_negative_float, default=defaults.weight_decay)
    parser.add_argument("--num-registers", type=positive_int, default=defaults.num_registers)
    parser.add_argument("--taps", type=non_negative_int, nargs="+", default=None,
                        help="block indices to read (default: 3 evenly spaced)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the x0-projection baseline in the report")
    parser.add_argument("--seed", type=non_negative_int, default=defaults.seed)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=defaults.out, help="checkpoint file to write")
    parser.set_defaults(handler=_run_registers_train)


def _run_registers_train(args: argparse.Namespace) -> None:
    from flowalign.training.registers import RegisterTrainConfig, train_registers

    config = RegisterTrainConfig(
        model=args.model, prompts=args.prompts, eval_prompts=args.eval_prompts,
        eval_prompt_count=args.eval_prompt_count, val_prompt_count=args.val_prompt_count,
        eval_every=args.eval_every, weight_decay=args.weight_decay, reward=args.reward, iterations=args.iterations,
        prompts_per_iteration=args.prompts_per_iteration, samples_per_prompt=args.samples_per_prompt,
        steps=args.steps, updates_per_iteration=args.updates_per_iteration, lr=args.lr,
        num_registers=args.num_registers, taps=args.taps, baseline_x0=not args.no_baseline, seed=args.seed,
        out=args.out, device=args.device,
    )
    result = train_registers(config)
    print(f"wrote {result['checkpoint']}")


# ------------------------------------------------------------------------------------------------ parser


def _group(commands, name: str, help: str):
    """A command group ``flowalign NAME ...`` whose subcommands are required."""
    parser = commands.add_parser(name, help=help, description=help)
    sub = parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True)
    return sub


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Align flow-matching text-to-image models with reward models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_train(commands)
    _add_calibrate(commands)

    eval_group = _group(commands, "eval", "evaluate a model")
    _add_eval_toy(eval_group)
    _add_eval_geneval(eval_group)
    _add_eval_hpd(eval_group)

    toy_group = _group(commands, "toy", "toy-world tools")
    _add_toy_pretrain(toy_group)
    _add_toy_segmenter(toy_group)

    _add_sample(commands)
    _add_export(commands)
    registers_group = _group(commands, "registers", "latent reward registers")
    _add_registers_train(registers_group)
    return parser


class _StdoutLines(logging.Handler):
    """Log records as bare message lines on the current ``sys.stdout`` (looked up per record, so a redirected or
    captured stdout is honoured): the library's progress lines, which it logs, print as they did when it printed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report through handleError, never raise
            self.handleError(record)


def show_library_logs() -> None:
    """Show the ``flowalign`` loggers' INFO and above on stdout (once per process; a level already set is kept)."""
    logger = logging.getLogger("flowalign")
    if not any(isinstance(handler, _StdoutLines) for handler in logger.handlers):
        logger.addHandler(_StdoutLines())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns 0 on success, exits with status 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    show_library_logs()
    from flowalign.errors import SetupError

    try:
        args.handler(args)  # each handler marks its own set-up: a SetupError, or setup_phase()
    except (CommandError, SetupError) as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    return 0

