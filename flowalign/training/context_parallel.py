"""Context parallelism: one sample's token sequence split over a group of processes (``distributed.context_parallel``).

The processes form a 2D mesh, data x context (``rank = data_rank * degree + context_rank``): the ``degree = ulysses *
ring`` processes of a context group hold the same samples, the ``world / degree`` data groups split the batch as the
processes of a run without context parallelism do (``flowalign.training.batch_layout``, keyed by the data rank, so a
context group draws exactly what one process draws: ``flowalign.seeding``). Within a group the transformer runs
through diffusers' own context parallelism (``ModelMixin.enable_parallelism`` with a ``ContextParallelConfig`` and
the family's plan, ``FlowModel.context_parallel_plan``): the plan splits the sequence on the way in, attention runs
as Ulysses (all-to-all over heads) or ring attention, and the output is all-gathered on the way out, so the sampler,
the log-probs, the rewards and the loss see whole samples, bit for bit the same on every process of the group.

Gradients: the all-gather's backward keeps each process's own slice, so a process's gradient is its shard's part of
the whole sample's gradient, and the true gradient is the sum over the context group (averaged over the data groups).
The engines average over all ``world`` processes (DDP's all-reduce, FSDP2's reduce-scatter over the whole world), so
``DataParallelView.backward`` multiplies the loss by the degree: ``(1/D) sum_d sum_c g_dc = degree * mean_{d,c} g_dc``.

Two things of diffusers 0.42.1 need care:

* ``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``, a division by zero on
  a machine without an accelerator: on CPU the model's config is resolved here instead (``_resolve_on_cpu``, set on
  the one transformer instance, the same steps with the CPU device). Proposed upstream: use
  ``torch.device("cpu")`` when ``device_type == "cpu"`` (or ``device_count() == 0``).
* Ring attention asks the attention backend for the log-sum-exp of each chunk (``return_lse=True``); the only backend
  that runs on CPU, ``native`` (``scaled_dot_product_attention``), refuses it, so ``ring > 1`` is refused on CPU before
  any model loads (the collectives ring attention uses, ``all_gather_tensor`` and ``permute_tensor``, do run on gloo,
  and diffusers' ring over gloo with an attention op that returns it equals one process's attention:
  tests/ring_attention.py). On CUDA a ring runs on diffusers' ``_native_cudnn`` backend (cuDNN's attention, which
  returns it, in bf16 or fp16: ``model.mixed_precision`` or ``model.dtype``); unverified until a machine with two
  GPUs runs ``bench/device_check.sh``.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from flowalign.config import ConfigError

__all__ = ["ContextParallelLayout", "DataParallelView", "check_context_parallel", "enable_context_parallel",
           "split_transformers"]

KEY = "distributed.context_parallel"
RING_BACKEND = "_native_cudnn"


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where this process sits on the data x context mesh (module docstring)."""

    world_size: int
    rank: int
    degree: int

    @property
    def data_degree(self) -> int:
        return self.world_size // self.degree

    @property
    def data_rank(self) -> int:
        return self.rank // self.degree

    @property
    def context_rank(self) -> int:
        return self.rank % self.degree


class DataParallelView:
    """The accelerator as the batch layout sees it under context parallelism: ``process_index`` and
    ``num_processes`` are the data rank and the data degree; ``gather`` and ``reduce`` count every context group once
    (a world gather, then each group's first process's part); ``backward`` scales the loss by the degree (module
    docstring). Everything else is the real accelerator's (``world``)."""

    def __init__(self, accelerator, layout: ContextParallelLayout):
        self.world = accelerator
        self.layout = layout

    def __getattr__(self, name):
        return getattr(self.world, name)

    @property
    def process_index(self) -> int:
        return self.layout.data_rank

    @property
    def num_processes(self) -> int:
        return self.layout.data_degree

    @property
    def context_degree(self) -> int:
        return self.layout.degree

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (at least 1-D) of every data group, concatenated on dim 0 in data-rank order."""
        gathered = self.world.gather(tensor.contiguous())
        return gathered.reshape(self.layout.data_degree, self.layout.degree, *tensor.shape)[:, 0].flatten(0, 1)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over the data groups (``sum``, ``mean`` or ``max``)."""
        values = self.gather(tensor.unsqueeze(0))
        if reduction == "sum":
            return values.sum(dim=0)
        if reduction == "mean":
            return values.mean(dim=0)
        if reduction == "max":
            return values.amax(dim=0)
        raise ValueError(f"DataParallelView.reduce: unsupported reduction {reduction!r}")

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.world.backward(loss * self.layout.degree, **kwargs)


# ------------------------------------------------------------------------------------------- checks before loading
def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def check_context_parallel(config, num_processes: int, device_type: str) -> ContextParallelLayout | None:
    """Refuse, before any model loads, a context-parallel config this launch cannot run: the degree must divide the
    process count, ring attention needs an accelerator and bf16 or fp16 (cuDNN's attention), the family must have a
    plan and attention that dispatches through diffusers (``FlowModel.context_parallel_plan``), and every
    sequence the plan splits (``FlowModel.context_parallel_lengths``) and the heads (Ulysses) must divide by the
    degree. Returns None when context parallelism is off."""
    settings = config.distributed.context_parallel
    degree = settings.degree
    if degree == 1:
        return None
    if num_processes % degree:
        raise ConfigError(
            f"{KEY}: ulysses x ring = {settings.ulysses} x {settings.ring} = {degree} must divide the {num_processes} "
            f"processes of this launch (the data-parallel degree is their quotient): launch a multiple of {degree} "
            "processes or change ulysses/ring", key=f"{KEY}.ulysses")
    if settings.ring > 1 and device_type == "cpu":
        raise ConfigError(
            f"{KEY}.ring = {settings.ring}: ring attention needs an attention backend that returns the log-sum-exp "
            "(flash, cuDNN), and the only one on CPU (native scaled_dot_product_attention) does not: use "
            f"{KEY}.ulysses on CPU", key=f"{KEY}.ring")
    if settings.ring > 1 and not {config.model.mixed_precision, config.model.dtype} & {"bf16", "fp16"}:
        raise ConfigError(
            f"{KEY}.ring = {settings.ring} runs on cuDNN's attention, which computes in bf16 or fp16: set "
            "model.mixed_precision: bf16 (or use ulysses)", key=f"{KEY}.ring")
    from flowalign.models.loading import adapter_class

    adapter = adapter_class(config.model.path, config.model.family)
    model_dir = Path(config.model.path)
    transformer_config = _read_json(model_dir / "transformer" / "config.json")
    if transformer_config is None:  # a hub id: the lengths are checked once the model is loaded
        return _layout(num_processes, degree)
    import diffusers

    cls = getattr(diffusers, transformer_config.get("_class_name", ""), None)
    plan = adapter.context_parallel_plan(cls) if cls is not None else None
    if plan is None:
        raise refusal(adapter)
    heads = transformer_config.get("num_attention_heads")
    if settings.ulysses > 1 and isinstance(heads, int) and heads % settings.ulysses:
        raise ConfigError(f"{KEY}.ulysses = {settings.ulysses} must divide the transformer's {heads} attention heads "
                          "(Ulysses gives each process a share of the heads)", key=f"{KEY}.ulysses")
    lengths = adapter.context_parallel_lengths(model_dir, config)
    for name, length in lengths.items():
        if length % degree:
            raise ConfigError(
                f"{KEY}: the {name} of {length} tokens (sampling.image_size = {config.sampling.image_size}"
                + (f", sampling.num_frames = {config.sampling.num_frames}" if adapter.modality == "video" else "")
                + f") does not divide by the context-parallel degree {degree}: change the resolution"
                + (" or frames" if adapter.modality == "video" else "") + f", or the degree", key=KEY)
    return _layout(num_processes, degree)


def refusal(adapter: type) -> ConfigError:
    """The error for a family that cannot split its sequence (no plan, or one that cannot run), naming it and why."""
    return ConfigError(f"{KEY}: the {adapter.family} family cannot run context-parallel "
                       f"({adapter.context_parallel_refusal}): set {KEY}.ulysses and .ring to 1 for it", key=KEY)


def _layout(num_processes: int, degree: int) -> ContextParallelLayout:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return ContextParallelLayout(world_size=num_processes, rank=rank, degree=degree)


# ------------------------------------------------------------------------------------------------ enabling it
def _resolve_on_cpu(self, config):
    """``ModelMixin._resolve_parallel_config`` on a CPU (module docstring): the same steps, device ``cpu``."""
    from diffusers.models._modeling_parallel import ParallelConfig

    import torch.distributed as dist

    if not isinstance(config, ParallelConfig):
        config = ParallelConfig(context_parallel_config=config)
    cp = config.context_parallel_config
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=cp.mesh)
    self._parallel_config = config
    return config


def context_mesh(settings, device_type: str):
    """The 3D mesh ``(data, ring, ulysses)`` of all the processes; diffusers reads its ``ring`` x ``ulysses`` part."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed as dist

    data = dist.get_world_size() // settings.degree
    return init_device_mesh(device_type, (data, settings.ring, settings.ulysses),
                            mesh_dim_names=("data", "ring", "ulysses"))


def split_transformers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The diffusers transformers a plan applies to in ``module``: itself, or the experts of a module that holds
    several (Wan2.2 A14B's ``ExpertPair``: both experts get the plan)."""
    from diffusers import ModelMixin

    if isinstance(module, ModelMixin):
        return [module]
    return [child for child in module.children() if isinstance(child, ModelMixin)]


def enable_context_parallel(model, settings, device_type: str) -> None:
    """Split the sequence of ``model``'s transformer (each expert of a pair, and a full fine-tune's reference copy)
    over the context group of this process, through diffusers' ``enable_parallelism`` with the family's plan; every
    forward is then a collective (``collective_forwards``)."""
    from diffusers import ContextParallelConfig

    mesh = context_mesh(settings, device_type)
    tops = [model.transformer] + ([model.reference_transformer] if model.full_finetune else [])
    transformers = [transformer for top in tops for transformer in split_transformers(top)]
    for transformer in transformers or tops:
        plan = type(model).context_parallel_plan(type(transformer))
        if plan is None:  # a model given as an object, or a hub id: the check before loading could not read it
            raise refusal(type(model))
        cp_config = ContextParallelConfig(ulysses_degree=settings.ulysses, ring_degree=settings.ring,
                                          mesh=mesh["ring", "ulysses"])
        if device_type == "cpu":
            transformer._resolve_parallel_config = types.MethodType(_resolve_on_cpu, transformer)
        if settings.ring > 1:  # an attention backend that returns the log-sum-exp (module docstring)
            transformer.set_attention_backend(RING_BACKEND)
        transformer.enable_parallelism(config=cp_config, cp_plan=plan)
        type(model).after_context_parallel(transformer)
    model.collective_forwards = True
    model.context_parallel_degree = settings.degree
