"""The planner's table for the published models (docs/guides/distributed.md, "Will it fit?"): per process on
8 x 80 GiB, FSDP2 over the 8, bf16 weights and compute, one sample a micro-batch without CFG, LoRA r32 on the
family's default targets or a full fine-tune, at the published resolution and frame count; and the peers' failing
reports as worked examples.

    python bench/memory_plan.py [--out bench/results/memory_plan.md]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from flowalign.memory.planner import GIB, Layout, verdict
from flowalign.memory.published import published_models

MODELS = ["sd35_medium", "flux_dev", "qwen_image", "wan21_t2v_14b", "wan22_t2v_a14b", "hunyuan_video15_480p_t2v"]
PARTS = ["parameters", "gradients", "optimizer state", "reference copy", "LoRA", "gathered blocks",
         "text encoders and VAE"]


def gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def table(gpus: int = 8, memory: float = 80) -> list[str]:
    models = published_models()
    rows = ["| model | size | mode | params | grads | Adam | reference | LoRA | gathered | encoders + VAE | "
            "activations (off / every block) | total | fits 80 GiB | smallest change |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in MODELS:
        spec = models[key]
        published = spec.published
        size = f"{published['width']}x{published['height']}" + (
            f", {published['num_frames']} f" if "num_frames" in published else "")
        for finetune in ("lora", "full"):
            layout = Layout(gpus=gpus, engine="fsdp2", finetune=finetune, height=published["height"],
                            width=published["width"], num_frames=published.get("num_frames"))
            result = verdict(spec, layout, memory)
            ckpt = verdict(spec, replace(layout, checkpoint_every=1), memory)
            plan = result.plan
            cells = [gib(plan.device.get(part, 0)) for part in PARTS]
            rows.append(f"| {spec.name} | {size} | {finetune} | {' | '.join(cells)} | "
                        f"{gib(plan.activations_plain)} / {gib(plan.activations_checkpointed)} | "
                        f"{gib(plan.total)} / {gib(ckpt.plan.total)} | "
                        f"{'yes' if result.fits else ('with checkpointing' if ckpt.fits else 'no')} | "
                        f"{' '.join(ckpt.change) if ckpt.change else '-'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/memory_plan.md")
    args = parser.parse_args()
    lines = table()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
