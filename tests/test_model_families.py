"""The adapter contract, for every model family in tests/model_families.py.

* an ODE rollout through the adapter equals the pipeline's own ``output_type="latent"`` result bit for bit (same
  seed and steps; with and without the family's guidance; a square and a non-square size);
* ``decode`` equals the pipeline's decoded images;
* LoRA on the family's default targets: zero at init, the reference (adapter disabled) bitwise the base, only LoRA
  parameters trainable, and the save / ``load_lora_weights`` round trip through the pipeline's own loader;
* ``encode_images`` equals the family's own VAE encoding in diffusers (an img2img or editing pipeline's
  ``_encode_vae_image`` run on the family's VAE, or the inverse of the pipeline's decode where no such pipeline exists);
* every SDE kind runs through it with finite log-probs, and the default method and a tree preset (BranchGRPO) each
  train 2 iterations on it from a saved directory (``load_flow_model``) with the first ratio exactly 1.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from flowalign.models import load_flow_model, wrap_pipeline
from flowalign.samplers import SDE_KINDS, noise_schedule, rollout

from golden_runs import preset_path, small_run_values
from model_families import FAMILIES, fresh_pipeline, tiny_pipeline

PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def parity_cases():
    for name, family in FAMILIES.items():
        for size in family.sizes:
            for guidance in family.guidances:
                yield pytest.param(name, size, guidance, id=f"{name}-{size[0]}x{size[1]}-g{guidance:g}")


@pytest.fixture(autouse=True)
def family_context(request):
    """The family's ``context`` around each of its tests."""
    name = getattr(request.node, "callspec", None) and request.node.callspec.params.get("name")
    with FAMILIES[name].context() if name else nullcontext():
        yield


def compared_prompts(family):
    return PROMPTS[: family.prompts_per_call]


def pipeline_output(pipe, model, family, *, steps, size, guidance, output_type, seed=0):
    # A copy of the prompts: ZImagePipeline writes its chat-templated text back into the list it is given.
    images = {} if family.condition_images is None else {"image": family.condition_images()}
    return pipe(prompt=list(compared_prompts(family)), num_inference_steps=steps, output_type=output_type,
                generator=torch.Generator().manual_seed(seed), height=size[0], width=size[1],
                **family.call(model, guidance), **family.size_call(size), **images).images


def adapter_latents(model, family, *, steps, size, guidance, seed=0):
    prompts = compared_prompts(family)
    negatives = [""] * len(prompts) if model.uses_cfg(guidance) else None
    cond = model.encode(prompts, negative_prompts=negatives, **family.images_kwargs(len(prompts)))
    x = model.prepare_noise(len(prompts), size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return rollout(model.velocity_fn(cond, guidance), x, model.sigmas(steps, size), torch.zeros(steps)).final


@pytest.mark.parametrize("name,size,guidance", parity_cases())
def test_ode_rollout_through_the_adapter_is_the_pipeline_bitwise(name, size, guidance):
    family, pipe = FAMILIES[name], tiny_pipeline(name)
    model = wrap_pipeline(pipe)
    assert isinstance(model, family.adapter)
    expected = pipeline_output(pipe, model, family, steps=3, size=size, guidance=guidance, output_type="latent")
    ours = adapter_latents(model, family, steps=3, size=size, guidance=guidance)
    assert tuple(ours.shape) == model.latent_shape(len(compared_prompts(family)), size)
    assert torch.equal(family.pipeline_layout(model, ours), expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_decode_is_the_pipeline_images(name):
    family, pipe = FAMILIES[name], tiny_pipeline(name)
    model = wrap_pipeline(pipe)
    guidance = family.guidances[-1]
    size = family.sizes[-1]
    images = pipeline_output(pipe, model, family, steps=2, size=size, guidance=guidance, output_type="pt", seed=1)
    with torch.no_grad():
        ours = model.decode(adapter_latents(model, family, steps=2, size=size, guidance=guidance, seed=1))
    assert ours.shape == (len(compared_prompts(family)), 3, *size) and ours.min() >= 0 and ours.max() <= 1
    torch.testing.assert_close(ours, images, rtol=0, atol=1e-6)


def _own_vae_encoding(pipeline_class, module):
    """``<pipeline_class>._encode_vae_image`` from diffusers, run on this family's pipeline (it reads only ``vae``)."""
    def encode(pipe, pixels, generator):
        cls = getattr(__import__(f"diffusers.pipelines.{module}", fromlist=[pipeline_class]), pipeline_class)
        return cls._encode_vae_image(pipe, pixels, generator)
    return encode


def _scaled_posterior(pipe, pixels, generator):
    """The inverse of a decode ``vae.decode(latents / scaling_factor)`` (CogView4): a posterior draw times the
    scaling factor, with the pipelines' ``retrieve_latents``."""
    from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

    return retrieve_latents(pipe.vae.encode(pixels), generator) * pipe.vae.config.scaling_factor


def _dc_ae(pipe, pixels, generator):
    """``SanaControlNetPipeline``'s encoding of its control image: ``vae.encode(x).latent * scaling_factor``."""
    return pipe.vae.encode(pixels).latent * pipe.vae.config.scaling_factor


def _video_vae(pipe, pixels, generator):
    """``QwenImageImg2ImgPipeline._encode_vae_image`` on a one-frame video, the frame axis dropped again."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import QwenImageImg2ImgPipeline

    return QwenImageImg2ImgPipeline._encode_vae_image(pipe, pixels.unsqueeze(2), generator)[:, :, 0]


# Per family: diffusers' own encoding of images into the latents the family's transformer reads, and whether it draws
# from the posterior (``retrieve_latents``' default) or takes its mean (``sample_mode="argmax"``). Z-Image's img2img
# pipeline inlines FLUX img2img's formula; Lumina2 and HiDream have no img2img pipeline, and the same formula is the
# inverse of their decode (``latents / scaling_factor + shift_factor``).
FLUX_IMG2IMG = _own_vae_encoding("FluxImg2ImgPipeline", "flux.pipeline_flux_img2img")
FLUX2 = _own_vae_encoding("Flux2Pipeline", "flux2.pipeline_flux2")
VAE_ENCODING = {
    "sd3": (_own_vae_encoding("StableDiffusion3InpaintPipeline", "stable_diffusion_3.pipeline_stable_diffusion_3_inpaint"),
            True),
    "flux": (FLUX_IMG2IMG, True), "flux_true_cfg": (FLUX_IMG2IMG, True),
    "flux_kontext": (_own_vae_encoding("FluxKontextPipeline", "flux.pipeline_flux_kontext"), False),
    "chroma": (_own_vae_encoding("ChromaImg2ImgPipeline", "chroma.pipeline_chroma_img2img"), True),
    "flux2": (FLUX2, False), "flux2_klein": (FLUX2, False),
    "qwen_image": (_video_vae, True), "qwen_image_edit_plus": (_video_vae, True),
    "z_image": (FLUX_IMG2IMG, True), "lumina2": (FLUX_IMG2IMG, True), "hidream": (FLUX_IMG2IMG, True),
    "cogview4": (_scaled_posterior, True), "sana": (_dc_ae, False),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_encode_images_is_the_familys_own_vae_encoding(name):
    family, pipe = FAMILIES[name], tiny_pipeline(name)
    model = wrap_pipeline(pipe)
    reference, draws = VAE_ENCODING[name]
    size = model.image_size_for(family.sizes[-1]) if hasattr(model, "image_size_for") else family.sizes[-1]
    images = torch.rand(2, 3, *size, generator=torch.Generator().manual_seed(2))
    pixels = (2.0 * images - 1.0).to(pipe.vae.dtype)
    with torch.no_grad():
        ours = model.encode_images(images, sample=draws, generator=torch.Generator().manual_seed(3),
                                   dtype=pipe.vae.dtype)
        theirs = reference(pipe, pixels, torch.Generator().manual_seed(3))
    assert tuple(ours.shape) == model.latent_shape(2, size)
    assert torch.equal(ours, theirs)


def perturb_lora(model, seed=0):
    """Non-zero LoRA B matrices, so the adapter changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in model.transformer.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_reference_is_the_base_and_round_trips_through_the_pipeline_loader(name, tmp_path):
    family = FAMILIES[name]
    model = wrap_pipeline(fresh_pipeline(name))
    cond = model.encode(PROMPTS, **family.images_kwargs(len(PROMPTS)))
    x = model.prepare_noise(2, family.sizes[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model.velocity(x, 0.6, cond)
        model.add_lora(rank=4, alpha=8)
        assert torch.equal(model.velocity(x, 0.6, cond), base)  # B = 0 at init
        perturb_lora(model)
        adapted = model.velocity(x, 0.6, cond)
        with model.reference():
            reference = model.velocity(x, 0.6, cond)
        after = model.velocity(x, 0.6, cond)
    assert not torch.allclose(adapted, base)
    assert torch.equal(reference, base) and torch.equal(after, adapted)  # the context restores the adapter
    targeted = {n.split(".lora_")[0] for n, _ in model.transformer.named_parameters() if "lora_A" in n}
    assert targeted and all(any(t.endswith(target) for target in model.lora_targets) for t in targeted)

    model.freeze_base()
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if not family.lora_loader:
        return
    saved = model.save_lora(tmp_path / "lora")
    fresh = fresh_pipeline(name)
    fresh.load_lora_weights(saved)
    with torch.no_grad():
        loaded = wrap_pipeline(fresh).velocity(x, 0.6, cond)
    torch.testing.assert_close(loaded, adapted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_sde_kind_runs_through_the_adapter_with_finite_log_probs(name):
    model = wrap_pipeline(tiny_pipeline(name))
    size = FAMILIES[name].sizes[0]
    cond = model.encode(PROMPTS, **FAMILIES[name].images_kwargs(len(PROMPTS)))
    x = model.prepare_noise(2, size, generator=torch.Generator().manual_seed(0))
    for kind in SDE_KINDS:
        with torch.no_grad():
            out = rollout(model.velocity_fn(cond), x, model.sigmas(3, size), noise_schedule(0.7).levels(3), kind=kind,
                          generator=torch.Generator().manual_seed(1))
        assert out.transitions.stochastic.any(), kind
        assert torch.isfinite(out.transitions.log_prob).all() and torch.isfinite(out.final).all(), kind


@pytest.fixture(scope="module")
def saved_pipelines(tmp_path_factory):
    """Each family's tiny pipeline saved once, loaded back by ``load_flow_model`` as a user's directory is."""
    root = tmp_path_factory.mktemp("families")
    saved = {}

    def path(name):
        if name not in saved:
            tiny_pipeline(name).save_pretrained(root / name)
            saved[name] = root / name
        return saved[name]

    return path


@pytest.mark.parametrize("name", FAMILIES)
def test_the_default_method_trains_on_the_family_from_its_directory(name, saved_pipelines, tmp_path):
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    directory = saved_pipelines(name)
    assert isinstance(load_flow_model(directory), FAMILIES[name].adapter)
    size = FAMILIES[name].sizes[0][0]
    values = {**small_run_values(directory, tmp_path / "run"), "sampling.image_size": size,
              "train.checkpoint_every": 0}
    config = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    history = Trainer(config).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tree_preset_trains_on_the_family(name, saved_pipelines, tmp_path):
    """BranchGRPO's tree rollout and credit (4 leaves per prompt: splits at steps 0 and 1, branching 2)."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    values = {**small_run_values(saved_pipelines(name), tmp_path / "run"), "sampling.image_size": FAMILIES[name].sizes[0][0],
              "train.checkpoint_every": 0, "data.group_size": 4, "sampling.batch_size": 4,
              "rollout.split_steps": "[0, 1]", "sampling.num_steps": 4}
    config = load_config(TrainConfig, preset_path("branch_grpo"), [f"{k}={v}" for k, v in values.items()])
    history = Trainer(config).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


def test_every_registered_image_family_is_under_the_contract():
    """Every registered image adapter has a contract row here (the guide's families tables are generated from the
    registry: tests/test_docs_generated.py keeps them fresh)."""
    from flowalign.models import MODEL_FAMILIES

    image = {MODEL_FAMILIES.get(name) for name in MODEL_FAMILIES if MODEL_FAMILIES.get(name).modality == "image"}
    assert image <= {family.adapter for family in FAMILIES.values()}
    assert set(VAE_ENCODING) == set(FAMILIES)
