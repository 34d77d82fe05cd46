"""Model adapters: one FlowModel interface over diffusers' flow pipelines (SD3/3.5, FLUX and FLUX.1-Kontext built
in), registered by family name in ``MODEL_FAMILIES`` (``register_model_family``)."""

from .base import MODEL_FAMILIES, Cond, FlowModel, register_model_family
from .chroma import ChromaModel
from .flux import FluxModel, pack_latents, unpack_latents
from .flux_kontext import FluxKontextModel
from .loading import ADAPTERS, load_flow_model, resolve_dtype, wrap_pipeline
from .lumina2 import LUMINA2_ATTENTION_TARGETS, Lumina2Model
from .sana import SANA_ATTENTION_TARGETS, SanaModel
from .sd3 import JOINT_ATTENTION_TARGETS, SD3Model

__all__ = [
    "ADAPTERS",
    "MODEL_FAMILIES",
    "JOINT_ATTENTION_TARGETS",
    "LUMINA2_ATTENTION_TARGETS",
    "ChromaModel",
    "Cond",
    "FlowModel",
    "FluxKontextModel",
    "FluxModel",
    "Lumina2Model",
    "SANA_ATTENTION_TARGETS",
    "SD3Model",
    "SanaModel",
    "load_flow_model",
    "pack_latents",
    "register_model_family",
    "resolve_dtype",
    "unpack_latents",
    "wrap_pipeline",
]
