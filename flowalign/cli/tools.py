"""The tools around training: ``toy pretrain``, ``toy pretrain-video``, ``toy segmenter`` (each built from its settings dataclass by the config
loader) and ``export`` (a checkpoint's LoRA for diffusers; positional, no config). The preparation tools are
``flowalign prep`` (``flowalign.cli.prep``)."""

from __future__ import annotations

import argparse

from flowalign.deprecation import moved_names
from .options import ConfigCommand, add_config_command

__all__ = ["add_export", "add_toy_pretrain", "add_toy_pretrain_video", "add_toy_segmenter"]


def _run_toy_pretrain(config, args: argparse.Namespace) -> None:
    from flowalign.toy.pretrain import pretrain

    pretrain(config)


def _run_toy_pretrain_video(config, args: argparse.Namespace) -> None:
    from flowalign.toy.video_pretrain import pretrain_video

    pretrain_video(config)


def _run_toy_segmenter(config, args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from flowalign.toy.segmenter import train_segmenter

    train_segmenter(config.training(), config.out)
    report = json.loads((Path(config.out) / "config.json").read_text())["held_out"]
    print(f"wrote {config.out}: " + ", ".join(f"{k} {v}" for k, v in report.items()))


def add_toy_pretrain(group) -> None:
    add_config_command(
        group, "pretrain", ConfigCommand("flowalign.toy.pretrain:PretrainConfig", _run_toy_pretrain),
        help="pre-train the toy SD3 model",
        description="Pre-train the small SD3 pipeline of the toy world and save it with save_pretrained.",
    )


def add_toy_pretrain_video(group) -> None:
    add_config_command(
        group, "pretrain-video", ConfigCommand("flowalign.toy.video_pretrain:VideoPretrainConfig",
                                               _run_toy_pretrain_video),
        help="pre-train the toy video world's tiny Wan2.1 model",
        description="Pre-train the small WanPipeline of the toy video world on rendered clips of moving shapes and "
        "save it with save_pretrained (assets/toy-wan by default).",
    )


def add_toy_segmenter(group) -> None:
    add_config_command(
        group, "segmenter", ConfigCommand("flowalign.toy.segmenter:SegmenterRun", _run_toy_segmenter),
        help="train the toy shape segmenter behind the differentiable toy_geneval_soft reward",
        description="Train the per-pixel shape segmenter (flowalign.toy.segmenter) on random rendered scenes and save "
        "model.safetensors and config.json (settings and held-out pixel accuracy) to --out.",
    )


def add_export(commands) -> None:
    from flowalign.lora_loading import WEIGHTS

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
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID",
                        help="then upload the export to this Hugging Face Hub model repository (OWNER/NAME; created "
                        "when missing) through huggingface_hub (its token: HF_TOKEN or `hf auth login`)")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    parser.add_argument("--license", default=None, metavar="ID",
                        help="the model card's license (default: the base model card's, else 'other')")
    parser.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> None:
    from flowalign.devices import resolve_device
    from flowalign.errors import SetupError, setup_phase
    from flowalign.export import export_lora

    from flowalign.hub import check_repo_id, push_to_hub

    if args.private and not args.push_to_hub:
        raise SetupError("--private makes the repository of --push-to-hub private: give --push-to-hub OWNER/NAME")
    try:
        with setup_phase():  # reading the checkpoint, loading the model: every failure is the input's
            repo_id = check_repo_id(args.push_to_hub) if args.push_to_hub else None
            out = export_lora(args.checkpoint, args.out, weights=args.weights, merge=args.merge, model=args.model,
                              dtype=args.dtype, device=resolve_device(args.device), repo_id=repo_id,
                              license=args.license)
    except FileExistsError as error:
        raise SetupError(str(error)) from None
    kind = "pipeline with the LoRA merged" if args.merge else "diffusers LoRA folder"
    print(f"wrote {out} ({kind}, with its model card README.md)")
    if repo_id:
        print(f"pushed {out} to {push_to_hub(out, repo_id, private=args.private)}")


# add_registers_train moved to flowalign.cli.prep in 0.2: the old name works for one release, with a warning.
__getattr__ = moved_names(__name__, {"add_registers_train": "flowalign.cli.prep:add_registers_train"})
