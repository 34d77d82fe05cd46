"""Peak memory of a LoRA training step of a Wan transformer under FSDP2 with every block checkpointed, against the
planner's prediction (``flowalign.memory.planner``): ``bench/device_check.sh``'s memory stage.

The transformer is built from its config (default: Wan2.1-T2V-14B's, shipped in configs/published) with random
weights, a LoRA r32 on the family's targets, sharded by FSDP2 over a world of one (per block, then the root, as the
``fsdp2`` engine does), every block checkpointed (``distributed.activation_checkpointing: 1``), and trained for one
step (forward, backward, AdamW) on one sample of random latents at the published resolution and frame count, with
random text embeddings of the published length. Measured: ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the
peak of live tensor bytes (``flowalign.memory.activations.LivePeak``, plus every tensor held). Predicted: the plan of
the same layout on one process, less the text encoders and VAE, which this step does not hold.

    python bench/memory_check.py [--model Wan-AI/Wan2.1-T2V-14B-Diffusers] [--out bench/results/device/memory.json]
    python bench/memory_check.py --model assets/toy-wan --height 32 --width 32 --frames 5 --text-tokens 16  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from flowalign.memory.checkpointing import checkpoint_blocks
from flowalign.memory.planner import GIB, Layout, plan
from flowalign.memory.published import model_spec


def build(spec, device: torch.device, dtype: torch.dtype, rank: int) -> torch.nn.Module:
    """The transformer with random weights in ``dtype`` on ``device``, and an fp32 LoRA on the family's targets."""
    import diffusers
    from peft import LoraConfig

    from flowalign.models.base import MODEL_FAMILIES

    config = spec.transformers["transformer"]
    cls = getattr(diffusers, config["_class_name"])
    if cls is not diffusers.WanTransformer3DModel:
        raise SystemExit(f"memory_check drives Wan transformers; {config['_class_name']} is not one")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the weights are made in their dtype, on the device: no fp32 copy of 14 B
    try:
        with torch.device(device):
            transformer = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    finally:
        torch.set_default_dtype(default)
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank,
                                       target_modules=list(MODEL_FAMILIES.get(spec.family).lora_targets)))
    for param in transformer.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Wan-AI/Wan2.1-T2V-14B-Diffusers")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--text-tokens", type=int, default=None)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flowalign.memory.activations import LivePeak
    from flowalign.training.parallel_engines import transformer_blocks

    spec = model_spec(args.model)
    height = args.height or spec.published.get("height", 480)
    width = args.width or spec.published.get("width", 832)
    frames = args.frames or spec.published.get("num_frames", 81)
    text_tokens = args.text_tokens or spec.geometry.get("text_tokens") or 512
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)

    transformer = build(spec, device, dtype, args.rank)
    checkpoint_blocks(transformer, 1)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in transformer_blocks(transformer):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(transformer, mesh=mesh, mp_policy=policy)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    config, g = transformer.config, spec.geometry
    latent_frames = (frames - 1) // (g.get("vae_temporal") or 1) + 1
    latents = torch.randn(1, config.in_channels, latent_frames, height // g["vae_spatial"],
                          width // g["vae_spatial"], device=device, dtype=dtype)
    text = torch.randn(1, text_tokens, config.text_dim, device=device, dtype=dtype)
    timestep = torch.tensor([500.0], device=device)

    def step():
        out = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    layout = Layout(gpus=1, engine="fsdp2", finetune="lora", dtype="bf16" if cuda else "fp32",
                    compute="bf16" if cuda else "fp32", lora_rank=args.rank, checkpoint_every=1, micro_batch=1,
                    height=height, width=width, num_frames=frames, text_tokens=text_tokens)
    planned = plan(spec, layout)
    predicted = planned.total - planned.device["text encoders and VAE"]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    else:
        step()  # the Adam state exists from here on, as in a run's later steps
        tensors = (*transformer.parameters(), *transformer.buffers(), latents, text, timestep)
        tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        held = {t.untyped_storage().data_ptr(): t for t in tensors}
        held.update({t.untyped_storage().data_ptr(): t for t in
                     (v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values()
                      for v in s.values()) if torch.is_tensor(t) and t.dim() > 0})
        with LivePeak(held.values()) as peak:
            step()
        measured = peak.peak + sum(t.untyped_storage().nbytes() for t in held.values())
    result = {"model": spec.name, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "height": height, "width": width, "frames": frames, "text_tokens": text_tokens,
              "predicted_gib": predicted / GIB, "measured_gib": measured / GIB,
              "relative_error": predicted / measured - 1,
              "plan_gib": {part: value / GIB for part, value in planned.device.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
