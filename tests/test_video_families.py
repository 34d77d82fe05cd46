"""The video adapter contract, for every family in tests/video_families.py.

* an ODE rollout through the adapter equals the pipeline's own ``output_type="latent"`` result bit for bit (same
  seed and steps; with and without CFG; a square and a non-square frame size), with a frame axis;
* ``decode`` equals the pipeline's decoded frames, ``[B, F, 3, H, W]``, within fp32 rounding (one video per VAE call
  against the pipeline's batched call) and bitwise with the pipeline's batching;
* ``encode_videos`` equals the family's own VAE encoding in diffusers, and ``encode_images`` is a one-frame video;
* LoRA on every attention and MLP projection: zero at init, the reference bitwise the base, only LoRA parameters
  trainable, and the save / ``load_lora_weights`` round trip through the pipeline's own loader;
* every SDE kind runs through it with finite log-probs;
* two iterations of the default method train it (first ratio exactly 1) with a LoRA, which exports as a folder and
  merged, and with full fine-tuning (``model.finetune: full``: every transformer weight of every expert moves, the
  text encoders and the VAE do not, the checkpoint's diffusers-format transformers sample the trained velocity). The
  runs are tests/video_training.py's, trained once per session and shared with tests/test_video_distributed.py.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from flowalign.models import load_flow_model, wrap_pipeline
from flowalign.samplers import SDE_KINDS, noise_schedule, rollout

from video_families import VIDEO_FAMILIES, fresh_video_pipeline, tiny_video_pipeline
from video_training import FROZEN_RECORD, history, last_checkpoint, video_runs  # noqa: F401 - the session's runs

PROMPTS = ["a red circle moving to the left", "two blue squares moving up"]


def parity_cases():
    for name, family in VIDEO_FAMILIES.items():
        for size in family.sizes:
            for guidance in family.guidances:
                yield pytest.param(name, size, guidance, id=f"{name}-{size[0]}x{size[1]}-g{guidance:g}")


@pytest.fixture(autouse=True)
def family_context(request):
    name = getattr(request.node, "callspec", None) and request.node.callspec.params.get("name")
    with VIDEO_FAMILIES[name].context() if name else nullcontext():
        yield


def compared_prompts(family):
    return PROMPTS[: family.prompts_per_call]


def pipeline_output(pipe, model, family, *, steps, size, guidance, output_type, seed=0):
    images = {} if family.condition_images is None else {"image": family.condition_images()}
    sized = {} if family.sized_by_image else {"height": size[0], "width": size[1]}
    return pipe(prompt=list(compared_prompts(family)), num_inference_steps=steps, output_type=output_type,
                generator=torch.Generator().manual_seed(seed), **{family.pipeline_frames: family.frames},
                **sized, **family.call(model, guidance), **images).frames


def adapter_latents(model, family, *, steps, size, guidance, seed=0):
    prompts = compared_prompts(family)
    negatives = [""] * len(prompts) if model.uses_cfg(guidance) else None
    generator = torch.Generator().manual_seed(seed)
    if family.start is not None:
        cond, x = family.start(model, prompts, negatives, size, generator)
    else:
        cond = model.encode(prompts, negative_prompts=negatives, **family.images_kwargs(len(prompts)))
        x = model.prepare_noise(len(prompts), size, generator=generator)
    with torch.no_grad():
        return rollout(model.velocity_fn(cond, guidance), x, model.sigmas(steps, size), torch.zeros(steps)).final


def wrap(name, pipe=None, **options):
    family = VIDEO_FAMILIES[name]
    options = {"num_frames": family.frames, **options}
    return wrap_pipeline(pipe if pipe is not None else tiny_video_pipeline(name), **options)


@pytest.mark.parametrize("name,size,guidance", parity_cases())
def test_ode_rollout_through_the_adapter_is_the_pipeline_bitwise(name, size, guidance):
    family, pipe = VIDEO_FAMILIES[name], tiny_video_pipeline(name)
    model = wrap(name)
    assert isinstance(model, family.adapter) and model.modality == "video"
    expected = pipeline_output(pipe, model, family, steps=3, size=size, guidance=guidance, output_type="latent")
    ours = adapter_latents(model, family, steps=3, size=size, guidance=guidance)
    assert tuple(ours.shape) == model.latent_shape(len(compared_prompts(family)), size)
    assert ours.ndim == 5 and ours.shape[2] == model.latent_frames() > 1
    assert torch.equal(family.pipeline_layout(model, ours), expected)


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_decode_is_the_pipeline_frames(name):
    family, pipe = VIDEO_FAMILIES[name], tiny_video_pipeline(name)
    guidance, size = family.guidances[-1], family.sizes[-1]
    count = len(compared_prompts(family))
    frames = pipeline_output(pipe, wrap(name), family, steps=2, size=size, guidance=guidance, output_type="pt", seed=1)
    for vae_batch in (1, count):
        model = wrap(name, vae_batch=vae_batch)
        with torch.no_grad():
            ours = model.decode(adapter_latents(model, family, steps=2, size=size, guidance=guidance, seed=1))
        assert ours.shape == (count, family.frames, 3, *size) and ours.min() >= 0 and ours.max() <= 1
        torch.testing.assert_close(ours, frames, rtol=0, atol=family.decode_atol)


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_encode_videos_is_the_familys_own_vae_encoding(name):
    family, pipe = VIDEO_FAMILIES[name], tiny_video_pipeline(name)
    model = wrap(name)
    size = family.sizes[-1]
    videos = torch.rand(2, family.frames, 3, *size, generator=torch.Generator().manual_seed(2))
    pixels = (2.0 * videos - 1.0).permute(0, 2, 1, 3, 4).to(pipe.vae.dtype)
    with torch.no_grad():
        ours = model.encode_videos(videos, dtype=pipe.vae.dtype)
        theirs = family.vae_encoding(pipe, pixels)
        one_frame = model.encode_images(videos[:, 0], dtype=pipe.vae.dtype)
        first = family.vae_encoding(pipe, pixels[:, :, :1])
    assert tuple(ours.shape) == model.latent_shape(2, size)
    assert torch.equal(ours, theirs)
    assert one_frame.shape[2] == 1 and torch.equal(one_frame, first)


def perturb_lora(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in model.transformer.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


# Module-name parts of attention and MLP modules (Kandinsky 5 spells them out: self_attention, feed_forward).
PROJECTION_PARTS = ("attn", "ff", "mlp", "attention", "feed_forward")


def projections(transformer) -> set[str]:
    """The names of the transformer blocks' linear layers in attention and MLP modules (the LoRA contract's targets:
    every attention and MLP projection)."""
    names = set()
    for module_name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and any(part in module_name for part in PROJECTION_PARTS):
            if "blocks." in module_name and "lora_" not in module_name:
                names.add(module_name)
    return names


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_lora_on_every_projection_round_trips_through_the_pipeline_loader(name, tmp_path):
    family = VIDEO_FAMILIES[name]
    model = wrap(name, fresh_video_pipeline(name))
    cond = model.encode(PROMPTS, **family.images_kwargs(len(PROMPTS)))
    x = model.prepare_noise(2, family.sizes[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model.velocity(x, 0.6, cond)
        model.add_lora(rank=4, alpha=8)
        assert torch.equal(model.velocity(x, 0.6, cond), base)
        perturb_lora(model)
        adapted = model.velocity(x, 0.6, cond)
        with model.reference():
            reference = model.velocity(x, 0.6, cond)
        after = model.velocity(x, 0.6, cond)
    assert not torch.allclose(adapted, base)
    assert torch.equal(reference, base) and torch.equal(after, adapted)
    targeted = {n.split(".lora_")[0] for n, _ in model.transformer.named_parameters() if "lora_A" in n}
    wanted = {n.replace(".base_layer", "") for n in projections(model.transformer)} - {""}
    assert wanted and wanted <= targeted, sorted(wanted - targeted)
    model.freeze_base()
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if not family.lora_loader:
        return
    saved = model.save_lora(tmp_path / "lora")
    fresh = fresh_video_pipeline(name)
    family.load_lora(fresh, saved)
    with torch.no_grad():
        loaded = wrap(name, fresh).velocity(x, 0.6, cond)
    torch.testing.assert_close(loaded, adapted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_every_sde_kind_runs_through_the_adapter_with_finite_log_probs(name):
    family = VIDEO_FAMILIES[name]
    model = wrap(name)
    size = family.sizes[0]
    cond = model.encode(PROMPTS, **family.images_kwargs(len(PROMPTS)))
    x = model.prepare_noise(2, size, generator=torch.Generator().manual_seed(0))
    for kind in SDE_KINDS:
        with torch.no_grad():
            out = rollout(model.velocity_fn(cond), x, model.sigmas(3, size), noise_schedule(0.7).levels(3), kind=kind,
                          generator=torch.Generator().manual_seed(1))
        assert out.transitions.stochastic.any(), kind
        assert torch.isfinite(out.transitions.log_prob).all() and torch.isfinite(out.final).all(), kind


def test_a_video_family_refuses_frame_counts_its_vae_cannot_take():
    with pytest.raises(ValueError, match=r"sampling.num_frames=6.*4k\+1: use 5 or 9"):
        wrap("wan", num_frames=6)
    model = wrap("wan")
    with pytest.raises(ValueError, match="rank 5"):
        model.encode_videos(torch.rand(5, 3, 16, 16))
    with pytest.raises(ValueError, match="4k\\+1"):
        model.encode_videos(torch.rand(1, 4, 3, 16, 16))


def test_every_registered_video_family_is_under_the_contract():
    from flowalign.models import MODEL_FAMILIES

    video = {MODEL_FAMILIES.get(name) for name in MODEL_FAMILIES if MODEL_FAMILIES.get(name).modality == "video"}
    assert video and video <= {family.adapter for family in VIDEO_FAMILIES.values()}


def probe(model, family):
    """The two prompts' condition and a fixed noise at the family's first size: where exported velocities are read."""
    cond = model.encode(PROMPTS, **family.images_kwargs(len(PROMPTS)))
    return cond, model.prepare_noise(2, family.sizes[0], generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_the_default_method_trains_on_the_family_and_exports(name, video_runs, tmp_path):
    """Two iterations of the default method from the saved directory (first ratio exactly 1; an image-to-video family
    on prompts with a first frame); the checkpoint exports as a LoRA folder (read by the pipeline's own loader, or the
    transformer's where the pipeline has none) and merged (plain ``from_pretrained``), both sampling the LoRA model's
    velocity."""
    import diffusers

    from flowalign.export import export_lora
    from flowalign.lora_loading import apply_lora, resolve_lora

    family = VIDEO_FAMILIES[name]
    directory = video_runs.pipeline(name)
    assert isinstance(load_flow_model(directory), family.adapter)
    run = video_runs.run(name, "lora")
    metrics = history(run)
    assert len(metrics) == 2 and metrics[0]["first_ratio_max"] == 1.0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in metrics)

    checkpoint = last_checkpoint(run)
    trained = load_flow_model(directory, adapter_options={"num_frames": family.frames})
    apply_lora(trained, resolve_lora(checkpoint, "last"))
    cond, x = probe(trained, family)
    with torch.no_grad():
        expected = trained.velocity(x, 0.6, cond)
    folder = export_lora(checkpoint, tmp_path / "lora", weights="last")
    merged = export_lora(checkpoint, tmp_path / "merged", weights="last", merge=True)
    pipeline_class = getattr(diffusers, family.adapter.pipeline_class_name)
    plain = pipeline_class.from_pretrained(directory)
    if family.lora_loader:
        family.load_lora(plain, folder)
    else:  # no LoRA loader on the pipeline: the folder is the transformer's own adapter format (FlowModel.save_lora)
        plain.transformer.load_lora_adapter(str(folder), prefix=None, use_safetensors=True)
    for pipe in (plain, pipeline_class.from_pretrained(merged)):
        with torch.no_grad():
            velocity = wrap(name, pipe).velocity(x, 0.6, cond)
        torch.testing.assert_close(velocity, expected, rtol=1e-5, atol=1e-6)


def transformer_components(directory) -> list[str]:
    """The pipeline's transformer components: ``transformer``, and ``transformer_2`` for Wan2.2 A14B's second
    expert."""
    index = json.loads((Path(directory) / "model_index.json").read_text())
    return sorted(name for name, value in index.items() if name.startswith("transformer") and value[0] is not None)


def component_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_full_fine_tuning_trains_every_transformer_weight_and_exports(name, video_runs):
    """``model.finetune: full``: the frozen reference copy is the base bit for bit, and so are the trained weights at
    the start (Mochi: within rounding, below). Two iterations from the saved directory: every first ratio exactly 1;
    every weight of the transformer (both experts of Wan2.2 A14B) trains and moves; the text encoders, image encoders
    and the VAE stay bitwise; the checkpoint exports the trained transformer(s) in diffusers' format
    (``transformer/``, ``transformer_2/``), which the plain pipeline loads in place of the base's and which sample the
    trained weights' velocity bit for bit."""
    import diffusers

    from safetensors.torch import load_file

    family = VIDEO_FAMILIES[name]
    model = wrap(name, fresh_video_pipeline(name))
    cond, x = probe(model, family)
    with torch.no_grad():
        base = model.velocity(x, 0.6, cond)
        model.make_full_finetune()
        policy = model.velocity(x, 0.6, cond)
        with model.reference():
            reference = model.velocity(x, 0.6, cond)
    assert torch.equal(reference, base)
    # Mochi's trained weights sample within rounding of its frozen reference, not bitwise: torch computes its
    # attention-output projection (a non-contiguous input) by another kernel when the weights require grad
    # (flowalign.models.mochi freezes the transformer it wraps for the same reason); measured: 2.4e-7 at most, an ulp
    # of the velocity's largest elements. The ratio is unaffected (the rollout and the training forward both run the
    # trained weights); a KL to the reference starts at rounding, not at 0.
    if name == "mochi":
        torch.testing.assert_close(policy, base, rtol=0, atol=1e-6)
    else:
        assert torch.equal(policy, base)

    directory = video_runs.pipeline(name)
    run = video_runs.run(name, "full")
    metrics = history(run)
    assert len(metrics) == 2 and all(h["first_ratio_max"] == 1.0 for h in metrics)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in metrics)
    frozen = json.loads((run / FROZEN_RECORD).read_text())
    assert {"vae", "text_encoder"} <= set(frozen) and all(frozen.values()), frozen

    checkpoint = last_checkpoint(run)
    components = transformer_components(directory)
    assert not (checkpoint / "lora").exists()
    assert sorted(p.name for p in checkpoint.glob("transformer*")) == components
    assert ("transformer_2" in components) == (name in ("wan22", "wan22_i2v"))
    for component in components:
        before, after = component_weights(directory / component), component_weights(checkpoint / component)
        assert after.keys() == before.keys()
        assert any(not torch.equal(after[k], before[k]) for k in before), f"{component} did not move"

    trained = load_flow_model(directory, adapter_options={"num_frames": family.frames})
    weights = load_file(str(checkpoint / "trainable.safetensors"))  # the run's last fp32 weights, as it resumes
    assert weights.keys() == dict(trained.transformer.named_parameters()).keys()  # every weight of every expert
    trained.transformer.load_state_dict(weights)
    cond, x = probe(trained, family)
    pipeline_class = getattr(diffusers, family.adapter.pipeline_class_name)
    exported = {component: getattr(diffusers, json.loads((checkpoint / component / "config.json").read_text())[
        "_class_name"]).from_pretrained(checkpoint / component) for component in components}
    pipe = pipeline_class.from_pretrained(directory, **exported)
    with torch.no_grad():
        for sigma in (0.95, 0.6, 0.3):  # Wan2.2 A14B: both experts (the tiny boundaries are 0.875 and 0.9)
            assert torch.equal(wrap(name, pipe).velocity(x, sigma, cond), trained.velocity(x, sigma, cond)), sigma
