"""HiDream-I1 adapter: two CLIPs, T5 and Llama text encoders, a fixed latent area, a negated velocity, an MoE
transformer.

Conventions of ``diffusers.HiDreamImagePipeline`` that the adapter reproduces:

* **Text**: ``pooled`` = the two CLIP projections concatenated; ``embeds`` = the T5 states (padded to
  ``max_sequence_length``, with T5's attention mask inside the encoder); the Llama encoder's hidden states of every
  layer (``[layers, B, L, D]`` in the pipeline) travel batch-first in ``Cond.extras["llama"]`` (``[B, layers, L,
  D]``) and are put back layer-first for the transformer. The Llama tokenizer pads with its EOS token.
* **Size**: every request is rescaled to the default area ``(default_sample_size * vae_scale_factor) ** 2`` with
  its aspect ratio kept, each side rounded down to a multiple of ``2 * vae_scale_factor``: ``image_size_for`` gives
  the size the pipeline (and the adapter: ``latent_shape``, ``decode``) really produces. ``default_sample_size`` is
  hard-coded to 128 by the pipeline, the full model's ``max_resolution``; the adapter sets it to the transformer's
  square ``max_resolution`` so that a differently sized HiDream (a tiny test model) keeps its own area.
* **Time**: ``t = 1000 sigma`` (fp32); the scheduler's static shift (``mu`` from the transformer's ``max_seq``).
* **Sign**: the transformer predicts the negated velocity: ``v = -transformer(...)``, then CFG.
* **Latents**: unpacked ``[B, C, H/8, W/8]``; the transformer patchifies inside (padding non-square grids to
  ``max_seq`` tokens with a mask). In train mode it returns its training layout ``[B, C, tokens, p*p]``, which
  ``velocity`` unpatchifies to the same ``[B, C, h, w]``.
* **MoE**: diffusers' routed-expert inference path runs under ``no_grad``; with gradients enabled ``velocity`` runs
  the MoE feed-forwards on their differentiable (training) path, which computes the same values for up to two
  activated experts per token.
* **CFG**: ``guidance_scale > 1``: one batched pass over ``[negative, positive]``, then ``u + s (c - u)``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, guided, register_model_family, require_negative

# The attention projections of both block kinds: image stream (to_q ... to_out) and, in the double-stream blocks,
# the text stream (to_q_t ... to_out_t).
HIDREAM_ATTENTION_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out",
    "attn1.to_q_t",
    "attn1.to_k_t",
    "attn1.to_v_t",
    "attn1.to_out_t",
)


@register_model_family("hidream")
class HiDreamModel(FlowModel):
    """Adapter over ``diffusers.HiDreamImagePipeline``."""

    family = "hidream"
    context_parallel_refusal = ("its attention processor (HiDreamAttnProcessor) calls scaled_dot_product_attention "
                                "itself, not diffusers' attention dispatcher, so a split sequence would attend only "
                                "to each process's own tokens")
    pipeline_class_name = "HiDreamImagePipeline"
    lora_targets = HIDREAM_ATTENTION_TARGETS

    def __init__(self, pipe, *, max_sequence_length: int | None = None):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        rows, cols = self.transformer.config.max_resolution
        if rows == cols:
            pipe.default_sample_size = int(rows)

    def default_max_sequence_length(self) -> int:
        """The pipeline's 128, within the T5 and Llama tokenizers' lengths (the pipeline pads the CLIP prompts to
        ``min(max_sequence_length, 218)`` whatever their tokenizers say: their encoders must hold that many)."""
        tokenizers = (self.pipe.tokenizer_3, self.pipe.tokenizer_4)
        return min(128, *(t.model_max_length for t in tokenizers if t is not None))

    def text_encoders(self) -> list[torch.nn.Module]:
        names = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
        return [getattr(self.pipe, n) for n in names if getattr(self.pipe, n, None) is not None]

    # --- sizes -----------------------------------------------------------------------------------------------------
    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling times the transformer's 2x2 patches."""
        return self.vae_scale_factor * 2

    def image_size_for(self, image_size: int | Sequence[int] | None = None) -> tuple[int, int]:
        """The ``(height, width)`` the pipeline produces for a request: rescaled to the default area."""
        height, width = as_image_size(image_size, self.default_image_size)
        division = self.vae_scale_factor * 2
        scale = math.sqrt((self.pipe.default_sample_size * self.vae_scale_factor) ** 2 / (width * height))
        return int(height * scale // division * division), int(width * scale // division * division)

    def encode_images(self, images: Tensor, **kwargs) -> Tensor:
        """As the base adapter's, for images of a size the pipeline produces (``image_size_for`` keeps it)."""
        size = tuple(images.shape[-2:]) if isinstance(images, Tensor) and images.ndim == 4 else None
        if size is not None and self.image_size_for(size) != size:
            raise ValueError(f"encode_images: HiDream samples every size at the area of {self.default_image_size}; "
                             f"{size[0]}x{size[1]} images are produced as {self.image_size_for(size)}: resize them "
                             "to a size image_size_for keeps")
        return super().encode_images(images, **kwargs)

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        height, width = self.image_size_for(image_size)
        scale = self.vae_scale_factor * 2
        return batch, self.transformer.config.in_channels, 2 * (height // scale), 2 * (width // scale)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift

        return {"mu": calculate_shift(self.transformer.max_seq)}

    # --- text ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        with_negative = negative_prompts is not None
        t5, neg_t5, llama, neg_llama, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            do_classifier_free_guidance=with_negative,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        cond = Cond(t5, pooled, extras={"llama": llama.transpose(0, 1)})
        if with_negative:
            cond.negative_embeds, cond.negative_pooled = neg_t5, neg_pooled
            cond.extras["negative_llama"] = neg_llama.transpose(0, 1)
        return cond

    # --- velocity --------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _differentiable_experts(self) -> Iterator[None]:
        """With gradients on, the MoE feed-forwards on their differentiable path (their inference path is no_grad)."""
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        switched = []
        if torch.is_grad_enabled():
            for module in self.transformer.modules():
                if isinstance(module, MOEFeedForwardSwiGLU) and not module.training:
                    module.train()
                    switched.append(module)
        try:
            yield
        finally:
            for module in switched:
                module.eval()

    def _unpatchify_training_layout(self, out: Tensor, h: int, w: int) -> Tensor:
        """The transformer's train-mode output ``[B, C, tokens, p*p]`` as ``[B, C, h, w]``."""
        p = self.transformer.config.patch_size
        b, c = out.shape[:2]
        grid = out[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p)
        return grid.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        batch, _, h, w = x.shape
        hidden = x.to(self.dtype)
        timestep = self.timestep(sigma, batch)
        t5, llama, pooled = cond.embeds, cond.extras["llama"], cond.pooled
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            require_negative(cond, guidance_scale)
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
            t5 = torch.cat([cond.negative_embeds, t5])
            llama = torch.cat([cond.extras["negative_llama"], llama])
            pooled = torch.cat([cond.negative_pooled, pooled])
        with self._differentiable_experts():
            out = self.run_transformer(
                hidden_states=hidden,
                timesteps=timestep,
                encoder_hidden_states_t5=t5,
                encoder_hidden_states_llama3=llama.transpose(0, 1).contiguous(),
                pooled_embeds=pooled,
                return_dict=False,
            )[0]
        if self.transformer.training and not self.transformer.config.force_inference_output:
            out = self._unpatchify_training_layout(out, h, w)
        v = -out
        if cfg:
            uncond, text = v.chunk(2)
            v = guided(text, uncond, guidance_scale)
        return v
