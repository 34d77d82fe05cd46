"""The FlowModel interface: one small surface over diffusers' flow-matching pipelines.

Everything above this layer (rollouts, rewards, the trainer) sees only:

* ``encode(prompts, negative_prompts=None, images=None) -> Cond``; ``images``: each prompt's condition images, for
  the editing families (``takes_condition_images``; ``condition_images`` checks them, and refuses them elsewhere)
* ``velocity(x, sigma, cond, guidance_scale=1.0) -> v`` with ``x`` in the unpacked latent layout ``[B, C, h, w]``
* ``decode(latents) -> images in [0, 1]``, ``[B, 3, H, W]``, and its inverse ``encode_images(images) -> latents``
* ``sigmas(num_steps, image_size)`` from the pipeline's own scheduler rules (shift, resolution-dependent ``mu``)
* ``latent_shape`` / ``prepare_noise`` helpers drawing noise exactly as the pipeline does
* ``transformer``: the trainable module, with LoRA and the reference model (``reference()``: adapter disabled)

An ODE rollout through an adapter reproduces the pipeline's own ``output_type="latent"`` result for the same seed
(tests/test_models.py): that equality is what keeps the adapters honest.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from flowalign.registry import Registry
from flowalign.models.placement import Placement

logger = logging.getLogger(__name__)


# Model families by name: an adapter registers itself (``@register_model_family("sd3")``) with its diffusers
# ``pipeline_class_name``; ``load_flow_model`` picks it from a model's ``model_index.json``.
MODEL_FAMILIES: Registry = Registry("model family", plural="model families")


def register_model_family(name: str):
    """Class decorator registering a ``FlowModel`` adapter as model family ``name``."""

    def register(adapter: type) -> type:
        if not getattr(adapter, "pipeline_class_name", ""):
            raise TypeError(f"model family {name!r}: {adapter.__name__} must set pipeline_class_name")
        MODEL_FAMILIES.register(name, adapter)
        return adapter

    return register


@dataclass
class Cond:
    """Text (and condition-image) conditioning for a batch of prompts, in whatever form the family's transformer takes.

    ``embeds`` ``[B, L, D]`` are the token embeddings; ``pooled`` ``[B, P]`` the pooled projection of the families that
    have one (SD3, FLUX), else None; ``mask`` ``[B, L]`` the attention mask of the families that pass one (SANA,
    Chroma, Qwen-Image, ...), else None; the ``negative_`` fields are the same for the negative prompts of
    classifier-free guidance. ``extras`` holds further per-row tensors a family needs (condition-image latents of an
    editing model, for example): every batched operation indexes them with the rows. ``text_ids`` (FLUX) and
    ``shared`` hold what the whole batch shares: they are passed along unchanged.
    """

    embeds: Tensor
    pooled: Tensor | None = None
    negative_embeds: Tensor | None = None
    negative_pooled: Tensor | None = None
    text_ids: Tensor | None = None
    mask: Tensor | None = None
    negative_mask: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)

    BATCHED = ("embeds", "pooled", "negative_embeds", "negative_pooled", "mask", "negative_mask")

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def has_negative(self) -> bool:
        return self.negative_embeds is not None

    def _map(self, fn) -> "Cond":
        batched = {name: fn(getattr(self, name)) for name in self.BATCHED if getattr(self, name) is not None}
        return replace(self, **batched, extras={key: fn(value) for key, value in self.extras.items()})

    def index(self, index: Tensor | Sequence[int] | slice) -> "Cond":
        """Rows of the batch, e.g. ``cond.index(transitions.prompt_id)``."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, device=self.embeds.device)
        return self._map(lambda t: t[index])

    def repeat_interleave(self, repeats: int) -> "Cond":
        """Each prompt ``repeats`` times in a row: the layout of a GRPO group."""
        return self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def to(self, device: torch.device | str) -> "Cond":
        moved = self._map(lambda t: t.to(device))
        shared = {key: value.to(device) if isinstance(value, Tensor) else value for key, value in self.shared.items()}
        return replace(moved, text_ids=None if self.text_ids is None else self.text_ids.to(device), shared=shared)

    def sentence_embedding(self) -> Tensor:
        """One vector per prompt, ``[B, D]``: the pooled projection where the family has one, else the mean of the
        token embeddings over the attention mask (over all tokens without a mask)."""
        if self.pooled is not None:
            return self.pooled
        if self.mask is None:
            return self.embeds.mean(dim=1)
        weights = self.mask.to(self.embeds.dtype).unsqueeze(-1)
        return (self.embeds * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1)


def _check_condition_image(image: Any, prompt: int) -> None:
    """A clear ValueError unless ``image`` is a PIL image or a float tensor ``[3, H, W]`` in [0, 1]."""
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"prompt {prompt}'s condition image is a tensor of shape {tuple(image.shape)}: give one "
                             "image [3, H, W] (RGB, channels first) per entry")
        if not image.is_floating_point():
            raise ValueError(f"prompt {prompt}'s condition image has dtype {image.dtype}: give floats in [0, 1] "
                             "(for uint8 pixels pass image.float() / 255)")
        low, high = float(image.min()), float(image.max())
        if not (low >= 0 and high <= 1):
            raise ValueError(f"prompt {prompt}'s condition image has values in [{low:g}, {high:g}]: give floats in "
                             "[0, 1]")
        return
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - PIL ships with diffusers
        Image = None
    if Image is None or not isinstance(image, Image.Image):
        raise ValueError(f"prompt {prompt}'s condition image is a {type(image).__name__}: give a PIL image or a "
                         "tensor [3, H, W] in [0, 1]")


def as_image_size(image_size: int | Sequence[int] | None, default: tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` from an int, a pair, or None (the pipeline's default)."""
    if image_size is None:
        return default
    if isinstance(image_size, int):
        return image_size, image_size
    height, width = image_size
    return int(height), int(width)


_UNCONDITIONAL_GRADIENT: contextvars.ContextVar[bool] = contextvars.ContextVar("unconditional_gradient", default=True)


def guided(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance, ``uncond + scale * (cond - uncond)``, in the order the pipelines compute it.

    Inside ``unconditional_detached()`` the unconditional prediction is a constant (``uncond.detach()``): the guided
    velocity's gradient then reaches the weights through the conditional branch only, ``scale * d cond``, instead of
    ``(1 - scale) d uncond + scale d cond``. Its value is the same either way."""
    if not _UNCONDITIONAL_GRADIENT.get():
        uncond = uncond.detach()
    return uncond + scale * (cond - uncond)


@contextlib.contextmanager
def unconditional_detached(detached: bool = True) -> Iterator[None]:
    """A context in which every family's CFG (``guided``) detaches the unconditional prediction (when ``detached``;
    else a no-op): ``sampling.cfg_gradient: conditional`` in training."""
    token = _UNCONDITIONAL_GRADIENT.set(not detached and _UNCONDITIONAL_GRADIENT.get())
    try:
        yield
    finally:
        _UNCONDITIONAL_GRADIENT.reset(token)


def norm_rescaled(guided: Tensor, reference: Tensor) -> Tensor:
    """``guided`` rescaled to the norm of ``reference`` along the last axis (Qwen-Image's and Lumina2's CFG
    normalisation): ``guided * (|reference| / |guided|)``."""
    return guided * (torch.norm(reference, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))


def require_negative(cond: Cond, guidance_scale: float, why: str = "") -> None:
    """A clear ValueError when CFG at ``guidance_scale`` is asked of a ``cond`` without negative prompt embeddings;
    ``why``: what the scale means for the family (``"on Chroma is true CFG and"``)."""
    if not cond.has_negative:
        raise ValueError(f"guidance_scale={guidance_scale} {why + ' ' if why else ''}needs negative prompt embeddings: "
                         "encode with negative_prompts=[''] * len(prompts), or use guidance_scale=1")


class FlowModel:
    """Base adapter. Subclasses set ``family``, ``pipeline_class``, ``lora_targets`` and the family-specific parts.

    Args:
        pipe: the diffusers pipeline to wrap (``load_flow_model`` or ``wrap_pipeline`` picks the family's class).
        max_sequence_length: the text encoders' token limit; None is the family's default
            (``default_max_sequence_length``).
    """

    family: str = ""
    pipeline_class_name: str = ""
    # "image" (latents [B, C, h, w], decode -> [B, 3, H, W]) or "video" (flowalign.models.video.VideoFlowModel).
    modality: str = "image"
    lora_targets: tuple[str, ...] = ()
    # Editing families condition on source images (``encode(..., images=)``); ``max_condition_images`` per prompt.
    takes_condition_images: bool = False
    max_condition_images: int | None = None
    # The image-to-video families cannot sample without one: prompts without condition images are refused.
    requires_condition_images: bool = False
    # Some trainable weights take no part in the forward (Qwen-Image's last block: its text stream's output is unused,
    # so its to_add_out LoRA gets no gradient): DDP must then look for unused parameters (find_unused_parameters),
    # or it stops at the next iteration's backward on more than one process.
    ddp_find_unused_parameters: bool = False

    # Context parallelism (``distributed.context_parallel``, ``flowalign.training.context_parallel``): why a family
    # without a plan cannot split its sequence, in the refusal's words. Every built-in family either has a plan or
    # says here which attention call, mask or layer prevents one (tests/test_context_parallel.py holds them to it);
    # this default is for an adapter registered from outside flowalign that defines neither.
    context_parallel_refusal: str = ("its adapter defines no context-parallel plan (FlowModel.context_parallel_plan) "
                                     "and no context_parallel_refusal saying why")

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        """How this family's transformer splits and gathers its sequence, in diffusers' plan format
        (``ContextParallelInput`` / ``ContextParallelOutput`` per submodule, ``ModelMixin.enable_parallelism``'s
        ``cp_plan``); None: the family cannot run context-parallel (``context_parallel_refusal`` says why).

        Args:
            transformer_class: the diffusers transformer class of the model (read from its config, no weights).

        Returns:
            The plan, or None.
        """
        return None

    @classmethod
    def after_context_parallel(cls, transformer) -> None:
        """Adjust ``transformer`` after diffusers' ``enable_parallelism`` applied the family's plan to it (default:
        nothing). SkyReels-V2 uses it to keep its cross-attention local, as diffusers' Wan processor does.

        Args:
            transformer: the diffusers transformer (each expert of a pair, a full fine-tune's reference copy).
        """

    @classmethod
    def context_parallel_lengths(cls, model_dir: Path, config) -> dict[str, int]:
        """The length of every sequence the family's plan splits, at ``config``'s resolution and frames, from the
        model folder's configs (no weights read): each must divide by the context-parallel degree.

        Args:
            model_dir: the diffusers model folder.
            config: the run's ``TrainConfig``.

        Returns:
            ``{what: tokens}``.
        """
        return {}

    @classmethod
    def claims(cls, index: dict) -> int:
        """How specifically this adapter claims a pipeline of its ``pipeline_class_name`` whose config
        (``model_index.json``, or a pipeline object's ``config``) is ``index``: 0 not at all, 1 as the class's
        general adapter, 2 as a variant's own (Wan2.2's two experts share ``WanPipeline`` with Wan2.1). The loader
        takes the adapter that claims it most.

        Args:
            index: the pipeline's config: component entries and registered settings.

        Returns:
            0, 1 or 2.
        """
        return 1

    def __init__(self, pipe, *, max_sequence_length: int | None = None):
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length or self.default_max_sequence_length()
        # A private scheduler copy: computing sigmas must not disturb the pipeline's own scheduler state.
        self.scheduler = copy.deepcopy(pipe.scheduler)

    # A distributed wrapper of the transformer (DDP, FSDP, DeepSpeed) set by the trainer; forward passes go through
    # it so gradients synchronise, while config, LoRA and saving use the plain ``transformer``.
    forward_module: torch.nn.Module | None = None

    # --- properties ----------------------------------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        """The pipeline's transformer (the plain module: config, LoRA and saving use it)."""
        return self.pipe.transformer

    # Full fine-tuning (``make_full_finetune``): a frozen copy of the base transformer is the reference policy.
    reference_transformer: torch.nn.Module | None = None
    reference_offload: bool = False
    _reference_active: bool = False
    # Set by a sharded engine (FSDP2): every forward pass is a collective, so every process must run as many.
    collective_forwards: bool = False
    # Set by ``enable_context_parallel``: the processes each forward's sequence is split over (1: not split).
    context_parallel_degree: int = 1

    def run_transformer(self, **inputs):
        """One forward pass: through the distributed wrapper when the trainer set one (so gradients synchronise), or
        through the reference copy inside a full fine-tune's ``reference()``.

        Args:
            **inputs: the transformer's keyword arguments.

        Returns:
            What the transformer returns.
        """
        if self._reference_active and self.reference_transformer is not None:
            return self.reference_transformer(**inputs)
        return (self.forward_module or self.transformer)(**inputs)

    # The transformer's device and dtype as diffusers reports them, cached while its weights stay where they were
    # (``flowalign.models.placement``): diffusers' properties walk every submodule on each read, and ``velocity``
    # reads them on every transformer call.
    _placement: Placement | None = None

    @property
    def placement(self) -> Placement:
        """The cache behind ``device`` and ``dtype`` (``forget()`` it after adding a diffusers hook that changes
        them: layerwise casting, group offloading)."""
        if self._placement is None:
            self._placement = Placement()
        return self._placement

    @property
    def device(self) -> torch.device:
        """The transformer's device; a pipeline loaded without one (text encoders only) answers its first text
        encoder's."""
        if self.pipe.transformer is None:
            encoders = self.text_encoders()
            if encoders:
                return next(encoders[0].parameters()).device
        return self.placement.device(self.transformer)

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's dtype."""
        return self.placement.dtype(self.transformer)

    @property
    def vae_scale_factor(self) -> int:
        """The VAE's spatial downsampling (8 for the families built in)."""
        return self.pipe.vae_scale_factor

    @property
    def default_image_size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels the pipeline samples by default."""
        size = self.pipe.default_sample_size * self.vae_scale_factor
        return size, size

    def default_max_sequence_length(self) -> int:
        """The text encoders' token limit when none is given.

        Returns:
            The limit (256 unless the family says otherwise).
        """
        return 256

    # --- family-specific ------------------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence[Any] | None = None) -> Cond:
        """The conditioning of ``prompts`` (and of ``negative_prompts`` for CFG). ``images``: each prompt's condition
        images (``condition_images``), for the families that take them (``takes_condition_images``); the others refuse
        them.

        Args:
            prompts: the batch's prompts.
            negative_prompts: one negative prompt per prompt, for classifier-free guidance; None for none.
            images: one entry of condition images per prompt (editing families only); None for none.

        Returns:
            The ``Cond`` of the batch, one row per prompt.
        """
        raise NotImplementedError

    def masked_cond(self, encode, prompts: Sequence[str], negative_prompts: Sequence[str] | None) -> Cond:
        """``Cond`` of ``encode(prompts) -> (embeds, mask)``, and of ``encode(negative_prompts)`` for its negative
        fields when they are given: for families whose pipeline encodes the two as separate batches.

        Args:
            encode: the family's ``encode(prompts) -> (embeds, mask)``.
            prompts: the batch's prompts (a single string is one prompt).
            negative_prompts: the negative prompts, or None.

        Returns:
            The ``Cond`` with ``embeds`` and ``mask`` (and their negatives when given).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        embeds, mask = encode(prompts)
        cond = Cond(embeds, mask=mask)
        if negative_prompts is not None:
            cond.negative_embeds, cond.negative_mask = encode(list(negative_prompts))
        return cond

    def condition_images(self, images: Sequence[Any] | None, count: int) -> list[list[Any]] | None:
        """``images`` as one list of condition images per prompt (``count`` prompts), or None when there are none.

        ``images[i]`` is prompt ``i``'s condition image (a tensor ``[3, H, W]`` in [0, 1] or a PIL image), a list of
        them, or None / ``[]`` for none. A family that takes no condition images refuses any (ValueError naming the
        families that do); one that takes at most ``max_condition_images`` per prompt refuses more.

        Args:
            images: one entry per prompt, or None.
            count: the number of prompts.

        Returns:
            One list of condition images per prompt, or None when no prompt has any.
        """
        if images is None:
            return None
        if isinstance(images, (str, Tensor)) or not isinstance(images, Sequence):
            raise ValueError(f"images takes one entry per prompt (a list of {count}), got {type(images).__name__}")
        if len(images) != count:
            raise ValueError(f"images has {len(images)} entries for {count} prompts: give one per prompt (None or [] "
                             "for a prompt without condition images)")
        rows = [[] if entry is None else list(entry) if isinstance(entry, (list, tuple)) else [entry]
                for entry in images]
        if not any(rows):
            return None
        if not self.takes_condition_images:
            editing = [name for name in MODEL_FAMILIES if MODEL_FAMILIES.get(name).takes_condition_images]
            raise ValueError(f"model family {self.family!r} ({type(self).__name__}) takes no condition images; the "
                             f"families that edit with them: {', '.join(editing) or 'none registered'}")
        for i, row in enumerate(rows):
            if self.max_condition_images is not None and len(row) > self.max_condition_images:
                raise ValueError(f"prompt {i} has {len(row)} condition images, but model family {self.family!r} "
                                 f"takes at most {self.max_condition_images} per prompt")
            for image in row:
                _check_condition_image(image, i)
        return rows

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """The transformer's velocity at latents ``x``, as the pipeline's denoising loop computes it.

        Args:
            x: latents in the unpacked layout ``[B, C, h, w]``.
            sigma: the noise level, a scalar or one per row.
            cond: the conditioning of the ``B`` rows (``encode``).
            guidance_scale: classifier-free guidance (or the guidance embedding's scale); 1 is none.

        Returns:
            The velocity, shaped as ``x``.
        """
        raise NotImplementedError

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        """``(B, in_channels, H / s, W / s)`` for the VAE's downsampling ``s``: the unpacked latents of the families
        whose transformer patches them itself (SD3, SANA, CogView4); families that pack or patchify override it.

        Args:
            batch: the number of samples.
            image_size: the image size in pixels (an int for a square, or ``(height, width)``); None is the default.

        Returns:
            The shape of the initial noise.
        """
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor
        return batch, self.transformer.config.in_channels, height // scale, width // scale

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """What the pipeline passes to ``scheduler.set_timesteps`` (a resolution-dependent ``mu`` with dynamic
        shifting); ``sigmas`` is built on it.

        Args:
            num_steps: the number of sampling steps.
            image_size: ``(height, width)`` in pixels.

        Returns:
            The keyword arguments (empty when the scheduler needs none).
        """
        raise NotImplementedError

    # --- shared ---------------------------------------------------------------------------------------------------
    def sigmas(self, num_steps: int, image_size: int | Sequence[int] | None = None) -> Tensor:
        """The pipeline's sigma schedule for ``num_steps`` steps, fp32, ending with the terminal 0.

        Args:
            num_steps: the number of sampling steps, at least 1.
            image_size: the image size in pixels (an int or ``(height, width)``); None is the default.

        Returns:
            ``[num_steps + 1]`` sigmas.
        """
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        size = as_image_size(image_size, self.default_image_size)
        self.scheduler.set_timesteps(num_steps, device="cpu", **self.scheduler_kwargs(num_steps, size))
        return self.scheduler.sigmas.clone().to(torch.float32)

    def prepare_noise(
        self,
        batch: int,
        image_size: int | Sequence[int] | None = None,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Initial latents drawn exactly as the pipeline's ``prepare_latents`` draws them for the same generator.

        Args:
            batch: the number of samples.
            image_size: the image size in pixels (an int or ``(height, width)``); None is the default.
            generator: one generator, or one per sample (as diffusers' ``randn_tensor`` takes them).
            dtype: the latents' dtype; None is the transformer's.

        Returns:
            The noise, shaped as ``latent_shape(batch, image_size)``, on the model's device.
        """
        from diffusers.utils.torch_utils import randn_tensor

        shape = self.latent_shape(batch, image_size)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=dtype or self.dtype)

    def velocity_fn(self, cond: Cond, guidance_scale: float = 1.0):
        """``velocity(x, sigma)`` closed over ``cond``, for the samplers; counts 2 evaluations per sample with CFG.

        Args:
            cond: the conditioning of the rows.
            guidance_scale: classifier-free guidance; 1 is none.

        Returns:
            The function, with ``evals_per_sample`` (1, or 2 with CFG) for the NFE accounting.
        """

        def velocity(x: Tensor, sigma: Tensor) -> Tensor:
            return self.velocity(x, sigma, cond, guidance_scale)

        velocity.evals_per_sample = 2 if self.uses_cfg(guidance_scale) else 1
        return velocity

    def uses_cfg(self, guidance_scale: float) -> bool:
        """True when ``guidance_scale`` means a second (unconditional) forward pass.

        Args:
            guidance_scale: the classifier-free guidance scale.

        Returns:
            Whether each velocity costs two forward passes.
        """
        return guidance_scale > 1.0

    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, h, w]`` to images in [0, 1], ``[B, 3, H, W]`` fp32, as the pipeline's postprocess does.

        Differentiable: wrap in ``torch.no_grad()`` when no gradient is wanted.

        Args:
            latents: ``[B, C, h, w]`` in the layout ``velocity`` takes.

        Returns:
            Images ``[B, 3, H, W]`` in [0, 1], fp32.
        """
        vae = self.pipe.vae
        return self.decode_vae_latents(latents.to(vae.dtype) / vae.config.scaling_factor
                                       + (vae.config.shift_factor or 0.0))

    def decode_vae_latents(self, latents: Tensor) -> Tensor:
        """Latents in the VAE's own space (scaling and normalisation undone) to images in [0, 1], fp32: the VAE's
        decode in its dtype, then the pipelines' postprocess ``(x / 2 + 0.5).clamp(0, 1)``.

        Args:
            latents: latents in the VAE's own space.

        Returns:
            Images ``[B, 3, H, W]`` in [0, 1], fp32.
        """
        vae = self.pipe.vae
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @property
    def image_multiple(self) -> int:
        """Image sides must be multiples of this: the VAE's downsampling (families add the transformer's patching)."""
        return self.vae_scale_factor

    def encode_images(
        self,
        images: Tensor,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        sample: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Images in [0, 1], ``[B, 3, H, W]`` (what ``decode`` returns), to latents ``[B, C, h, w]``: decode's inverse.

        As diffusers' img2img pipelines and training scripts encode: ``2 x - 1`` (the image processor's normalize),
        the VAE's posterior in the VAE's dtype, its mean (``latent_dist.mode()``) or, with ``sample=True``, a draw
        ``mean + std * eps`` with ``generator`` (one per row, or one for the batch), then
        ``(z - shift_factor) * scaling_factor``. The result is in the unpacked layout ``velocity`` and
        ``prepare_noise`` use (FLUX packs its 2x2 patches inside ``velocity``), in ``dtype`` (default: the
        transformer's, as ``prepare_noise``). Differentiable: wrap in ``torch.no_grad()`` when no gradient is wanted.

        Args:
            images: ``[B, 3, H, W]`` float in [0, 1], sides multiples of ``image_multiple``.
            generator: for ``sample=True``: one generator, or one per row.
            sample: draw from the VAE's posterior instead of taking its mean.
            dtype: the latents' dtype; None is the transformer's.

        Returns:
            Latents ``[B, C, h, w]``.
        """
        vae = self.pipe.vae
        latents = self.vae_posterior_latents(images, generator=generator, sample=sample)
        latents = (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        return self.checked_latents(latents, images, dtype)

    def vae_posterior_latents(self, images: Tensor, *, generator=None, sample: bool = False) -> Tensor:
        """``images`` checked (``_check_images``), as ``2 x - 1`` in the VAE's dtype through its encoder: the
        posterior's mean, or with ``sample=True`` a draw with ``generator``; in the VAE's own space (no scaling).

        Args:
            images: ``[B, 3, H, W]`` float in [0, 1].
            generator: for ``sample=True``: one generator, or one per row.
            sample: draw from the posterior instead of taking its mean.

        Returns:
            The posterior latents in the VAE's own space.
        """
        self._check_images(images)
        vae = self.pipe.vae
        pixels = (2.0 * images.float() - 1.0).to(device=vae.device, dtype=vae.dtype)
        posterior = vae.encode(pixels).latent_dist
        return posterior.sample(generator) if sample else posterior.mode()

    def checked_latents(self, latents: Tensor, images: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Encoded ``latents`` of ``images`` in ``dtype`` (default: the transformer's); a RuntimeError when their shape
        is not the ``latent_shape`` the transformer takes for that image size.

        Args:
            latents: the encoded latents.
            images: the images they encode.
            dtype: the dtype to return; None is the transformer's.

        Returns:
            ``latents`` in ``dtype``.
        """
        expected = self.latent_shape(images.shape[0], tuple(images.shape[-2:]))
        if tuple(latents.shape) != tuple(expected):
            raise RuntimeError(
                f"the VAE encodes {tuple(images.shape)} images to latents {tuple(latents.shape)}, but the transformer "
                f"takes {tuple(expected)}: the VAE's latent_channels do not match the transformer's in_channels"
            )
        return latents.to(dtype or self.dtype)

    def _check_images(self, images: Tensor, tolerance: float = 1e-3) -> None:
        """A clear ValueError for input ``encode_images`` cannot take: type, rank, channels, size, dtype, range."""
        if not isinstance(images, Tensor):
            raise ValueError(f"encode_images takes a torch.Tensor of images [B, 3, H, W], got {type(images).__name__}")
        if images.ndim != 4:
            hint = " (a single image: add the batch dimension with images[None])" if images.ndim == 3 else ""
            raise ValueError(f"encode_images takes images of rank 4 [B, 3, H, W], got rank {images.ndim} "
                             f"{tuple(images.shape)}{hint}")
        batch, channels, height, width = images.shape
        if channels != 3:
            raise ValueError(f"encode_images takes RGB images with 3 channels [B, 3, H, W], got {channels} channels "
                             f"in {tuple(images.shape)}" + (" (channels last? use images.permute(0, 3, 1, 2))"
                                                              if images.shape[-1] == 3 else ""))
        if batch == 0:
            raise ValueError("encode_images got an empty batch of images")
        multiple = self.image_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"encode_images: the image size {height}x{width} must be a multiple of {multiple} "
                             f"(the {self.family or 'model'}'s VAE downsampling and patching) on both sides")
        if not images.is_floating_point():
            raise ValueError(f"encode_images takes float images in [0, 1], got dtype {images.dtype} "
                             "(for uint8 pixels pass images.float() / 255)")
        low, high = float(images.min()), float(images.max())
        if not (low >= -tolerance and high <= 1 + tolerance):
            hint = " (images in [-1, 1]? pass (images + 1) / 2)" if low >= -1 - tolerance and low < 0 else ""
            raise ValueError(f"encode_images takes images in [0, 1], got values in [{low:g}, {high:g}]{hint}")

    def shift_mu(self, image_seq_len: int, *, max_shift: float = 1.15) -> float:
        """The resolution-dependent shift ``mu`` for ``image_seq_len`` image tokens, linear between the scheduler
        config's ``(base_image_seq_len, base_shift)`` and ``(max_image_seq_len, max_shift)`` (defaults 256, 0.5, 4096,
        ``max_shift``): diffusers' ``calculate_shift``, which the FLUX, Chroma, Qwen-Image, Z-Image, Lumina2 and SD3
        pipelines each carry a copy of.

        Args:
            image_seq_len: the number of image tokens.
            max_shift: the shift at ``max_image_seq_len`` when the scheduler config has none.

        Returns:
            ``mu``.
        """
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        return calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )

    def timestep(self, sigma: float | Tensor, batch: int) -> Tensor:
        """The pipeline's timestep for ``sigma``: ``sigma * num_train_timesteps`` in fp32, one per row.

        Args:
            sigma: a scalar, or one per row.
            batch: the number of rows.

        Returns:
            ``[batch]`` timesteps on the model's device.
        """
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        t = sigma * self.scheduler.config.num_train_timesteps
        return t.expand(batch) if t.ndim == 0 else t

    # --- LoRA and the reference model ----------------------------------------------------------------------------
    def add_lora(
        self,
        rank: int = 32,
        alpha: float | None = None,
        *,
        target_modules: Sequence[str] | None = None,
        dropout: float = 0.0,
        init: str | bool = "gaussian",
        adapter_name: str = "default",
    ) -> None:
        """Attach a peft LoRA adapter to the transformer (Flow-GRPO defaults: r=32, alpha=64, gaussian init).

        The adapter's B matrices start at zero, so the adapted model starts equal to the base model.

        Args:
            rank: the LoRA rank, at least 1.
            alpha: the LoRA alpha; None is ``2 * rank``.
            target_modules: the module names to wrap; None is the family's ``lora_targets``.
            dropout: the LoRA dropout.
            init: peft's ``init_lora_weights``.
            adapter_name: the adapter's name.
        """
        from peft import LoraConfig

        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        targets = list(target_modules or self.lora_targets)
        present = {name for name, _ in self.transformer.named_modules()}
        if not any(any(name.endswith(t) for name in present) for t in targets):
            raise ValueError(f"none of the LoRA target modules {targets} exist in {type(self.transformer).__name__}")
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha if alpha is not None else 2 * rank,
            lora_dropout=dropout,
            init_lora_weights=init,
            target_modules=targets,
        )
        self.transformer.add_adapter(config, adapter_name=adapter_name)

    @property
    def has_lora(self) -> bool:
        """Whether the transformer has a LoRA adapter (``add_lora``)."""
        return bool(getattr(self.transformer, "_hf_peft_config_loaded", False))

    @property
    def has_reference(self) -> bool:
        """Whether ``reference()`` has a reference policy: a LoRA adapter to disable, or a full fine-tune's copy."""
        return self.has_lora or self.reference_transformer is not None

    @property
    def active_transformer(self) -> torch.nn.Module:
        """The module a forward pass runs now: the reference copy inside a full fine-tune's ``reference()``, else
        the transformer (hooks that read a pass attach here)."""
        if self._reference_active and self.reference_transformer is not None:
            return self.reference_transformer
        return self.transformer

    @property
    def full_finetune(self) -> bool:
        """Whether every transformer weight trains (``make_full_finetune``)."""
        return self.reference_transformer is not None

    def make_full_finetune(self, *, offload: bool = False) -> None:
        """Train every transformer weight: keep a frozen copy of the base transformer as the reference policy (on the
        CPU between reference passes with ``offload``, moved to the device for each), and make the trained weights
        fp32 master weights (compute in a lower dtype comes from autocast, ``model.mixed_precision``).

        At the start the policy and the copy hold the same values, so the reference is bitwise the policy while the
        base weights are fp32 (the toy world), and the policy's autocast compute otherwise.

        Args:
            offload: keep the reference copy on the CPU between reference passes.
        """
        if self.has_lora:
            raise RuntimeError("make_full_finetune: this model has a LoRA adapter; full fine-tuning trains the base "
                               "weights themselves")
        if self.reference_transformer is None:
            self.reference_transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval()
            if offload:
                self.reference_transformer.to("cpu")
        self.reference_offload = offload
        for param in self.transformer.parameters():
            param.data = param.data.float()
            param.requires_grad_(True)
        for module in (self.pipe.vae, *self.text_encoders()):
            module.requires_grad_(False)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The reference policy: the transformer with its LoRA adapter disabled (bitwise the base model), or for a
        full fine-tune the frozen copy of the base transformer (``make_full_finetune``).

        Yields:
            Nothing: inside the ``with`` block the model's passes are the reference policy's.
        """
        if self.reference_transformer is not None:
            if self.reference_offload:
                self.reference_transformer.to(self.device)
            self._reference_active = True
            try:
                yield
            finally:
                self._reference_active = False
                if self.reference_offload:
                    self.reference_transformer.to("cpu")
            return
        if not self.has_lora:
            raise RuntimeError("the reference model is the LoRA-disabled transformer: call add_lora() first")
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The adapter's tensors in peft's naming (from ``state_dict`` when given: a sharded run's gathered ones).

        Args:
            state_dict: the transformer's tensors to read the adapter from; None reads the module.

        Returns:
            The adapter's tensors by name.
        """
        from peft.utils import get_peft_model_state_dict

        if not self.has_lora:
            raise RuntimeError("this model has no LoRA adapter: call add_lora() first")
        return get_peft_model_state_dict(self.transformer, state_dict=state_dict)

    def save_lora(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Write the adapter in diffusers' format: ``pipe.load_lora_weights(directory)`` reads it back.

        A pipeline class without a LoRA loader (no ``save_lora_weights``) gets the transformer's own adapter format
        instead, which ``transformer.load_lora_adapter(directory, prefix=None, use_safetensors=True)`` reads back; a
        warning says so.

        Args:
            directory: the folder to write (made when missing).
            state_dict: the transformer's tensors to save the adapter from; None reads the module.

        Returns:
            ``directory``.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        pipeline_class = type(self.pipe)
        if getattr(pipeline_class, "save_lora_weights", None) is None:
            logger.warning("%s has no LoRA loader (save_lora_weights): wrote the adapter in the transformer's own "
                           "format to %s instead; load it with transformer.load_lora_adapter(%r, prefix=None, use_safetensors=True)",
                           pipeline_class.__name__, directory, str(directory))
            from diffusers.loaders.lora_base import LoraBaseMixin

            # what transformer.save_lora_adapter writes, from the given (gathered) tensors too
            LoraBaseMixin.write_lora_layers(
                state_dict=self.lora_state_dict(state_dict), save_directory=str(directory), is_main_process=True,
                weight_name="pytorch_lora_weights.safetensors", save_function=None, safe_serialization=True,
                lora_adapter_metadata=self.transformer.peft_config["default"].to_dict())
            return directory
        # The adapter metadata carries lora_alpha: without it a loader assumes alpha = rank and rescales the update.
        pipeline_class.save_lora_weights(
            directory,
            transformer_lora_layers=self.lora_state_dict(state_dict),
            transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict(),
            safe_serialization=True,
        )
        return directory

    def save_trained(self, checkpoint: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """What trains, in diffusers' format, under ``checkpoint``: ``lora/`` (``save_lora``) or, for a full
        fine-tune, ``transformer/`` (the transformer's ``config.json`` and ``diffusion_pytorch_model.safetensors``
        with the fp32 master weights, read back by the transformer class's ``from_pretrained``). Returns the folder.

        ``state_dict`` (a sharded run's all-gathered tensors: the trainable ones, or the whole transformer state of a
        full fine-tune) replaces reading the module's own parameters.

        Args:
            checkpoint: the checkpoint folder to write under.
            state_dict: a sharded run's gathered tensors; None reads the module.

        Returns:
            The folder written: ``lora/`` or ``transformer/`` under ``checkpoint``.
        """
        if self.full_finetune:
            folder = Path(checkpoint) / "transformer"
            if state_dict is None:
                self.transformer.save_pretrained(folder, safe_serialization=True)
                return folder
            from safetensors.torch import save_file

            self.transformer.save_config(folder)
            save_file({k: v.contiguous() for k, v in state_dict.items()},
                      str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
            return folder
        return self.save_lora(Path(checkpoint) / "lora", state_dict=state_dict)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The transformer's parameters that require a gradient.

        Returns:
            The parameters, in the module's order.
        """
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def freeze_base(self) -> None:
        """Freeze everything but the LoRA parameters (text encoders and VAE included)."""
        for module in (self.pipe.vae, *self.text_encoders()):
            module.requires_grad_(False)
        for name, param in self.transformer.named_parameters():
            param.requires_grad_("lora_" in name)

    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders that are present.

        Returns:
            ``text_encoder``, ``text_encoder_2`` and ``text_encoder_3``, those the pipeline has.
        """
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        return [getattr(self.pipe, n) for n in names if getattr(self.pipe, n, None) is not None]
