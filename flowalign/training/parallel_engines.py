"""Distributed engines: how the transformer is laid out over the processes, stepped, and checkpointed.

The trainer asks its engine (``distributed.engine``) for four things, and knows nothing else about the layout:

* ``prepare(trainer)``: wrap the model for its forward passes and return the trainable parameters;
* ``optimizer(params, **adamw)`` and ``clip_grad_norm(params, max_norm)``;
* ``save(trainer, directory)`` / ``load(trainer, checkpoint)``: the trainable weights, their EMA and the optimizer
  state of a checkpoint (the rest of a checkpoint is ``flowalign.training.checkpoint_files``'s).

``ddp`` (the default): every process holds the whole model; with several processes accelerate wraps the transformer
in ``DistributedDataParallel``, which all-reduces the gradients. The main process writes ``trainable.safetensors``,
``ema.safetensors`` and ``optimizer.pt``.

``fsdp2``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, Zhao et al. 2023, "PyTorch FSDP"): every
transformer block is its own FSDP unit, then the transformer's root, so each parameter (and its gradient and Adam
state) is a DTensor sharded on dim 0 over the processes, all-gathered block by block for a forward and
reduce-scattered after the backward. A full fine-tune's frozen reference copy is sharded the same way. Compute runs
in ``model.mixed_precision`` (``MixedPrecisionPolicy(param_dtype=...)``) with fp32 gradient reduction. Checkpoints go
through ``torch.distributed.checkpoint`` into ``sharded/`` (every process writes its shards), which loads at any
process count: a run saved on 2 processes resumes on 1 or 4 with the same weights. The main process also writes the
diffusers-format weights (``lora/`` or ``transformer/``) from the all-gathered state. With one process FSDP2 still
runs, over a world of one (a single-rank process group), so a sharded run's files and code path are the same at every
scale. ``distributed.cpu_offload`` keeps the shards (and the optimizer step) in CPU memory, as
``model.reference_offload`` does for the reference copy alone (FSDP2's ``CPUOffloadPolicy``);
``distributed.replicate: R`` is HSDP, a 2D mesh of R copies each sharded over the processes / R consecutive ranks
(``data_mesh``). Every forward pass is a collective: the processes must run the same number of them, which the trainer's
layout guarantees for rollouts and training and ``collective_forwards`` asks of the evaluation.

DeepSpeed is not an engine: FSDP2 is the supported sharded engine (it is PyTorch's own, it runs and is tested on CPU
with gloo here, and it shards per parameter, so LoRA's trainable and frozen weights share a unit).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowalign.errors import SetupError
from flowalign.models.blocks import transformer_blocks
from flowalign.registry import Registry

__all__ = ["DDPEngine", "ENGINES", "Engine", "FSDP2Engine", "build_engine", "cpu_offload_policy", "data_mesh",
           "transformer_blocks"]

ENGINES: Registry = Registry("distributed engine")
MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    """The interface (module docstring); ``sharded`` engines write ``sharded/`` checkpoints."""

    name = "engine"
    sharded = False

    def __init__(self, config):
        self.config = config

    def check(self, config) -> None:
        """Refuse, before any model loads, a model or setting the engine cannot run."""

    def prepare(self, trainer) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def optimizer(self, trainer, params, **adamw) -> torch.optim.Optimizer:
        raise NotImplementedError

    def clip_grad_norm(self, trainer, params, max_norm: float) -> float:
        raise NotImplementedError


@ENGINES.register("ddp")
class DDPEngine(Engine):
    """Data parallelism: the whole model on every process, gradients all-reduced by DDP (module docstring)."""

    name = "ddp"

    def prepare(self, trainer) -> list[torch.nn.Parameter]:
        from flowalign.training.collectives import world_of

        model = trainer.model
        world = world_of(trainer.accelerator)
        if model.ddp_find_unused_parameters and world.num_processes > 1:
            from accelerate.utils import DistributedDataParallelKwargs

            world.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        if world.num_processes > 1:  # wrap before building the optimizer
            model.forward_module = trainer.accelerator.prepare(model.transformer)
        return [p for p in (model.forward_module or model.transformer).parameters() if p.requires_grad]

    def optimizer(self, trainer, params, **adamw) -> torch.optim.Optimizer:
        return trainer.accelerator.prepare(torch.optim.AdamW(params, **adamw))

    def clip_grad_norm(self, trainer, params, max_norm: float) -> float:
        return float(trainer.accelerator.clip_grad_norm_(params, max_norm))


def _meta_transformer(model_path: str, family: str | None):
    """The model's transformer built on the meta device from its config (no weights read), or None when the model
    directory cannot be read here (a hub id: the check then runs when the model loads)."""
    from flowalign.models.loading import adapter_class

    directory = Path(model_path)
    config_file = directory / "transformer" / "config.json"
    if not config_file.is_file():
        return None
    import json

    import diffusers

    config = json.loads(config_file.read_text())
    cls = getattr(diffusers, config.get("_class_name", ""), None)
    if cls is None:
        return None
    adapter_class(model_path, family)  # an unsupported pipeline is named first
    with torch.device("meta"):
        return cls.from_config(config)


def ensure_process_group(accelerator) -> None:
    """A process group FSDP2 can shard over: accelerate's, or with one process a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if accelerator.num_processes > 1:
        raise RuntimeError("distributed.engine = fsdp2: several processes but no torch.distributed process group")
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def data_mesh(device_type: str, world_size: int, replicate: int = 1):
    """The device mesh FSDP2 shards over: 1D over the processes, or with ``replicate > 1`` HSDP's 2D mesh
    ``(replicate, world_size / replicate)`` named ``("replicate", "shard")``: consecutive ranks shard one copy (the
    processes of a node, under torchrun's numbering), and the copies are replicas whose gradients are all-reduced."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicate == 1:
        return init_device_mesh(device_type, (world_size,))
    if world_size % replicate:
        raise SetupError(f"distributed.replicate = {replicate} does not divide the {world_size} processes")
    return init_device_mesh(device_type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard"))


def cpu_offload_policy(device: torch.device):
    """FSDP2's ``CPUOffloadPolicy``: shards in CPU memory, copied to ``device`` for each unit's compute; pinned host
    memory only where there is an accelerator to copy to (pinning needs one)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


@ENGINES.register("fsdp2")
class FSDP2Engine(Engine):
    """FSDP2 sharding per transformer block, DCP checkpoints (module docstring)."""

    name = "fsdp2"
    sharded = True

    def check(self, config) -> None:
        transformer = _meta_transformer(config.model.path, config.model.family)
        if transformer is not None and not transformer_blocks(transformer):
            raise SetupError(
                f"distributed.engine = fsdp2 shards the transformer per block, but {type(transformer).__name__} "
                f"({config.model.path}) has no nn.ModuleList of blocks among its children: use distributed.engine: "
                "ddp for this model")
        if config.model.dtype != "fp32" and config.model.mixed_precision == "no":
            raise SetupError(
                f"distributed.engine = fsdp2 with model.dtype = {config.model.dtype!r} needs model.mixed_precision = "
                f"{config.model.dtype!r}: FSDP2 all-gathers a block's weights in one dtype, and the trained weights "
                "are fp32")

    def prepare(self, trainer) -> list[torch.nn.Parameter]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

        import torch.distributed as dist

        accelerator, model = trainer.accelerator, trainer.model
        settings = trainer.config.distributed
        ensure_process_group(accelerator)
        mesh = data_mesh(accelerator.device.type, dist.get_world_size(), settings.replicate)
        policy = MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_DTYPES.get(trainer.config.model.mixed_precision),
                                      reduce_dtype=torch.float32)
        modules = [model.transformer] + ([model.reference_transformer] if model.full_finetune else [])
        for module in modules:
            offload = settings.cpu_offload or (model.reference_offload and module is model.reference_transformer)
            if model.reference_offload and module is model.reference_transformer:
                module.to(accelerator.device)  # sharded (and offloaded by FSDP2): the moves are FSDP2's
            blocks = transformer_blocks(module)
            if not blocks:
                raise SetupError(f"distributed.engine = fsdp2: {type(module).__name__} has no nn.ModuleList of "
                                 "blocks to shard; use distributed.engine: ddp for this model")
            layout = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward,
                          offload_policy=cpu_offload_policy(accelerator.device) if offload else OffloadPolicy())
            for block in blocks:
                fully_shard(block, **layout)
            fully_shard(module, **layout)
        model.reference_offload = False  # the reference is sharded (and offloaded by FSDP2) instead of moved
        model.collective_forwards = True  # every process must run the same number of forwards (evaluation)
        return [p for p in model.transformer.parameters() if p.requires_grad]

    def optimizer(self, trainer, params, **adamw) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **adamw)  # on the DTensor shards: each process steps its own

    def clip_grad_norm(self, trainer, params, max_norm: float) -> float:
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(total, "full_tensor"):  # the norm of sharded gradients: a DTensor to reduce
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    # ------------------------------------------------------------------------------------------- checkpoints
    def state(self, trainer) -> dict:
        """What a sharded checkpoint holds: the trainable weights, the optimizer, the EMA and the policy copies, as
        DTensors."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {"trainable": trainer.trainable_state(),
                 "optimizer": get_optimizer_state_dict(trainer.model.transformer, trainer.optimizer)}
        if trainer.ema is not None:
            state["ema"] = trainer.ema.state_dict()
        if trainer.copies:
            state["copies"] = trainer.copies.state_dict()
        return state

    def save(self, trainer, directory: Path) -> None:
        """Every process writes its shards into ``directory`` (``torch.distributed.checkpoint``)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state(trainer), checkpoint_id=str(directory))

    def load(self, trainer, directory: Path, *, ema: bool = True) -> None:
        """Load ``directory`` in place at this run's process count (DCP reshards), through
        ``flowalign.sharded_reading`` (nothing in the folder runs; a refused or damaged file is named); ``ema=False``
        leaves the EMA out (a checkpoint without one, resumed with ``train.restart_ema``)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from flowalign.sharded_reading import load_sharded

        state = self.state(trainer)
        if not ema:
            state.pop("ema", None)
        load_sharded(state, directory)
        set_optimizer_state_dict(trainer.model.transformer, trainer.optimizer, state["optimizer"])

    def export_state(self, trainer) -> dict[str, torch.Tensor]:
        """What the diffusers-format folder holds, all-gathered onto the main process's CPU (empty elsewhere;
        collective): the trainable weights of a LoRA run, the whole transformer state of a full fine-tune."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.model.transformer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.model.full_finetune:
            return state
        trainable = set(trainer.trainable_state())
        return {name: tensor for name, tensor in state.items() if name in trainable}


def build_engine(config) -> Engine:
    """The engine ``config.distributed.engine`` names, for ``config``."""
    return ENGINES.get(config.distributed.engine)(config)
