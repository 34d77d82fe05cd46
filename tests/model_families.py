"""The model families the adapter contract (tests/test_model_families.py) runs over, each with its tiny pipeline.

A ``Family`` says how to build the family's tiny in-process pipeline, how to call that pipeline so that it samples what
an ODE rollout through the adapter samples (its guidance arguments), and how to lay the adapter's unpacked latents
out as the pipeline's ``output_type="latent"`` result. Adding a family to flowalign means adding a row here: the
contract then checks it bit for bit against its pipeline, its LoRA round trip, and that it trains.

Pipelines are built once per test session (``tiny_pipeline``); tests that change a pipeline (LoRA) build their own.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from flowalign.models import (ChromaModel, CogView4Model, Flux2DevModel, Flux2KleinModel, FluxKontextModel, FluxModel,
                              HiDreamModel, Lumina2Model, QwenImageEditPlusModel, QwenImageModel, SanaModel, SD3Model,
                              ZImageModel, pack_latents)
from flowalign.models.flux2 import pack_flux2_latents
from flowalign.models.tiny import (tiny_chroma_pipeline, tiny_cogview4_pipeline, tiny_flux2_klein_pipeline,
                                   tiny_flux2_pipeline, tiny_flux_kontext_pipeline, tiny_flux_pipeline,
                                   tiny_hidream_pipeline, tiny_lumina2_pipeline, tiny_qwen_image_edit_plus_pipeline,
                                   tiny_qwen_image_pipeline, tiny_sana_pipeline, tiny_sd3_pipeline,
                                   tiny_z_image_pipeline)

WORDS = ("a photo of an the red green blue yellow purple white circle square triangle circles squares triangles and "
         "two three four left right above below").split()


def _cfg_kwargs(model, guidance: float) -> dict:
    """``guidance_scale`` as the pipeline's CFG scale (its negative prompt defaults to the empty prompt)."""
    return {"guidance_scale": guidance, "max_sequence_length": model.max_sequence_length}


def _true_cfg_kwargs(model, guidance: float) -> dict:
    """``guidance`` as true CFG (``true_cfg_scale``, two passes) against empty negative prompts."""
    negatives = {"negative_prompt": [""] * 2} if guidance > 1 else {}
    return {"true_cfg_scale": guidance, "max_sequence_length": model.max_sequence_length, **negatives}


def _sana_kwargs(model, guidance: float) -> dict:
    """SANA's CFG scale, with the adapter's (empty) complex human instruction and no resolution binning."""
    return {**_cfg_kwargs(model, guidance), "complex_human_instruction": model.complex_human_instruction,
            "use_resolution_binning": False}


def _cfg_negatives_kwargs(model, guidance: float) -> dict:
    """CFG against empty negative prompts given one per prompt: the pipeline's default encodes a single empty prompt
    and repeats it, and its CLIP encoders round a batch of one differently from a batch of two."""
    return {**_cfg_kwargs(model, guidance), **({"negative_prompt": [""] * 2} if guidance > 1 else {})}


def _z_image_kwargs(model, guidance: float) -> dict:
    """ZImagePipeline's ``guidance_scale`` g means ``cond + g (cond - uncond)`` (CFG on for g > 0): flowalign's
    s - 1."""
    return {"guidance_scale": guidance - 1.0, "max_sequence_length": model.max_sequence_length}


def _klein_kwargs(model, guidance: float) -> dict:
    """CFG against the empty prompt; the encoder layers the adapter reads (fitted to the tiny encoder's depth)."""
    return {"guidance_scale": guidance, "max_sequence_length": model.max_sequence_length,
            "text_encoder_out_layers": model.text_encoder_out_layers}


def _edit_true_cfg_kwargs(model, guidance: float) -> dict:
    """True CFG against the empty negative prompt, for a pipeline that takes one prompt per call."""
    return {"true_cfg_scale": guidance, **({"negative_prompt": ""} if guidance > 1 else {})}


def edit_condition_images() -> list:
    """Two fixed condition images, non-square and of other sizes than the generated images: 48x32 and 32x40."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(0)
    return [Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((48, 32), (32, 40))]


# The tiny Qwen-Image-Edit-Plus pipeline's condition-image areas: the pipeline resizes every condition image to these
# module constants (384^2 for the VL encoder, 1024^2 for the VAE), too large for a tiny model on a CPU.
EDIT_PLUS_AREAS = {"CONDITION_IMAGE_SIZE": 32 * 32, "VAE_IMAGE_SIZE": 32 * 48}


@contextmanager
def edit_plus_areas(areas: dict = EDIT_PLUS_AREAS):
    """``pipeline_qwenimage_edit_plus``'s condition-image areas set to ``areas`` (the pipeline and the adapter both
    read them), restored on exit."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    saved = {name: getattr(plus, name) for name in areas}
    for name, value in areas.items():
        setattr(plus, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(plus, name, value)


@dataclass(frozen=True)
class Family:
    """A model family under the adapter contract.

    ``build(words, seed=0)`` returns the tiny pipeline; ``guidances`` are the guidance scales the parity test runs
    (1: none; above 1 the family's CFG or guidance embedding); ``call(model, guidance)`` gives the pipeline's keyword
    arguments for that guidance; ``size_call(size)`` its keyword arguments for an image size ``(height, width)`` beyond
    ``height``/``width`` (a pipeline that rescales every request must be told to keep it); ``pipeline_layout(model,
    latents)`` turns the adapter's ``[B, C, h, w]`` latents into the pipeline's latent output; ``lora_loader``: the
    pipeline class has ``load_lora_weights``.

    For a pipeline that cannot run without condition images: ``condition_images()`` gives the images every prompt of
    the contract is given (the pipeline's ``image=``, the adapter's ``encode(images=)``); ``prompts_per_call``: the
    pipeline takes at most that many prompts per call, so the pipeline comparisons run on the first ones;
    ``context()`` is entered around each of the family's contract tests (module constants the tiny model needs).
    """

    adapter: type
    build: Callable
    guidances: tuple[float, ...] = (1.0, 3.0)
    call: Callable = _cfg_kwargs
    pipeline_layout: Callable = staticmethod(lambda model, latents: latents)
    sizes: tuple[tuple[int, int], ...] = ((32, 32), (32, 48))
    lora_loader: bool = True
    build_kwargs: dict = field(default_factory=dict)
    size_call: Callable = staticmethod(lambda size: {})
    condition_images: Callable | None = None
    prompts_per_call: int | None = None
    context: Callable = nullcontext

    def images_kwargs(self, count: int) -> dict:
        """``encode``'s ``images=`` for ``count`` prompts (nothing for a family without contract images)."""
        return {} if self.condition_images is None else {"images": [self.condition_images()] * count}


FAMILIES: dict[str, Family] = {
    "sd3": Family(SD3Model, tiny_sd3_pipeline),
    # FLUX.1-dev's guidance is an embedding: one pass per step at any scale.
    "flux": Family(FluxModel, tiny_flux_pipeline, guidances=(1.0, 3.5),
                   pipeline_layout=lambda model, latents: pack_latents(latents), sizes=((32, 32), (32, 64))),
    # FLUX without a guidance embedding (as FLUX.1-schnell): a scale above 1 is true CFG with negative prompts.
    "flux_true_cfg": Family(FluxModel, tiny_flux_pipeline, call=_true_cfg_kwargs,
                            pipeline_layout=lambda model, latents: pack_latents(latents), sizes=((32, 32), (32, 64)),
                            build_kwargs={"guidance_embeds": False}),
    # FLUX.1-Kontext without a condition image is FLUX (guidance embedding); it rescales every request to max_area
    # (1024^2 by default), so it is told the requested area. With condition images: tests/test_model_flux_kontext.py.
    "flux_kontext": Family(FluxKontextModel, tiny_flux_kontext_pipeline, guidances=(1.0, 3.5),
                           pipeline_layout=lambda model, latents: pack_latents(latents), sizes=((32, 32), (32, 64)),
                           size_call=lambda size: {"max_area": size[0] * size[1]}),
    # Chroma: FLUX's packing, T5 only, masked text; its guidance_scale is true CFG against negative prompts.
    "chroma": Family(ChromaModel, tiny_chroma_pipeline,
                     pipeline_layout=lambda model, latents: pack_latents(latents), sizes=((32, 32), (32, 64))),
    # SANA: unpacked latents, Gemma2 text with its mask, a DC-AE; called without the complex human instruction and
    # without resolution binning (the adapter samples the requested size).
    "sana": Family(SanaModel, tiny_sana_pipeline, call=_sana_kwargs, sizes=((32, 32), (32, 64))),
    # Lumina2: flipped time and a negated velocity; CFG with the pipeline's default normalisation, at every step.
    "lumina2": Family(Lumina2Model, tiny_lumina2_pipeline, sizes=((32, 32), (32, 48))),
    # CogView4: GLM text, the transformer on the unshifted integer timestep, CFG in two passes.
    "cogview4": Family(CogView4Model, tiny_cogview4_pipeline),
    # HiDream rescales every request to its fixed area (32x32 px on the tiny model): both sizes keep that area.
    "hidream": Family(HiDreamModel, tiny_hidream_pipeline, call=_cfg_negatives_kwargs, sizes=((32, 32), (16, 64))),
    # FLUX.2-dev: guidance embedding only (one pass at any scale); the pipeline's latents are packed tokens.
    "flux2": Family(Flux2DevModel, tiny_flux2_pipeline, guidances=(1.0, 4.0),
                    pipeline_layout=lambda model, latents: pack_flux2_latents(latents), sizes=((32, 32), (32, 48))),
    # Qwen-Image: true CFG (with its norm rescaling) against negative prompts; the pipeline's latents are packed.
    "qwen_image": Family(QwenImageModel, tiny_qwen_image_pipeline, guidances=(1.0, 4.0), call=_true_cfg_kwargs,
                         pipeline_layout=lambda model, latents: pack_latents(latents), sizes=((32, 32), (32, 48))),
    # Z-Image: flipped model time, negated velocity, CFG in its own form; its latents come back unpacked.
    "z_image": Family(ZImageModel, tiny_z_image_pipeline, guidances=(1.0, 4.0), call=_z_image_kwargs),
    # FLUX.2-Klein: its latent output is the VAE's space (batch-norm statistics undone, 2x2 patches unfolded).
    "flux2_klein": Family(Flux2KleinModel, tiny_flux2_klein_pipeline, guidances=(1.0, 4.0), call=_klein_kwargs,
                          pipeline_layout=lambda model, latents: model.to_vae_latents(latents)),
    # Qwen-Image-Edit-Plus: QwenImageEditPlusPipeline needs a condition image and takes one prompt per call; the
    # contract gives every prompt two (non-square, of other sizes than the output) at the tiny model's areas.
    "qwen_image_edit_plus": Family(QwenImageEditPlusModel, tiny_qwen_image_edit_plus_pipeline, guidances=(1.0, 4.0),
                                   call=_edit_true_cfg_kwargs, sizes=((32, 32), (32, 48)),
                                   pipeline_layout=lambda model, latents: pack_latents(latents),
                                   condition_images=edit_condition_images, prompts_per_call=1,
                                   context=edit_plus_areas),
}


@lru_cache(maxsize=None)
def tiny_pipeline(name: str):
    """The family's tiny pipeline, built once per test session (do not change it: build your own for that)."""
    family = FAMILIES[name]
    return family.build(WORDS, seed=0, **family.build_kwargs)


def fresh_pipeline(name: str):
    """A new tiny pipeline of the family, equal to ``tiny_pipeline(name)``, for tests that change it."""
    family = FAMILIES[name]
    return family.build(WORDS, seed=0, **family.build_kwargs)
