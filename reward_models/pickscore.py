"""PickScore (Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image Generation").

A transformers ``CLIPModel`` (CLIP-H, fine-tuned on Pick-a-Pic; hub ``yuvalkirstain/PickScore_v1``) and the CLIP-H
processor (tokenizer and image-processor settings; hub ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). Both may be local
directories (what ``save_pretrained`` writes: ``config.json`` + weights; the tokenizer files +
``preprocessor_config.json``).

Preprocessing: resize the shorter side to the processor's ``size["shortest_edge"]`` (224, bicubic), centre crop to its
``crop_size``, normalise with its ``image_mean``/``image_std``; done in torch so ``forward`` is differentiable.
Score: ``logit_scale.exp() * cos(text, image)`` (about 100 x cos; around 20 to 23 for real images).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .base import RewardModel
from .images import normalize, resize_shortest_center_crop
from .weights import MissingWeightsError, looks_local, require_dir

__all__ = ["PickScore"]

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


def _pooled(output) -> Tensor:
    """transformers 5 returns a model output from ``get_*_features``; 4.x returned the tensor."""
    return output if isinstance(output, Tensor) else output.pooler_output


def _field(size, key: str):
    """A field of an image processor's size setting (a dict in transformers 4, a ``SizeDict`` in 5, or an int)."""
    if isinstance(size, int):
        return size
    value = getattr(size, key, None)
    return value if value is not None else size[key]


class PickScore(RewardModel):
    """``logit_scale.exp() * cos(text, image)`` of a CLIPModel (see module docstring)."""

    name = "pickscore"

    def __init__(self, model: str = PICKSCORE_MODEL, processor: str = PICKSCORE_PROCESSOR, *, device=None,
                 dtype="fp32", batch_size: int = 16, max_length: int = 77):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        for value, key, source, files in (
            (model, "model", f"the hub repository {PICKSCORE_MODEL}", ("config.json",)),
            (processor, "processor", f"the hub repository {PICKSCORE_PROCESSOR}", ("preprocessor_config.json",)),
        ):
            if looks_local(value):
                require_dir(value, reward=self.name, key=key, source=source, files=files)
        try:
            self.model = CLIPModel.from_pretrained(model, torch_dtype=self.dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(processor)
            image_processor = AutoImageProcessor.from_pretrained(processor)
        except OSError as error:
            raise MissingWeightsError(
                f"pickscore: could not load model {model!r} / processor {processor!r} ({error}). Without hub access, "
                f"download {PICKSCORE_MODEL} and {PICKSCORE_PROCESSOR} and pass their local directories as the "
                "reward's `model` and `processor` arguments (config keys reward.rewards[i].kwargs.model / .processor)."
            ) from error
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        self.max_length = max_length
        self.resize_to = int(_field(image_processor.size, "shortest_edge"))
        self.crop_to = int(_field(image_processor.crop_size, "height"))
        self.mean, self.std = tuple(image_processor.image_mean), tuple(image_processor.image_std)

    def preprocess(self, images: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> ``[B, 3, crop, crop]`` normalised pixels."""
        resized = resize_shortest_center_crop(images.float(), self.resize_to)
        if self.crop_to != self.resize_to:
            top = (self.resize_to - self.crop_to) // 2
            resized = resized[..., top : top + self.crop_to, top : top + self.crop_to]
        return normalize(resized, self.mean, self.std)

    def forward(self, images: Tensor, prompts: Sequence[str], metadata=None) -> Tensor:
        pixels = self.preprocess(images).to(self.dtype)
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        image_features = _pooled(self.model.get_image_features(pixel_values=pixels)).float()
        text_features = _pooled(self.model.get_text_features(input_ids=tokens["input_ids"],
                                                             attention_mask=tokens.get("attention_mask"))).float()
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        return self.model.logit_scale.exp().float() * (image_features * text_features).sum(dim=-1)
