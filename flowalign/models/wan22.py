"""Wan2.2 A14B adapters (``WanPipeline`` / ``WanImageToVideoPipeline`` with ``transformer_2`` and ``boundary_ratio``).

Conventions (``WanPipeline.__call__``; everything else is Wan2.1's: ``flowalign.models.wan`` and, for I2V,
``flowalign.models.wan_i2v``):

* two experts of one architecture: ``transformer`` (high noise) runs the steps whose scheduler timestep is
  ``t >= boundary_ratio * num_train_timesteps`` (0.875 for T2V, 0.9 for I2V as released), ``transformer_2`` (low
  noise) the others. The adapter takes ``t = 1000 sigma`` (the pipeline's timestep for the flow sigmas) and picks the
  expert of each row from it, so a rollout and the training forward that recomputes its log-probs run the same
  expert for every transition. ``model.transformer`` is an ``ExpertPair`` holding both (``flowalign.models.
  wan_experts``): LoRA, full fine-tuning, FSDP2 and checkpoints cover both experts.
* CFG: the pipeline runs the unconditional pass when ``guidance_scale > 1`` (the high expert's scale) and combines
  the low expert's passes at ``guidance_scale_2`` (the adapter option; None: the same scale, as the pipeline's
  default).
* LoRA: on the experts ``lora_experts`` names (``model.lora_experts``: ``[high, low]`` by default). ``save_lora``
  writes the high expert's adapter as ``pytorch_lora_weights.safetensors`` (``pipe.load_lora_weights(folder)``) and
  the low expert's as ``pytorch_lora_weights_transformer_2.safetensors`` (``pipe.load_lora_weights(folder,
  weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True)``), each in diffusers'
  ``transformer.*`` naming.
* Wan2.2 A14B I2V has no image encoder: the first frame conditions through the latents only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .wan import WanModel, wan_variant
from .wan_experts import EXPERTS, ExpertPair, check_expert_names
from .wan_i2v import FirstFrameCondition

# The file each expert's LoRA is written to in a LoRA folder (the high expert's is diffusers' default name).
LORA_WEIGHT_NAMES = {"high": "pytorch_lora_weights.safetensors",
                     "low": "pytorch_lora_weights_transformer_2.safetensors"}


class TwoExperts:
    """The two-expert part of the Wan2.2 A14B adapters (mixed into a ``WanModel``; module docstring).

    Args:
        guidance_scale_2: the low-noise expert's CFG scale; None is the high expert's.
        lora_experts: the experts ``add_lora`` puts an adapter on, from ``("high", "low")``; None is both.
    """

    experts = EXPERTS

    def __init__(self, pipe, *, guidance_scale_2: float | None = None, lora_experts: Sequence[str] | None = None,
                 **kwargs):
        if getattr(pipe, "transformer_2", None) is None or pipe.transformer is None or pipe.config.boundary_ratio is None:
            raise ValueError(f"{type(self).__name__} wraps a Wan2.2 A14B pipeline with transformer, transformer_2 and "
                             "boundary_ratio; this pipeline lacks one of them (a Wan2.1 model: use family 'wan')")
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        self._pair = ExpertPair(pipe.transformer, pipe.transformer_2, boundary)
        super().__init__(pipe, **kwargs)
        self.guidance_scale_2 = guidance_scale_2
        self._pair.adapter_experts = EXPERTS if lora_experts is None else check_expert_names(lora_experts,
                                                                                             "lora_experts")

    @classmethod
    def claims(cls, index: dict) -> int:
        """A Wan config with a ``transformer_2`` (and no ``expand_timesteps``): this adapter's own."""
        return 2 if wan_variant(index) == "experts" else 0

    @property
    def transformer(self) -> ExpertPair:
        """Both experts as one module (``ExpertPair``)."""
        return self._pair

    def add_lora(self, rank: int = 32, alpha: float | None = None, *, experts: Sequence[str] | None = None,
                 **kwargs) -> None:
        """``FlowModel.add_lora`` on each expert of ``experts`` (None: the adapter's ``lora_experts``)."""
        if experts is not None:
            self._pair.adapter_experts = check_expert_names(experts, "experts")
        super().add_lora(rank, alpha, **kwargs)

    def run_transformer(self, **inputs):
        """A forward pass; under a data-parallel wrapper that needs a gradient for every trainable weight (DDP), a
        pass through one expert also touches the other's trainable weights (times zero)."""
        from torch.nn.parallel import DistributedDataParallel

        self._pair.touch_other = isinstance(self.forward_module, DistributedDataParallel)
        return super().run_transformer(**inputs)

    # --- the velocity -------------------------------------------------------------------------------------------
    def expert_timestep(self, timestep: Tensor) -> Tensor:
        """Each row's scheduler timestep (the first token's, for per-token timesteps)."""
        return timestep if timestep.ndim == 1 else timestep[:, 0]

    def experts_needed(self, high: Tensor) -> list[str]:
        """The experts this call runs: those some row needs; with collective forwards (FSDP2), those a row of any
        process needs (the same on every process, so every process runs as many forwards of each expert)."""
        flags = torch.stack([high.any(), (~high).any()]).to(torch.int32)
        if self.collective_forwards:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [name for name, flag in zip(EXPERTS, flags.tolist()) if flag]

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """The velocity of each row from the expert its timestep picks (``t >= boundary``: ``transformer``), at
        ``guidance_scale`` (high) or ``guidance_scale_2`` (low); the second CFG pass runs when ``guidance_scale > 1``,
        as the pipeline's ``do_classifier_free_guidance``."""
        timestep = self.timestep(sigma, x.shape[0])
        return self.routed_velocity(x, timestep, cond, guidance_scale)

    def routed_velocity(self, x: Tensor, timestep: Tensor, cond: Cond, guidance_scale: float) -> Tensor:
        """``transformer_velocity`` with each row sent to its expert (rows on either side run as two batches; a
        process with no row for an expert that another process runs runs it on its first row, times zero)."""
        high = self._pair.is_high(self.expert_timestep(timestep))
        cfg = self.uses_cfg(guidance_scale)
        out, zero = None, None
        for name in self.experts_needed(high):
            rows = high if name == "high" else ~high
            scale = guidance_scale if name == "high" or self.guidance_scale_2 is None else self.guidance_scale_2
            if bool(rows.all()):
                out = self.transformer_velocity(x, timestep, cond, scale, cfg, expert=name)
            elif bool(rows.any()):
                index = rows.nonzero().squeeze(1)
                part = self.transformer_velocity(x[index], timestep[index], cond.index(index), scale, cfg,
                                                 expert=name)
                out = (part.new_zeros(x.shape) if out is None else out).index_put((index,), part)
            else:
                first = torch.zeros(1, dtype=torch.long, device=x.device)
                zero = self.transformer_velocity(x[first], timestep[first], cond.index(first), scale, cfg,
                                                 expert=name).sum() * 0.0
        return out if zero is None else out + zero

    # --- saving -------------------------------------------------------------------------------------------------
    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None, expert: str = "high") -> dict[str, Tensor]:
        """The adapter tensors of ``expert`` in peft's naming (from ``state_dict``, the pair's tensors, when given)."""
        from peft.utils import get_peft_model_state_dict

        if expert not in self._pair.lora_experts:
            raise RuntimeError(f"the {expert} expert has no LoRA adapter (it has: {list(self._pair.lora_experts)})")
        prefix = f"{expert}."
        sub = None if state_dict is None else {k[len(prefix):]: v for k, v in state_dict.items()
                                               if k.startswith(prefix)}
        return get_peft_model_state_dict(self._pair.expert(expert), state_dict=sub)

    def save_lora(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Each expert's adapter in diffusers' format (module docstring: which file the pipeline reads for which
        expert)."""
        if not self.has_lora:
            raise RuntimeError("this model has no LoRA adapter: call add_lora() first")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in self._pair.lora_experts:
            type(self.pipe).save_lora_weights(
                directory, transformer_lora_layers=self.lora_state_dict(state_dict, name),
                transformer_lora_adapter_metadata=self._pair.expert(name).peft_config["default"].to_dict(),
                weight_name=LORA_WEIGHT_NAMES[name], safe_serialization=True)
        return directory

    def load_lora_folder(self, directory: str | Path) -> None:
        """Load a LoRA folder ``save_lora`` wrote into the pipeline's experts (each file into its expert)."""
        directory = Path(directory)
        for name in EXPERTS:
            if (directory / LORA_WEIGHT_NAMES[name]).is_file():
                self.pipe.load_lora_weights(str(directory), weight_name=LORA_WEIGHT_NAMES[name],
                                            load_into_transformer_2=name == "low")

    def save_trained(self, checkpoint: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """A LoRA folder (``save_lora``), or for a full fine-tune each expert in diffusers' format under the
        pipeline's component names, ``transformer/`` and ``transformer_2/``; returns ``transformer/``'s folder (or
        the LoRA folder)."""
        if not self.full_finetune:
            return self.save_lora(Path(checkpoint) / "lora", state_dict=state_dict)
        from safetensors.torch import save_file

        for name in EXPERTS:
            folder = Path(checkpoint) / self.expert_component(name)
            expert = self._pair.expert(name)
            if state_dict is None:
                expert.save_pretrained(folder, safe_serialization=True)
                continue
            prefix = f"{name}."
            expert.save_config(folder)
            save_file({k[len(prefix):]: v.contiguous() for k, v in state_dict.items() if k.startswith(prefix)},
                      str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        return Path(checkpoint) / "transformer"

    @staticmethod
    def expert_component(name: str) -> str:
        """The pipeline component of expert ``name``: ``transformer`` (high) or ``transformer_2`` (low)."""
        return "transformer" if name == "high" else "transformer_2"


@register_model_family("wan22")
class Wan22Model(TwoExperts, WanModel):
    """Adapter over ``diffusers.WanPipeline`` with Wan2.2 A14B's two experts (T2V)."""

    family = "wan22"
    pipeline_class_name = "WanPipeline"


@register_model_family("wan22_i2v")
class Wan22I2VModel(TwoExperts, FirstFrameCondition, WanModel):
    """Adapter over ``diffusers.WanImageToVideoPipeline`` with Wan2.2 A14B's two experts (I2V, no image encoder)."""

    family = "wan22_i2v"
    pipeline_class_name = "WanImageToVideoPipeline"
