"""Model adapters: one FlowModel interface over diffusers' flow-matching text-to-image and text-to-video pipelines (the families in
docs/guides/adding-a-model.md), registered by family name in ``MODEL_FAMILIES`` (``register_model_family``)."""

from .base import MODEL_FAMILIES, Cond, FlowModel, register_model_family
from .chroma import ChromaModel
from .cogview4 import CogView4Model
from .flux import FluxModel, pack_latents, unpack_latents
from .flux2 import Flux2DevModel, Flux2KleinModel
from .flux_kontext import FluxKontextModel
from .hidream import HiDreamModel
from .loading import ADAPTERS, load_flow_model, resolve_dtype, wrap_pipeline
from .lumina2 import LUMINA2_ATTENTION_TARGETS, Lumina2Model
from .qwen_image import QwenImageModel
from .qwen_image_edit import QwenImageEditPlusModel
from .sana import SANA_ATTENTION_TARGETS, SanaModel
from .sd3 import JOINT_ATTENTION_TARGETS, SD3Model
from .video import VideoFlowModel
from .wan import WAN_LORA_TARGETS, WanModel
from .z_image import ZImageModel

__all__ = [
    "ADAPTERS",
    "JOINT_ATTENTION_TARGETS",
    "LUMINA2_ATTENTION_TARGETS",
    "MODEL_FAMILIES",
    "SANA_ATTENTION_TARGETS",
    "ChromaModel",
    "CogView4Model",
    "Cond",
    "FlowModel",
    "Flux2DevModel",
    "Flux2KleinModel",
    "FluxKontextModel",
    "FluxModel",
    "HiDreamModel",
    "load_flow_model",
    "Lumina2Model",
    "pack_latents",
    "QwenImageEditPlusModel",
    "QwenImageModel",
    "register_model_family",
    "resolve_dtype",
    "SanaModel",
    "SD3Model",
    "unpack_latents",
    "VideoFlowModel",
    "WAN_LORA_TARGETS",
    "WanModel",
    "wrap_pipeline",
    "ZImageModel",
]
