"""Memory per process under DDP and FSDP2: measured for a full fine-tune of the toy transformer on 2 CPU processes,
and computed for a transformer with SD3.5-Medium's published dimensions (shapes only, on the meta device).

Measured (``torchrun --nproc_per_node 2``, gloo, one iteration of the toy default with ``model.finetune: full``):
per process, the peak RSS (``getrusage``) and the bytes each process holds of the trained parameters, their
gradients (read just before the optimizer step), the Adam state and the frozen reference copy, each counted as the
process's local tensors (an FSDP2 DTensor's local shard).

Computed: the same four parts for SD3.5-Medium's transformer (its published config: 24 layers of width 1536, 13 of
them with dual attention) built on the meta device, per mode: LoRA (bf16 base, fp32 adapter at the ``sd35_medium``
preset's rank 32 on its joint-attention targets) and full fine-tuning (fp32 master weights, gradients and Adam
moments, a bf16 reference), under DDP (every process holds all of it) and FSDP2 over W processes (a 1/W share). The
text encoders, the VAE and the activations come on top and are not counted; the table says how many GPUs of 80 GB
and 141 GB the transformer state alone needs per mode.

    python bench/scale.py [--out bench/results/scale]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RUN = ["model.finetune=full", "train.iterations=1", "train.tracker=none", "train.eval_at_end=false",
       "train.sample_every=0", "train.checkpoint_every=0", "data.prompts_per_iteration=2", "data.group_size=4",
       "sampling.batch_size=4"]
SD35_MEDIUM = dict(attention_head_dim=64, caption_projection_dim=1536, dual_attention_layers=list(range(13)),
                   in_channels=16, joint_attention_dim=4096, num_attention_heads=24, num_layers=24, out_channels=16,
                   patch_size=2, pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm",
                   sample_size=128)
GPUS = {"80 GB": 80e9, "141 GB": 141e9}


def local_bytes(tensors) -> int:
    """Bytes of the local parts of ``tensors`` (a DTensor's shard on this process)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def worker(engine: str, out: Path, extra: list[str]) -> None:
    """One process of the measured run (``RUN`` and ``extra`` overrides): train one iteration and write this
    process's figures."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    config = load_config(TrainConfig, None, RUN + extra + [f"distributed.engine={engine}", f"train.out_dir={out / engine}"])
    trainer = Trainer(config)
    seen = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        seen["gradients"] = local_bytes(p.grad for p in trainer.params if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.step()
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    model = trainer.model
    rank = trainer.accelerator.process_index
    figures = {"engine": engine, "rank": rank, "processes": trainer.accelerator.num_processes,
               "parameters": local_bytes(model.transformer.parameters()), "gradients": seen["gradients"],
               "optimizer": local_bytes(state), "reference": local_bytes(model.reference_transformer.parameters()),
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "transformer_parameters": sum(p.numel() for p in model.transformer.parameters())}
    figures["state"] = figures["parameters"] + figures["gradients"] + figures["optimizer"]
    (out / f"{engine}-rank{rank}.json").write_text(json.dumps(figures))


def measure(out: Path, processes: int = 2, extra: tuple[str, ...] = ()) -> dict:
    """The measured run for each engine (``torchrun``), with ``extra`` overrides (the test's shorter rollouts: the
    state measured does not depend on them); the figures of every process."""
    rows = {}
    for engine in ("ddp", "fsdp2"):
        done = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node",
                               str(processes), __file__, "--worker", engine, "--out", str(out), *extra],
                              env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}, cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{engine}: exit {done.returncode}\n{done.stderr[-3000:]}")
        rows[engine] = [json.loads((out / f"{engine}-rank{r}.json").read_text()) for r in range(processes)]
    return rows


def computed_sd35_medium() -> dict:
    """Per-process bytes of SD3.5-Medium's transformer state per mode (module docstring)."""
    from diffusers import SD3Transformer2DModel

    from flowalign.models.sd3 import SD3Model

    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**SD35_MEDIUM)
    n = sum(p.numel() for p in transformer.parameters())
    rank = 32
    lora = sum(rank * (m.in_features + m.out_features) for name, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name.endswith(t) for t in SD3Model.lora_targets))
    modes = {
        # base bf16 (2 B), adapter fp32 weights + gradients + two Adam moments (16 B); the reference is the base
        "lora": {"parameters": 2 * n + 4 * lora, "gradients": 4 * lora, "optimizer": 8 * lora, "reference": 0},
        # fp32 master weights, gradients, two Adam moments; a bf16 frozen reference copy
        "full": {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n, "reference": 2 * n},
    }
    table = {}
    for mode, parts in modes.items():
        total = sum(parts.values())
        table[mode] = {"bytes": parts, "total": total,
                       "ddp_gpus_needed": {g: (1 if total <= cap else None) for g, cap in GPUS.items()},
                       "fsdp2_gpus_needed": {g: math.ceil(total / cap) for g, cap in GPUS.items()},
                       "fsdp2_per_process": {w: total / w for w in (1, 2, 4, 8)}}
    return {"transformer_parameters": n, "lora_parameters": lora, "lora_rank": rank, "modes": table}


def report(measured: dict, computed: dict) -> str:
    gib = 2 ** 30
    lines = ["Measured: full fine-tune of the toy transformer, 2 CPU processes (gloo), one iteration; per process "
             "(rank 0 / rank 1), MiB.", "",
             "| engine | parameters | gradients | Adam state | params + grads + Adam | reference copy | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    for engine, ranks in measured.items():
        def cell(key):
            return " / ".join(f"{r[key] / 2 ** 20:.2f}" for r in ranks)
        lines.append(f"| {engine} | {cell('parameters')} | {cell('gradients')} | {cell('optimizer')} | "
                     f"{cell('state')} | {cell('reference')} | {cell('peak_rss')} |")
    ratio = max(r["state"] for r in measured["fsdp2"]) / max(r["state"] for r in measured["ddp"])
    lines += ["", f"FSDP2's largest per-process parameters + gradients + Adam state is {ratio:.1%} of DDP's.", "",
              f"Computed: SD3.5-Medium's transformer ({computed['transformer_parameters'] / 1e9:.2f} B parameters; "
              f"LoRA rank {computed['lora_rank']} on the joint-attention projections: "
              f"{computed['lora_parameters'] / 1e6:.1f} M), state only (no text encoders, VAE or activations), GiB "
              "per process.", "",
              "| mode | DDP (any process count) | FSDP2, 2 | FSDP2, 4 | FSDP2, 8 | one 80 GB GPU (DDP) | one 141 GB GPU "
              "(DDP) | GPUs needed, 80 GB (FSDP2) | GPUs needed, 141 GB (FSDP2) |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, row in computed["modes"].items():
        per = row["fsdp2_per_process"]
        fits = {g: "fits" if row["ddp_gpus_needed"][g] else "does not fit" for g in GPUS}
        lines.append(f"| {mode} | {row['total'] / gib:.1f} | {per[2] / gib:.1f} | {per[4] / gib:.1f} | "
                     f"{per[8] / gib:.1f} | {fits['80 GB']} | {fits['141 GB']} | {row['fsdp2_gpus_needed']['80 GB']} | "
                     f"{row['fsdp2_gpus_needed']['141 GB']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench/results/scale"))
    parser.add_argument("--worker", choices=["ddp", "fsdp2"], help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help=argparse.SUPPRESS)  # the worker's overrides (``measure``)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.worker, out, args.extra)
        return
    measured, computed = measure(out), computed_sd35_medium()
    for path in out.glob("*-rank*.json"):  # the processes' own files, folded into scale.json
        path.unlink()
    (out / "scale.json").write_text(json.dumps({"measured": measured, "sd35_medium": computed}, indent=1) + "\n")
    text = report(measured, computed)
    (out / "scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
