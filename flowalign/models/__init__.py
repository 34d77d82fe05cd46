"""Model adapters: one FlowModel interface over diffusers' flow pipelines (SD3/3.5 and FLUX built in), registered by
family name in ``MODEL_FAMILIES`` (``register_model_family``)."""

from .base import MODEL_FAMILIES, Cond, FlowModel, register_model_family
from .flux import FluxModel, pack_latents, unpack_latents
from .flux2 import Flux2KleinModel
from .qwen_image import QwenImageModel
from .loading import ADAPTERS, load_flow_model, resolve_dtype, wrap_pipeline
from .sd3 import JOINT_ATTENTION_TARGETS, SD3Model
from .z_image import ZImageModel

__all__ = [
    "ADAPTERS",
    "MODEL_FAMILIES",
    "JOINT_ATTENTION_TARGETS",
    "Cond",
    "FlowModel",
    "Flux2KleinModel",
    "FluxModel",
    "QwenImageModel",
    "SD3Model",
    "ZImageModel",
    "load_flow_model",
    "pack_latents",
    "register_model_family",
    "resolve_dtype",
    "unpack_latents",
    "wrap_pipeline",
]
