"""A Flow-GRPO iteration at GPU scale: an SD3.5-Medium-sized transformer (its published config, 2.24 B parameters,
random weights), the real SD3 VAE architecture and small text encoders of the widths SD3 needs, in bf16 at 512 px.

Per fine-tuning mode (LoRA r32 on the joint-attention projections, and full fine-tuning), each in a process of its
own so the peak memory is its own, two iterations of ``configs/methods/flow_grpo.yaml`` (2 prompts x 4 images, 10
steps, CFG 4.5 off: guidance 1, the default CFG-free rollout) of which the second is measured:

* rollout seconds per image and training seconds per transition (``time/rollout``, ``time/train``);
* peak GPU memory (``torch.cuda.max_memory_allocated``);
* the rollout's achieved TFLOP/s: the transformer's FLOPs per image forward (``torch.utils.flop_counter`` on one
  forward at batch 1) times the forwards of the rollout, over its time, and that as a fraction of the GPU's dense
  bf16 peak (the physical limit; from a table of known GPUs, else not given). The VAE and text encoders are left out
  of the FLOPs, so the fraction is a lower bound on the transformer's own efficiency.

    python bench/gpu_scale.py [--out bench/results/device/gpu_scale.json]
    python bench/gpu_scale.py --tiny     # the same code on the tiny SD3 at 64 px (CPU), to check it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from scale import SD35_MEDIUM  # noqa: E402 - SD3.5-Medium's published transformer config

# SD3's published VAE (stabilityai/stable-diffusion-3-medium-diffusers, vae/config.json): 16 latent channels, x8.
SD3_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, blocks=4,
               mid_block_add_attention=True, scaling_factor=1.5305, shift_factor=0.0609, sample_size=1024)
# Dense bf16 peaks (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name().
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "B200": 2250.0,
                    "L40S": 362.1, "L4": 121.0, "A10": 125.0}
MODES = {"lora": ["model.finetune=lora", "model.lora_rank=32", "model.lora_alpha=64"], "full": ["model.finetune=full"]}


def pipeline(tiny: bool, device: str = "cuda"):
    """The pipeline: SD3.5-Medium-sized (on ``device``, bf16), or the tiny SD3 (``--tiny``)."""
    from flowalign.data.prompts import load_prompts
    from flowalign.models.tiny import tiny_sd3_pipeline

    words = sorted({w for e in load_prompts(REPO / "assets/prompts/train.jsonl") for w in e["prompt"].split()})
    if tiny:
        return tiny_sd3_pipeline(words, seed=0)
    with torch.device(device):  # random weights initialised on the GPU: no 9 GB host copy
        pipe = tiny_sd3_pipeline(words, max_length=77, clip_hidden=1024, clip_layers=1, t5_dim=4096, t5_layers=1,
                                 transformer=SD35_MEDIUM, vae={"latent_channels": 16, **SD3_VAE}, seed=0)
    return pipe.to(torch.bfloat16)


def transformer_flops_per_image(model, image_size: int) -> float:
    """FLOPs of one transformer forward for one image (batch 1, the text of one prompt)."""
    from torch.utils.flop_counter import FlopCounterMode

    cond = model.encode(["a photo of a red circle"])
    x = model.prepare_noise(1, image_size, generator=torch.Generator(model.device).manual_seed(0))
    with torch.no_grad(), torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
        with FlopCounterMode(display=False) as counter:
            model.velocity(x, 0.5, cond)
    return float(counter.get_total_flops())


def child(mode: str, tiny: bool) -> dict:
    """One mode's measurement, in this process."""
    import tempfile

    from flowalign.config import load_config
    from flowalign.models import wrap_pipeline
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    start = time.perf_counter()
    model = wrap_pipeline(pipeline(tiny))
    build_s = time.perf_counter() - start
    size = 64 if tiny else 512
    precision = [] if tiny else ["model.dtype=bf16", "model.mixed_precision=bf16"]
    with tempfile.TemporaryDirectory() as out:
        overrides = [*MODES[mode], *precision, f"sampling.image_size={size}", "sampling.num_steps=10",
                     "sampling.batch_size=4", "data.prompts_per_iteration=2", "data.group_size=4",
                     "reward.rewards=[{name: brightness}]", "model.gradient_checkpointing=true", "train.iterations=2",
                     "train.tracker=none", "train.eval_at_end=false", "train.sample_every=0",
                     "train.checkpoint_every=0", f"train.out_dir={out}"]
        config = load_config(TrainConfig, REPO / "configs/methods/flow_grpo.yaml", overrides)
        trainer = Trainer(config, model=model)
        if model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        history = trainer.train()
    measured = history[-1]
    images = config.data.prompts_per_iteration * config.data.group_size
    transitions = images * config.sampling.stochastic_steps()
    flops = transformer_flops_per_image(model, size)
    forwards = config.sampling.num_steps * (2 if model.uses_cfg(config.sampling.guidance_scale) else 1)
    rollout_tflops = flops * forwards * images / measured["time/rollout"] / 1e12
    row = {"mode": mode, "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
           "transformer_parameters": sum(p.numel() for p in model.transformer.parameters()),
           "trainable_parameters": sum(p.numel() for p in trainer.params), "image_size": size,
           "images": images, "transitions": transitions, "build_s": build_s,
           "rollout_s_per_image": measured["time/rollout"] / images,
           "train_s_per_transition": measured["time/train"] / transitions,
           "peak_gpu_bytes": torch.cuda.max_memory_allocated() if model.device.type == "cuda" else None,
           "transformer_gflop_per_forward": flops / 1e9, "rollout_tflops": rollout_tflops}
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in row["device"]), None)
    row["bf16_peak_tflops"] = peak
    row["fraction_of_peak"] = rollout_tflops / peak if peak else None
    return row


def table(rows: list[dict]) -> str:
    lines = ["| mode | device | rollout s / image | train s / transition | peak GPU GiB | rollout TFLOP/s | of bf16 peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 2 ** 30:.1f}"
        fraction = "" if r["fraction_of_peak"] is None else f"{r['fraction_of_peak']:.1%}"
        lines.append(f"| {r['mode']} | {r['device']} | {r['rollout_s_per_image']:.3f} | "
                     f"{r['train_s_per_transition']:.3f} | {peak} | {r['rollout_tflops']:.1f} | {fraction} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench/results/device/gpu_scale.json"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.tiny)), flush=True)
        return
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_scale.py needs a CUDA GPU (or --tiny for the CPU check)")
    rows = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--child", mode, *(["--tiny"] if args.tiny else [])],
                              capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            rows.append({"mode": mode, "error": done.stderr[-3000:]})
            print(f"{mode}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:]))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    good = [r for r in rows if "error" not in r]
    if good:
        text = table(good)
        out.with_suffix(".md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
