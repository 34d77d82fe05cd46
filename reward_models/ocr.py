"""The ``ocr`` reward: Flow-GRPO's OCR score (``flowalign.reward_models.ocr_rule``) of the text a real OCR engine reads
in each image.

Engine: PP-OCRv4 text detection and recognition (``ch_PP-OCRv4_det_infer.onnx``, ``ch_PP-OCRv4_rec_infer.onnx``)
shipped inside the ``rapidocr-onnxruntime`` 1.4.4 wheel and run by ``onnxruntime`` on the CPU: no download, real
weights. Settings follow flow_grpo's ``PaddleOCR(use_angle_cls=False, lang="en")`` as far as the wheel allows: the
angle classifier is off (``use_cls=False``) and lines scoring below ``text_score`` 0.5 are dropped (PaddleOCR's
``drop_score`` 0.5); the detector keeps the wheel's own settings (``limit_side_len`` 736 of type ``min``,
``box_thresh`` 0.5, ``unclip_ratio`` 1.6).

Input as released (``flow_grpo/rewards.py::ocr_score``): ``(x * 255).round().clamp(0, 255)`` as uint8 ``H x W x 3`` in
RGB order, although both engines assume BGR for arrays; flowalign keeps the released order.

Departures from Flow-GRPO: the wheel's recogniser is the Chinese + English PP-OCRv4 model (PaddleOCR's ``lang="en"``
uses the English-dictionary ``en_PP-OCRv4_rec``, with the PP-OCRv3 detector), so it may read a glyph as a CJK or
full-width character, and its scores are not Flow-GRPO's: ``bench/ocr_agreement.py`` measures how often it reads
rendered targets exactly (docs/guides/ocr.md).

The extra: ``pip install -e '.[ocr]'``. Without it the reward is refused before any model loads (``check_run``), and
prompts without a quoted target are refused when the prompts load (``check_prompts``).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from flowalign.errors import RewardInputError

from .images import as_image_batch
from .ocr_rule import OCR_VARIANTS, check_ocr_prompt, ocr_reward_from_lines

__all__ = ["OCR_EXTRA", "OCR_PACKAGES", "OcrEngine", "OcrReward", "check_ocr_installed", "ocr_reward_from_lines",
           "to_ocr_pixels"]

logger = logging.getLogger(__name__)

# The packages the engine imports (module name, distribution) and the extra that installs them.
OCR_PACKAGES = (("rapidocr_onnxruntime", "rapidocr-onnxruntime"), ("onnxruntime", "onnxruntime"))
OCR_EXTRA = "pip install -e '.[ocr]'"
TEXT_SCORE = 0.5  # flow_grpo's PaddleOCR drop_score


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (None in ``sys.modules`` counts as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a __spec__
        return True


def check_ocr_installed(where: str = "reward") -> None:
    """ValueError naming ``where`` (the config entry or flag that asks for the reward) and the extra to install when
    the OCR engine's packages are missing; nothing is imported or loaded."""
    for module, distribution in OCR_PACKAGES:
        if not _installed(module):
            raise ValueError(f"the 'ocr' reward ({where}) needs the {distribution} package, which is not installed: "
                             f"install the ocr extra ({OCR_EXTRA})")


def to_ocr_pixels(images: Any) -> np.ndarray:
    """``images`` (``[B, 3, H, W]`` in [0, 1], or any input ``as_image_batch`` takes) as uint8 ``[B, H, W, 3]``:
    ``(x * 255).round().clamp(0, 255)``, the released conversion, channels kept in RGB order."""
    batch = as_image_batch(images)
    pixels = (batch * 255).round().clamp(0, 255).to(torch.uint8)
    return np.ascontiguousarray(pixels.permute(0, 2, 3, 1).cpu().numpy())


class OcrEngine:
    """PP-OCRv4 detection + recognition from the ``rapidocr-onnxruntime`` wheel (module docstring): one uint8
    ``H x W x 3`` image in, its ``(text, confidence)`` lines out, top to bottom and left to right."""

    def __init__(self, *, text_score: float = TEXT_SCORE, threads: int | None = None):
        check_ocr_installed("reward")
        from rapidocr_onnxruntime import RapidOCR

        settings: dict[str, Any] = {"use_cls": False, "text_score": float(text_score)}
        if threads is not None:
            settings["intra_op_num_threads"] = int(threads)
        self.engine = RapidOCR(**settings)

    def __call__(self, image: np.ndarray) -> list[tuple[str, float]]:
        """The lines read in ``image`` (uint8 ``H x W x 3``); ``[]`` when nothing is detected."""
        result, _ = self.engine(image, use_cls=False)
        if not result:
            return []
        return [(str(text), float(score)) for _box, text, score in result]


class OcrReward:
    """Flow-GRPO's OCR reward on PP-OCRv4 (module docstring): ``1 - min(d, |t|) / |t|`` per image, in [0, 1].

    Args:
        variant: ``flow_grpo`` (the released rule) or ``flow_factory`` (a prompt without quotes is its own target;
            no confidence filter), ``flowalign.reward_models.ocr_rule``.
        text_score: lines the recogniser scores below this are dropped (PaddleOCR's ``drop_score`` 0.5).
        threads: onnxruntime's intra-op threads (None: onnxruntime's default, one per physical core).
    """

    name = "ocr"
    differentiable = False
    score_range = (0.0, 1.0)

    def __init__(self, variant: Literal["flow_grpo", "flow_factory"] = "flow_grpo", text_score: float = TEXT_SCORE,
                 threads: int | None = None):
        if variant not in OCR_VARIANTS:
            raise ValueError(f"ocr: unknown variant {variant!r}: expected one of {', '.join(OCR_VARIANTS)}")
        if not 0.0 <= float(text_score) <= 1.0:
            raise ValueError(f"ocr: text_score must be in [0, 1], got {text_score!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"ocr: threads must be an integer >= 1 or None, got {threads!r}")
        self.variant = variant
        self.engine = OcrEngine(text_score=text_score, threads=threads)

    @classmethod
    def check_run(cls, kwargs: Mapping[str, Any], *, key: str, model: str | None = None,
                  image_size: Any = None) -> None:
        """Before the reward is built and before any model loads (``flowalign.rewards.check_reward_run``): the ocr
        extra is installed; the error names ``key`` (the reward's kwargs key, less ``.kwargs``)."""
        check_ocr_installed(key.removesuffix(".kwargs"))

    @classmethod
    def check_prompts(cls, prompts: Sequence[Mapping[str, Any]], *, kwargs: Mapping[str, Any], key: str,
                      path: Any) -> None:
        """When the prompts load: ValueError naming ``key``, ``path`` and the first prompt the rule cannot score (no
        quoted target under ``flow_grpo``, or an empty one)."""
        variant = kwargs.get("variant", "flow_grpo")
        if variant not in OCR_VARIANTS:  # the kwargs check names the setting (flowalign.rewards.check_reward_kwargs)
            return
        for index, entry in enumerate(prompts):
            prompt = entry["prompt"] if isinstance(entry, Mapping) else entry
            try:
                check_ocr_prompt(prompt, variant=variant)
            except ValueError as error:
                raise ValueError(f"{key}: the 'ocr' reward cannot score prompt {index + 1} of {path}: "
                                 f"{error}") from None

    def check_inputs(self, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None) -> None:
        """The reward protocol's input check: every prompt has a target; else ``RewardInputError`` naming
        ``prompts[i]``."""
        for index, prompt in enumerate(prompts):
            try:
                check_ocr_prompt(prompt, variant=self.variant)
            except (TypeError, ValueError) as error:
                raise RewardInputError(f"prompts[{index}]: {error}") from None

    def read(self, images: Any) -> list[list[tuple[str, float]] | None]:
        """The engine's lines for each image (None where the engine raised: the released rule scores it 0)."""
        lines: list[list[tuple[str, float]] | None] = []
        for image in to_ocr_pixels(images):
            try:
                lines.append(self.engine(image))
            except Exception as error:  # the released except-branch: an engine failure scores 0, the run goes on
                logger.warning("ocr: the engine failed on an image (%s: %s); it scores 0", type(error).__name__, error)
                lines.append(None)
        return lines

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
                 ) -> Tensor:
        """Scores ``[B]`` float64 on the CPU."""
        prompts = list(prompts)
        self.check_inputs(prompts)
        lines = self.read(images)
        if len(lines) != len(prompts):
            raise ValueError(f"ocr: got {len(lines)} images but {len(prompts)} prompts")
        return torch.tensor([ocr_reward_from_lines(p, read, variant=self.variant) for p, read in zip(prompts, lines)],
                            dtype=torch.float64)

    def __repr__(self) -> str:
        return f"OcrReward(variant={self.variant!r})"
