"""Small real diffusers pipelines built in-process, one per model family: no hub access needed.

The toy world pre-trains ``tiny_sd3_pipeline`` at its own sizes; tests build smaller ones the same way, as
diffusers' own tests do: randomly initialised components from diffusers / transformers configs at tiny widths and
depths (32 px images, 1-2 layers), seeded with ``seed``, over a word-level vocabulary (``words``). The tokenizers
(``flowalign.models.tiny.tokenizers``) save and load like any other; the shared text encoders and VAE are in
``flowalign.models.tiny.components``; each family's builder is in the module of its family.
"""

from .cogview4 import tiny_cogview4_pipeline
from .flux import tiny_chroma_pipeline, tiny_flux_kontext_pipeline, tiny_flux_pipeline
from .flux2 import tiny_flux2_klein_pipeline, tiny_flux2_pipeline
from .hidream import tiny_hidream_pipeline
from .hunyuan_video15 import tiny_hunyuan_video15_pipeline
from .kandinsky5 import tiny_kandinsky5_pipeline
from .ltx2 import tiny_ltx2_pipeline
from .ltx_video import tiny_ltx_pipeline
from .lumina2 import tiny_lumina2_pipeline
from .mochi import tiny_mochi_pipeline
from .qwen_image import tiny_qwen_image_pipeline
from .qwen_image_edit import tiny_qwen_image_edit_plus_pipeline
from .sana import tiny_sana_pipeline
from .sana_video import tiny_sana_video_pipeline
from .sd3 import tiny_sd3_pipeline
from .skyreels_v2 import tiny_skyreels_v2_i2v_pipeline, tiny_skyreels_v2_pipeline
from .wan import (tiny_wan22_i2v_pipeline, tiny_wan22_pipeline, tiny_wan22_ti2v_pipeline, tiny_wan_i2v_pipeline,
                  tiny_wan_pipeline)
from .tokenizers import chat_word_tokenizer, word_level_tokenizer
from .z_image import tiny_z_image_pipeline

__all__ = [
    "chat_word_tokenizer",
    "tiny_chroma_pipeline",
    "tiny_cogview4_pipeline",
    "tiny_flux2_klein_pipeline",
    "tiny_flux2_pipeline",
    "tiny_flux_kontext_pipeline",
    "tiny_flux_pipeline",
    "tiny_hidream_pipeline",
    "tiny_hunyuan_video15_pipeline",
    "tiny_kandinsky5_pipeline",
    "tiny_ltx2_pipeline",
    "tiny_ltx_pipeline",
    "tiny_lumina2_pipeline",
    "tiny_mochi_pipeline",
    "tiny_qwen_image_edit_plus_pipeline",
    "tiny_qwen_image_pipeline",
    "tiny_sana_pipeline",
    "tiny_sana_video_pipeline",
    "tiny_sd3_pipeline",
    "tiny_skyreels_v2_i2v_pipeline",
    "tiny_skyreels_v2_pipeline",
    "tiny_wan22_i2v_pipeline",
    "tiny_wan22_pipeline",
    "tiny_wan22_ti2v_pipeline",
    "tiny_wan_i2v_pipeline",
    "tiny_wan_pipeline",
    "tiny_z_image_pipeline",
    "word_level_tokenizer",
]
