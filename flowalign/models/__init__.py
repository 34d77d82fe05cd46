"""Model adapters: one FlowModel interface over diffusers' flow-matching text-to-image and text-to-video pipelines (the families in
docs/guides/adding-a-model.md), registered by family name in ``MODEL_FAMILIES`` (``register_model_family``)."""

from .base import MODEL_FAMILIES, Cond, FlowModel, register_model_family
from .chroma import ChromaModel
from .cogview4 import CogView4Model
from .flux import FluxModel, pack_latents, unpack_latents
from .flux2 import Flux2DevModel, Flux2KleinModel
from .flux_kontext import FluxKontextModel
from .hidream import HiDreamModel
from .hunyuan_video15 import HUNYUAN_VIDEO15_LORA_TARGETS, HunyuanVideo15Model
from .hunyuan_video15_i2v import HunyuanVideo15I2VModel
from .kandinsky5 import KANDINSKY5_LORA_TARGETS, Kandinsky5T2VModel
from .loading import ADAPTERS, load_flow_model, resolve_dtype, wrap_pipeline
from .ltx2 import LTX2_LORA_TARGETS, LTX2Model
from .ltx_video import LTX_LORA_TARGETS, LTXImageToVideoModel, LTXVideoModel
from .lumina2 import LUMINA2_ATTENTION_TARGETS, Lumina2Model
from .mochi import MOCHI_LORA_TARGETS, MochiModel
from .qwen_image import QwenImageModel
from .qwen_image_edit import QwenImageEditPlusModel
from .sana import SANA_ATTENTION_TARGETS, SanaModel
from .sana_video import SANA_VIDEO_LORA_TARGETS, SanaVideoModel
from .sd3 import JOINT_ATTENTION_TARGETS, SD3Model
from .skyreels_v2 import SkyReelsV2Model
from .skyreels_v2_i2v import SkyReelsV2I2VModel
from .video import VideoFlowModel
from .wan import WAN_LORA_TARGETS, WanModel
from .wan22 import Wan22I2VModel, Wan22Model
from .wan22_ti2v import WanTI2VImageModel, WanTI2VModel
from .wan_i2v import WanI2VModel
from .z_image import ZImageModel

__all__ = [
    "ADAPTERS",
    "JOINT_ATTENTION_TARGETS",
    "KANDINSKY5_LORA_TARGETS",
    "LTX2_LORA_TARGETS",
    "LTX2Model",
    "LTX_LORA_TARGETS",
    "LTXImageToVideoModel",
    "LTXVideoModel",
    "LUMINA2_ATTENTION_TARGETS",
    "MOCHI_LORA_TARGETS",
    "MODEL_FAMILIES",
    "MochiModel",
    "SANA_ATTENTION_TARGETS",
    "SANA_VIDEO_LORA_TARGETS",
    "ChromaModel",
    "CogView4Model",
    "Cond",
    "FlowModel",
    "Flux2DevModel",
    "Flux2KleinModel",
    "FluxKontextModel",
    "FluxModel",
    "HiDreamModel",
    "HUNYUAN_VIDEO15_LORA_TARGETS",
    "HunyuanVideo15I2VModel",
    "HunyuanVideo15Model",
    "Kandinsky5T2VModel",
    "load_flow_model",
    "Lumina2Model",
    "pack_latents",
    "QwenImageEditPlusModel",
    "QwenImageModel",
    "register_model_family",
    "resolve_dtype",
    "SanaModel",
    "SanaVideoModel",
    "SD3Model",
    "SkyReelsV2I2VModel",
    "SkyReelsV2Model",
    "unpack_latents",
    "VideoFlowModel",
    "WAN_LORA_TARGETS",
    "Wan22I2VModel",
    "Wan22Model",
    "WanI2VModel",
    "WanModel",
    "WanTI2VImageModel",
    "WanTI2VModel",
    "wrap_pipeline",
    "ZImageModel",
]
