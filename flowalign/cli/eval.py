"""``flowalign eval toy|toy-video|geneval|hpd|ocr``: each built from its settings dataclass (``EvalConfig``,
``GenEvalRunConfig``, ``HPDRunConfig``, ``OcrRunConfig``, all extending ``SamplingRun``) by the config loader; the
options are generated from their fields."""

from __future__ import annotations

import argparse

from .options import ConfigCommand, add_config_command

__all__ = ["add_eval_commands"]





def _run_eval_toy(config, args: argparse.Namespace) -> None:
    from flowalign.evaluation.toy_eval import run_eval

    run_eval(config)


def _run_eval_toy_video(config, args: argparse.Namespace) -> None:
    from flowalign.evaluation.toy_video_eval import run_video_eval

    run_video_eval(config)


def _run_eval_geneval(config, args: argparse.Namespace) -> None:
    from flowalign.errors import SetupError
    from flowalign.evaluation.geneval_eval import run_geneval

    if config.model is None and config.lora is None and config.images is None:
        raise SetupError("give --model to generate images, or --images DIR to score an existing GenEval folder")
    run_geneval(config)


def _run_eval_hpd(config, args: argparse.Namespace) -> None:
    from flowalign.errors import SetupError
    from flowalign.evaluation.hpd_eval import run_hpd

    if config.model is None and config.lora is None:
        raise SetupError("give --model (the pipeline to evaluate), or --lora with a training checkpoint")
    run_hpd(config)


def _run_eval_ocr(config, args: argparse.Namespace) -> None:
    from flowalign.evaluation.ocr_eval import run_ocr

    run_ocr(config)


def add_eval_commands(group) -> None:
    add_config_command(
        group, "toy", ConfigCommand("flowalign.evaluation.toy_eval:EvalConfig", _run_eval_toy),
        help="GenEval-style evaluation on the toy world",
        description="Sample the toy prompts with the ODE, detect shapes, judge with GenEval's rules; writes "
        "results.json, summary.md and grid.png to --out.",
    )
    add_config_command(
        group, "toy-video", ConfigCommand("flowalign.evaluation.toy_video_eval:VideoEvalConfig", _run_eval_toy_video),
        help="the toy video world's verifier on sampled clips (object, count, colour, direction)",
        description="Sample the toy video prompts with the ODE and verify each clip exactly (per-frame object, "
        "count and colour, tracked direction of motion); writes results.json, summary.md and strips.png to --out "
        "(with --lora --paired also the paired before/after statistics).",
    )
    add_config_command(
        group, "geneval", ConfigCommand("flowalign.evaluation.geneval_eval:GenEvalRunConfig", _run_eval_geneval),
        help="GenEval: generate into GenEval's folder layout (or score an existing folder) and judge",
        description="With --model, sample every prompt of --metadata into <out>/images (or --images) in GenEval's "
        "layout (<dir>/00000/metadata.jsonl, samples/00000.png); without --model, score the existing folder "
        "--images. Writes results.json and summary.md to --out.",
    )
    add_config_command(
        group, "hpd", ConfigCommand("flowalign.evaluation.hpd_eval:HPDRunConfig", _run_eval_hpd),
        help="HPD v2: HPS v2.1 of generated images, per style (mean of 10 chunk means, std) and Average",
        description="Sample the HPD v2 prompts (--prompts DIR with anime.json, concept-art.json, paintings.json, "
        "photo.json) and score them with HPS v2.1; writes results.json and summary.md to --out.",
    )
    add_config_command(
        group, "ocr", ConfigCommand("flowalign.evaluation.ocr_eval:OcrRunConfig", _run_eval_ocr),
        help="Flow-GRPO's OCR reward (PP-OCRv4) of generated images: the text-rendering benchmark",
        description="Sample every prompt of --prompts (default: Flow-GRPO's OCR test prompts, each quoting the text "
        "to render), read each image with PP-OCRv4 and score it with Flow-GRPO's rule; writes results.json and "
        "summary.md to --out. Needs the ocr extra (pip install -e '.[ocr]').",
    )
