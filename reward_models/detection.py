"""COCO instance detection for GenEval with transformers' Mask2Former.

GenEval's reference detector is mmdetection's Mask2Former (Swin-S, COCO instances). Here the same architecture comes
from transformers (``facebook/mask2former-swin-small-coco-instance``, or a local directory holding its
``config.json``, weights and ``preprocessor_config.json``). For every image it returns the instances of
``post_process_instance_segmentation`` (the query x class pairs ranked by class probability times mask score, with no
score threshold: GenEval's rules apply their own), each as

    {"class": name, "score": s, "box": (x1, y1, x2, y2), "mask": bool [H, W]}

where the box is the tight box of the mask in pixels (x2, y2 exclusive), as mmdetection derives Mask2Former's boxes
from its masks. Instances with an empty mask are dropped.

Class names: the detector's label ids are COCO's 80 classes in the standard order. GenEval names some of them
differently from COCO's label map ("computer mouse" for "mouse", "tv remote" for "remote", ...); ``GENEVAL_ALIASES``
renames them, and ``class_names`` (a list, or a path to GenEval's ``object_names.txt``, one name per label id) overrides
the label map entirely.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .base import resolve_device, resolve_dtype
from .images import as_image_batch
from .weights import MissingWeightsError, looks_local, require_dir

__all__ = ["GENEVAL_ALIASES", "MASK2FORMER_COCO", "Mask2FormerDetector", "mask_box"]

MASK2FORMER_COCO = "facebook/mask2former-swin-small-coco-instance"
GENEVAL_ALIASES = {
    "mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard", "tvmonitor": "tv",
    "motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "diningtable": "dining table",
    "pottedplant": "potted plant", "hair dryer": "hair drier",
}


def mask_box(mask: np.ndarray) -> tuple[float, float, float, float] | None:
    """The tight box ``(x1, y1, x2, y2)`` of a boolean mask, x2/y2 exclusive; None for an empty mask."""
    rows, cols = np.any(mask, axis=1), np.any(mask, axis=0)
    if not rows.any():
        return None
    y1, y2 = np.flatnonzero(rows)[[0, -1]]
    x1, x2 = np.flatnonzero(cols)[[0, -1]]
    return float(x1), float(y1), float(x2 + 1), float(y2 + 1)


def _read_class_names(class_names: Sequence[str] | str | Path) -> list[str]:
    if isinstance(class_names, (str, Path)):
        path = Path(class_names)
        if not path.is_file():
            raise FileNotFoundError(f"class_names file {str(path)!r} does not exist (expected GenEval's "
                                    "object_names.txt: one class name per line, in label-id order)")
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return list(class_names)


class Mask2FormerDetector:
    """Instances of COCO classes in images ``[B, 3, H, W]`` in [0, 1] (see module docstring)."""

    def __init__(self, model: str = MASK2FORMER_COCO, *, class_names: Sequence[str] | str | None = None,
                 device=None, dtype="fp32", batch_size: int = 4):
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        if looks_local(model):
            require_dir(model, reward="mask2former", key="detector_model", source=f"the hub repository {MASK2FORMER_COCO}",
                        files=("config.json", "preprocessor_config.json"))
        self.device, self.dtype, self.batch_size = resolve_device(device), resolve_dtype(dtype), batch_size
        try:
            self.model = Mask2FormerForUniversalSegmentation.from_pretrained(model, torch_dtype=self.dtype)
            self.processor = AutoImageProcessor.from_pretrained(model)
        except OSError as error:
            raise MissingWeightsError(
                f"mask2former: could not load {model!r} ({error}). Without hub access, download {MASK2FORMER_COCO} "
                "and pass its local directory as `detector_model` (config key reward.rewards[i].kwargs.detector_model, "
                "or --detector-model for `flowalign eval geneval`)."
            ) from error
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        id2label = self.model.config.id2label
        if class_names is not None:
            names = _read_class_names(class_names)
            if len(names) != len(id2label):
                raise ValueError(f"class_names has {len(names)} names but the detector has {len(id2label)} labels")
        else:
            names = [GENEVAL_ALIASES.get(id2label[i], id2label[i]) for i in range(len(id2label))]
        self.class_names = names

    @torch.no_grad()
    def __call__(self, images: Any) -> list[list[dict]]:
        batch = as_image_batch(images)
        pixels = (batch * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        found: list[list[dict]] = []
        for start in range(0, len(pixels), self.batch_size):
            chunk = list(pixels[start : start + self.batch_size])
            inputs = self.processor(images=chunk, return_tensors="pt")
            inputs = {k: (v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device))
                      for k, v in inputs.items()}
            outputs = self.model(**inputs)
            sizes = [image.shape[:2] for image in chunk]
            results = self.processor.post_process_instance_segmentation(
                outputs, threshold=0.0, target_sizes=sizes, return_binary_maps=True
            )
            found.extend(self._instances(result) for result in results)
        return found

    def _instances(self, result: dict) -> list[dict]:
        segmentation = result["segmentation"]
        if segmentation is None:
            return []
        masks = segmentation.bool().cpu().numpy()
        instances = []
        for index, info in enumerate(result["segments_info"]):
            box = mask_box(masks[index])
            if box is not None:
                instances.append({"class": self.class_names[info["label_id"]], "score": float(info["score"]),
                                  "box": box, "mask": masks[index]})
        return instances
