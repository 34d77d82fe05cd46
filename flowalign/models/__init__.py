"""Model adapters: one FlowModel interface over diffusers' SD3/3.5 and FLUX pipelines."""

from .base import Cond, FlowModel
from .flux import FluxModel, pack_latents, unpack_latents
from .loading import ADAPTERS, load_flow_model, resolve_dtype, wrap_pipeline
from .sd3 import JOINT_ATTENTION_TARGETS, SD3Model

__all__ = [
    "ADAPTERS",
    "JOINT_ATTENTION_TARGETS",
    "Cond",
    "FlowModel",
    "FluxModel",
    "SD3Model",
    "load_flow_model",
    "pack_latents",
    "resolve_dtype",
    "unpack_latents",
    "wrap_pipeline",
]
