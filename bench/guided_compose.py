"""Training and inference-time alignment together: a trained LoRA under FK steering, against each alone.

Four rows on the held-out toy prompts, the same prompts and seeds in each (so every gain is paired image by image
against the base model's plain ODE samples, with its SE): the base model plain (``none``, T NFEs) and under a guided
sampler (``--guidance``, default FK at ``--budget`` 40), then the LoRA (``--lora``, a checkpoint of ``flowalign
train``; its EMA weights unless ``--weights last``) plain and under the same sampler. Judged by the exact verifier
(binary toy GenEval); the sampler is guided by ``toy_geneval`` with partial credit, as ``bench/guided.py`` does.

Writes JSON (``--out``) and a markdown table (``.md``).

    python bench/guided_compose.py --lora outputs/train/checkpoint-000330 [--budget 40 --repeats 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from guided import run_method  # noqa: E402 - bench/guided.py (imported now: loading a pipeline drops sys.path[0])


def table(rows: list[dict]) -> str:
    lines = ["| model | sampler | mean NFE | toy GenEval overall | paired gain over base plain | SE | images correct |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['mean_nfe']:.1f} | {r['overall']:.3f} | {r['gain']:+.3f} | "
                     f"{r['gain_se']:.3f} | {r['images_correct']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import paired_difference
    from flowalign.lora_loading import load_model, resolve_lora
    from flowalign.inference.sample import SampleConfig
    from flowalign.toy.reward import ToyGenEvalReward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "assets/toy-sd3"))
    parser.add_argument("--lora", required=True, help="a flowalign train checkpoint (or a LoRA folder)")
    parser.add_argument("--weights", choices=("ema", "last"), default=None)
    parser.add_argument("--prompts", default=str(REPO / "assets/prompts/test.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=66)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", default="fk")
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench/results/guided_compose.json"))
    args = parser.parse_args()

    metadata = load_metadata(args.prompts)[: args.max_prompts] * args.repeats
    reward_fn = ToyGenEvalReward(partial_credit=True)
    lora = resolve_lora(args.lora, args.weights)
    rows = []
    for label, model in (("base", load_model(args.model, None)), (f"LoRA ({lora.weights})", load_model(args.model, lora))):
        model.transformer.requires_grad_(False)
        for method, budget in (("none", args.steps), (args.guidance, args.budget)):
            config = SampleConfig(guidance=method, budget=budget, steps=args.steps, seed=args.seed,
                                  batch_prompts=args.batch_prompts)
            config.validate()
            row = {"model": label, "method": method, "budget": budget,
                   **run_method(model, metadata, config, reward_fn, None)}
            rows.append(row)
            print(f"{label} {method} {budget}: overall {row['overall']:.3f}", flush=True)
    keyed = lambda row: [{**image, "image_index": 0} for image in row["images"]]  # noqa: E731
    for row in rows:
        overall = paired_difference(keyed(rows[0]), keyed(row))["overall"]
        row["gain"], row["gain_se"] = overall["diff"], overall["se"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "prompts": len(metadata), "rows": rows}, indent=1))
    text = table(rows)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
