"""The runs tests/test_context_parallel.py compares, shared with its torchrun worker (tests/context_parallel_worker.py).

A run is a name, a tiny model (the image families at 32 px, the video families 5 frames at 32 px) and overrides
(every run with a KL term, so the reference policy's forwards run with the sequence split as well); ``one_iteration``
trains it for one iteration and returns what the comparison reads: the rollout's
log-probs and rewards of every sample (gathered over the data-parallel processes, in sample order), the loss, the
gradient norm and the updated trainable weights (all-gathered from FSDP2's shards).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowalign.training.context_parallel import split_transformers

REPO = Path(__file__).resolve().parents[1]
METHOD = str(REPO / "configs/methods/flow_grpo_fast.yaml")

BASE = {"model.lora_rank": 4, "model.lora_alpha": 8, "model.gradient_checkpointing": "false",
        "data.train_prompts": str(REPO / "assets/prompts/train.jsonl"), "data.prompts_per_iteration": 2,
        "data.group_size": 2, "sampling.num_steps": 6, "sampling.window_last": 3, "sampling.batch_size": 2,
        "optim.minibatches": 2, "loss.grpo.beta": 0.04,
        "optim.lr": 3e-3, "train.iterations": 1, "train.tracker": "none", "train.eval_at_end": "false",
        "train.sample_every": 0, "train.checkpoint_every": 1, "sampling.image_size": 32}
IMAGE = {"reward.rewards": "[{name: brightness}]"}
VIDEO = {"reward.rewards": "[{name: video_brightness}]", "sampling.num_frames": 5}
# Wan2.2 A14B: 4 steps (t = 1000, 900, 750, 500), the first 3 trained in one minibatch: both experts in the rollout
# and in every backward (a minibatch that left an expert out would give it, under DDP, a zero gradient that AdamW's
# weight decay still steps, and one process no gradient at all)
BOTH_EXPERTS = {"sampling.num_steps": 4, "sampling.window_size": 3, "sampling.window_start": "fixed",
                "sampling.window_last": "null", "optim.minibatches": 1}
MODELS = {"flux": IMAGE, "wan": VIDEO, "qwen_image": IMAGE, "flux2": IMAGE, "wan22": {**VIDEO, **BOTH_EXPERTS},
          "wan_i2v": {**VIDEO, "data.train_prompts": "ROOT/i2v.jsonl"},  # prompts with a first frame (i2v_prompts)
          "wan22_i2v": {**VIDEO, **BOTH_EXPERTS, "data.train_prompts": "ROOT/i2v.jsonl"},
          "skyreels_v2": VIDEO, "skyreels_v2_i2v": {**VIDEO, "data.train_prompts": "ROOT/i2v.jsonl"}}
ULYSSES_2 = {"distributed.context_parallel.ulysses": 2}
# the end-of-run evaluation on 2 held-out prompts (prompt_files), one image each, 2 steps
EVALUATION = {"train.eval_at_end": "true", "data.eval_prompts": "ROOT/eval.jsonl", "train.eval_images_per_prompt": 1,
              "train.eval_steps": 2}

# name -> (model, overrides); the context-parallel runs and the runs they equal
RUNS = {
    # 2 processes, data 1 x context 2: FLUX's LoRA
    # under FSDP2 (two iterations, checkpointed, then the end-of-run evaluation), Wan2.1's full fine-tune under DDP
    "flux-cp2": ("flux", {**ULYSSES_2, "distributed.engine": "fsdp2", "train.iterations": 2, **EVALUATION}),
    "wan-cp2": ("wan", {**ULYSSES_2, "model.finetune": "full"}),  # the KL's reference: the frozen copy, split too
    "flux-d2": ("flux", {}),  # 2 processes: data 2 x context 1
    # 2 processes, data 1 x context 2: the other families with a diffusers plan, the LoRA under DDP (Qwen-Image's
    # last block's to_add_out LoRA takes no part in the forward: DDP looks for unused parameters there,
    # FlowModel.ddp_find_unused_parameters); Qwen-Image's text cut to 11 tokens: odd, so padded to 12 (masked) under
    # the split
    "qwen_image-cp2": ("qwen_image", {**ULYSSES_2, "model.max_sequence_length": 11}),
    "flux2-cp2": ("flux2", ULYSSES_2),
    "wan22-cp2": ("wan22", ULYSSES_2),  # both experts split
    "wan_i2v-cp2": ("wan_i2v", ULYSSES_2),  # the CLIP image tokens join the (unsplit) text
    "wan22_i2v-cp2": ("wan22_i2v", ULYSSES_2),  # the first frame in the latents' channels, both experts
    # 2 processes, data 1 x context 2: SkyReels-V2 T2V and I2V under flowalign's plan (skyreels_v2_plan), LoRA, DDP
    "skyreels_v2-cp2": ("skyreels_v2", ULYSSES_2),
    "skyreels_v2_i2v-cp2": ("skyreels_v2_i2v", ULYSSES_2),  # the CLIP image tokens ahead of the (unsplit) text
    "flux-d2-cp2": ("flux", ULYSSES_2),  # 4 processes: data 2 x context 2
    # 4 processes: data 2 x context 2 under HSDP (FSDP2, 2 copies each sharded over 2 processes)
    "flux-hsdp-cp2": ("flux", {**ULYSSES_2, "distributed.engine": "fsdp2", "distributed.replicate": 2}),
    # on two GPUs only (bench/context_parallel.py): ring attention needs cuDNN's attention, in bf16
    "flux-ring2": ("flux", {"distributed.context_parallel.ring": 2, "model.mixed_precision": "bf16"}),
    "flux-bf16": ("flux", {"model.mixed_precision": "bf16"}),
}


def prompt_files(root: Path) -> None:
    """``ROOT/i2v.jsonl``: 4 prompts, each with the same 32x32 first frame (``ROOT/first.png``); ``ROOT/eval.jsonl``:
    the first 2 held-out prompts (the end-of-run evaluation's)."""
    import json

    from video_families import first_frame_image

    first_frame_image((32, 32)).save(root / "first.png")
    prompts = ["a photo of a circle and a square", "a photo of a square and a circle", "a red circle", "a blue square"]
    (root / "i2v.jsonl").write_text("".join(json.dumps({"prompt": p, "images": ["first.png"]}) + "\n" for p in prompts))
    held_out = (REPO / "assets/prompts/test.jsonl").read_text().splitlines()[:2]
    (root / "eval.jsonl").write_text("\n".join(held_out) + "\n")


def settings(root: Path, name: str, out: Path, **extra) -> list[str]:
    """The dotted overrides of run ``name`` (``root`` holds the tiny models; ``ROOT/`` in a value is it), into
    ``out``."""
    model, overrides = RUNS[name]
    values = {**BASE, **MODELS[model], "model.path": str(root / model), **overrides, "train.out_dir": str(out),
              **extra}
    values = {k: v.replace("ROOT/", f"{root}/") if isinstance(v, str) else v for k, v in values.items()}
    return [f"{k}={v}" for k, v in values.items()]


def trainer_for(root: Path, name: str, out: Path, **extra):
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    return Trainer(load_config(TrainConfig, METHOD, settings(root, name, out, **extra)))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def first_block(transformer: torch.nn.Module) -> torch.nn.Module:
    """The first block of the (first) diffusers transformer in ``transformer`` (the high expert of a pair)."""
    transformer = split_transformers(transformer)[0]
    return (getattr(transformer, "transformer_blocks", None) or transformer.blocks)[0]


def one_iteration(trainer) -> dict[str, torch.Tensor]:
    """Train ``trainer``'s next iteration; its figures (module docstring), the same on every process, and
    ``layout/block_tokens``: the image or video tokens the transformer's first block returned in this process's first
    forward; ``layout/text_tokens``: the text lengths the transformer was given (before the plan's split)."""
    before = {f"init/{k}": full(v).detach().cpu().clone() for k, v in trainer.trainable_state().items()}
    seen, texts = [], set()
    hooks = [first_block(trainer.model.transformer).register_forward_hook(  # its output: after the plan's split
        lambda module, args, output: seen.append((output[-1] if isinstance(output, tuple) else output).shape[1])),
        split_transformers(trainer.model.transformer)[0].register_forward_pre_hook(  # its input: before the split
            lambda module, args, kwargs: texts.add(kwargs["encoder_hidden_states"].shape[1]), with_kwargs=True)]
    try:
        metrics, _, batches, scores = trainer.train_iteration(trainer.iteration)
    finally:
        for hook in hooks:
            hook.remove()
    trainer.iteration += 1
    trainer.history.append(metrics)
    accelerator = trainer.accelerator  # a context-parallel run's data-parallel view: each sample once
    log_probs = torch.cat([b.transitions.log_prob for b in batches])
    figures = {"log_probs": accelerator.gather(log_probs.to(accelerator.device)).cpu(),
               "rewards": accelerator.gather(scores.combined.to(accelerator.device)).cpu(),
               "loss": torch.tensor([metrics["loss"]]), "grad_norm": torch.tensor([metrics["grad_norm"]]),
               "first_ratio_max": torch.tensor([metrics["first_ratio_max"]]), **before,
               "layout/block_tokens": torch.tensor(seen[:1]), "layout/text_tokens": torch.tensor(sorted(texts))}
    figures.update({f"weight/{k}": full(v).detach().cpu() for k, v in trainer.trainable_state().items()})
    return figures


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (0 when both are 0)."""
    scale = b.double().norm()
    return float((a.double() - b.double()).norm() / scale) if scale > 0 else float((a - b).abs().max())


def weights(figures: dict, prefix: str = "weight/") -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in figures.items() if k.startswith(prefix)}


def update_difference(a: dict, b: dict) -> float:
    """``|w_a - w_b| / |w_b - w_0|`` over the trainable weights after the iteration (``w_0``: before it)."""
    wa, wb, w0 = weights(a), weights(b), weights(b, "init/")
    return float(sum((wa[k] - wb[k]).double().pow(2).sum() for k in wb).sqrt()
                 / sum((wb[k] - w0[k]).double().pow(2).sum() for k in wb).sqrt())
