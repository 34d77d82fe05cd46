"""The memory planner (``flowalign plan``, ``flowalign.memory``): the published models build on the meta device at
their published sizes; the activation rule (measured at one shape, scaled by tokens x width) predicts a real forward
at another; the plan of the tiny SD3 is within 15% of the peak of live tensor bytes measured over a real training
step (forward, backward, AdamW); the verdict names the smallest change; bad input is refused before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowalign.cli import main
from flowalign.config import ConfigError, load_config
from flowalign.memory.activations import LivePeak
from flowalign.memory.planner import (GIB, Layout, lora_parameters, measured_profile, model_counts, plan, plan_config,
                                      verdict)
from flowalign.memory.published import model_spec, published_models
from flowalign.models import load_flow_model
from flowalign.training.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "assets/toy-sd3")

# Transformer parameters, billions, as their model cards and docs state them (rounded there).
PUBLISHED_BILLIONS = {"sd35_medium": 2.24, "flux_dev": 11.9, "qwen_image": 20.4,
                      "wan21_t2v_14b": 14.3, "wan22_t2v_a14b": 28.6, "hunyuan_video15_480p_t2v": 8.3}


def test_published_models_build_on_the_meta_device_at_their_published_sizes():
    models = published_models()
    assert set(PUBLISHED_BILLIONS) <= set(models)
    for key, billions in PUBLISHED_BILLIONS.items():
        counts = model_counts(models[key], Layout(finetune="full"))
        assert counts.parameters / 1e9 == pytest.approx(billions, rel=0.01), key
    assert models["Wan-AI/Wan2.1-T2V-14B-Diffusers"] is models["wan21_t2v_14b"]
    # Wan2.1 720p, 81 frames: 21 latent frames of 45 x 80 patches
    assert models["wan21_t2v_14b"].image_tokens(720, 1280, 81) == 21 * 45 * 80
    assert models["flux_kontext_dev"].image_tokens(1024, 1024) == 2 * models["flux_dev"].image_tokens(1024, 1024)


def toy_model(finetune: str):
    model = load_flow_model(TOY)
    if finetune == "lora":
        model.add_lora(rank=8)
        model.freeze_base()
    else:
        model.make_full_finetune()
    return model


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_the_activation_rule_measured_at_32_px_predicts_a_real_forward_at_64_px(finetune):
    model = toy_model(finetune)
    small, large = measured_profile(model, 1, 32), measured_profile(model, 2, 64)
    block = large.blocks[0]
    predicted = small.scaled([b.kind for b in large.blocks], batch=2, tokens=block.tokens, width=block.width,
                             itemsize=4)
    for every in (0, 1, 2):
        error = predicted.total(every) / large.total(every, scores=False) - 1
        print(f"{finetune}, checkpointing every {every}: rule error {error:+.2%}")
        assert abs(error) < 0.05


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_the_plan_of_the_tiny_sd3_is_within_15_percent_of_its_measured_peak(finetune):
    """Measured: the live tensor bytes at their peak over a second training step (the first creates the Adam
    state), forward, backward and AdamW, at 2 samples of 64 px: every parameter, buffer and Adam moment held, plus the
    peak of the step's own allocations (``LivePeak``). Planned: the same config on one process, activations measured
    at 32 px and scaled."""
    batch, size = 2, 64
    model = toy_model(finetune)
    x = torch.randn(model.latent_shape(batch, size), generator=torch.Generator().manual_seed(0))
    cond = model.encode(["a red circle"] * batch)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def step():
        loss = model.velocity(x, torch.tensor(0.5), cond).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    modules = [m for m in model.pipe.components.values() if isinstance(m, torch.nn.Module)]
    modules += [model.reference_transformer] if model.reference_transformer is not None else []
    held = {t.untyped_storage().data_ptr(): t for m in modules for t in (*m.parameters(), *m.buffers())}
    held.update({t.untyped_storage().data_ptr(): t for s in optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0})
    with LivePeak(held.values()) as peak:
        step()
    measured = peak.peak + sum(t.untyped_storage().nbytes() for t in held.values())
    layout = Layout(engine="ddp", finetune=finetune, dtype="fp32", compute="fp32", lora_rank=8, micro_batch=batch,
                    height=size, width=size)
    planned = plan(model_spec(TOY), layout)
    error = planned.total / measured - 1
    print(f"{finetune}: planned {planned.total / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, {error:+.1%}")
    assert abs(error) < 0.15


def wan14b(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, str(REPO / "configs/models/wan21_t2v.yaml"),
                       ["model.path=Wan-AI/Wan2.1-T2V-14B-Diffusers", "sampling.image_size=720",
                        "sampling.num_frames=81", "sampling.batch_size=1", "sampling.guidance_scale=1",
                        "data.group_size=8", *overrides])


def test_the_verdict_names_the_smallest_change_that_fits():
    """Wan2.1-14B at 720 px and 81 frames, one sample a micro-batch: without checkpointing it does not fit 8 x 80 GiB
    and checkpointing is the change; context parallel 2 halves the activations; HSDP 2 x 4 holds twice FSDP2's
    shard."""
    config = wan14b("model.gradient_checkpointing=false", "distributed.engine=fsdp2")
    result = plan_config(config, gpus=8, gpu_memory_gib=80)
    assert not result.fits and result.change == ["distributed.activation_checkpointing=1"]
    assert result.changed.total <= result.capacity < result.plan.total
    spec = model_spec("Wan-AI/Wan2.1-T2V-14B-Diffusers")
    layout = Layout(gpus=8, engine="fsdp2", height=720, width=1280, num_frames=81, checkpoint_every=1)
    one = verdict(spec, layout, 80).plan
    assert one.total / GIB < 80
    measured = (one.activations_plain, one.activations_checkpointed)
    two = plan(spec, replace(layout, context_parallel=2), activation_bytes=tuple(a // 2 for a in measured))
    assert two.device["activations"] == one.device["activations"] // 2
    hsdp = plan(spec, replace(layout, replicate=2), activation_bytes=measured)
    assert hsdp.device["parameters"] == pytest.approx(2 * one.device["parameters"], abs=1)
    offloaded = plan(spec, replace(layout, cpu_offload=True), activation_bytes=measured)
    assert offloaded.host["parameters"] == one.device["parameters"] and "parameters" not in offloaded.device


def test_the_configs_context_parallel_degree_is_the_plans_default():
    """``distributed.context_parallel`` (ulysses x ring) is what the plan assumes unless --context-parallel says
    otherwise: ulysses 2 plans the activations of half the sequence, as --context-parallel 2 does."""
    plain = plan_config(wan14b("distributed.engine=fsdp2"), gpus=8, gpu_memory_gib=80).plan
    config = wan14b("distributed.engine=fsdp2", "distributed.context_parallel.ulysses=2")
    split = plan_config(config, gpus=8, gpu_memory_gib=80).plan
    assert split.device["activations"] < plain.device["activations"]
    assert split.device == plan_config(wan14b("distributed.engine=fsdp2"), gpus=8, gpu_memory_gib=80,
                                       context_parallel=2).plan.device
    assert plan_config(config, gpus=8, gpu_memory_gib=80, context_parallel=1).plan.device == plain.device


def test_the_lora_count_is_pefts():
    model = load_flow_model(TOY)
    base = sum(p.numel() for p in model.transformer.parameters())
    expected = lora_parameters(model.transformer, list(model.lora_targets), 8)
    model.add_lora(rank=8)
    assert sum(p.numel() for p in model.transformer.parameters()) - base == expected > 0


@pytest.mark.parametrize("arguments, named", [
    (["--gpus", "0"], "gpus"),
    (["--gpu-memory", "-3"], "gpu_memory"),
    (["--nodes", "0"], "nodes"),
    (["model.path=nobody/nothing"], "model.path"),
    (["model.family=nope"], "model.family"),
    (["--gpus", "3", "distributed.engine=fsdp2", "distributed.replicate=2"], "distributed.replicate"),
])
def test_plan_refuses_bad_input_naming_it(arguments, named, capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", *arguments])
    assert done.value.code == 2
    assert f"error: {named}" in capsys.readouterr().err


def test_plan_prints_the_table_and_the_verdict_for_the_toy_run(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    main(["plan", "--gpus", "2", "--gpu-memory", "24", "model.finetune=full", "distributed.engine=fsdp2"])
    out = capsys.readouterr().out
    for line in ("parameters", "gradients", "optimizer state", "reference copy", "activations, no checkpointing",
                 "activations, checkpointing every block", "verdict: fits"):
        assert line in out, out


def test_a_published_model_and_a_contradicting_family_are_refused():
    with pytest.raises(ConfigError) as error:
        model_spec("Qwen/Qwen-Image", "flux")
    assert error.value.key == "model.family"


def test_the_device_checks_memory_stage_runs_on_a_cpu(tmp_path):
    """bench/memory_check.py (bench/device_check.sh's memory stage) on the toy Wan transformer at 32 px and 5 frames:
    FSDP2 over a world of one, every block checkpointed, one LoRA step; its plan is within 25% of the measured peak
    at this size (15 MB), where FSDP2's own buffers weigh most. The 14B run is the GPU's."""
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, str(REPO / "bench/memory_check.py"), "--model", str(REPO / "assets/toy-wan"),
                           "--height", "32", "--width", "32", "--frames", "5", "--text-tokens", "16",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    print(f"toy Wan on a CPU: planned {result['predicted_gib'] * 1024:.1f} MiB, measured "
          f"{result['measured_gib'] * 1024:.1f} MiB, {result['relative_error']:+.1%}")
    assert result["device"] == "cpu" and abs(result["relative_error"]) < 0.25


def test_a_local_model_is_planned_at_its_own_default_size():
    """With ``sampling.image_size`` null, a local model is planned at the size its pipeline samples by default (the
    transformer's ``sample_size`` in latent pixels times the VAE's factor): the toy SD3's 32 px, as the adapter's
    ``default_image_size`` says, not a published model's 512."""
    from flowalign.memory.planner import layout_from_config

    assert model_spec(TOY).published == {"height": 32, "width": 32} == dict(
        zip(("height", "width"), load_flow_model(TOY).default_image_size))
    layout = layout_from_config(load_config(TrainConfig, str(REPO / "configs/default.yaml"), []), gpus=1)
    assert (layout.height, layout.width) == (32, 32)


def test_only_a_family_that_splits_its_sequence_is_told_to_use_context_parallelism():
    """SD3 refuses context parallelism (its joint attention bypasses diffusers' dispatcher), so the verdict never
    proposes it there, while Wan2.1 may be told to use it."""
    from flowalign.memory.planner import splits_sequence

    assert not splits_sequence(model_spec("stabilityai/stable-diffusion-3.5-medium"))
    assert not splits_sequence(model_spec(TOY))
    assert splits_sequence(model_spec("Wan-AI/Wan2.1-T2V-14B-Diffusers"))
    layout = Layout(gpus=8, engine="fsdp2", height=4096, width=4096, checkpoint_every=1, cpu_offload=True)
    result = verdict(model_spec("stabilityai/stable-diffusion-3.5-medium"), layout, 80)
    assert not any("context" in change for change in result.change or [])
