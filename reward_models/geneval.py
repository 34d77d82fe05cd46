"""GenEval as a reward: detect objects, classify colours, judge with GenEval's rules (binary or partial credit).

Detectors (``detector=``):

* ``"mask2former"``: ``Mask2FormerDetector`` (COCO instances) plus ``ColorClassifier`` for the objects of every class
  that the prompt's metadata asks a colour of (GenEval's real pipeline; see those modules). Only the objects the
  rules can read get a colour: those above the tag's score threshold, at most 16 per class.
* ``"toy"``: the toy world's classical detector (shapes and colours of flat scenes).

``GenEvalDetections(...)(images, metadata)`` returns GenEval-format detections, one dict ``{class: [{"box", "score",
"color"?}, ...]}`` per image, which ``flowalign.evaluation.geneval.judge`` scores. ``GenEvalReward`` wraps it as a
reward; the metadata (``tag``, ``include``, ``exclude``, ``prompt``) comes from the prompt dataset, i.e. the train
config's prompt file must be GenEval jsonl. Partial credit is the fraction of satisfied include/exclude clauses (see
``flowalign.toy.reward`` for the exact definition, shared by both detectors). Not differentiable.

The rule engine (``flowalign.evaluation.geneval``) is a dependency-free module of the core package; importing it from
here is the one place reward models reach into the core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowalign.evaluation.geneval import COUNTING_SCORE_THRESHOLD, MAX_OBJECTS_PER_CLASS, SCORE_THRESHOLD

from .images import as_image_batch

__all__ = ["DETECTORS", "GenEvalDetections", "GenEvalReward", "colour_classes"]

DETECTORS = ("mask2former", "toy")


def colour_classes(metadata: Mapping[str, Any]) -> set[str]:
    """The classes whose colour the prompt's include clauses ask about."""
    return {clause["class"] for clause in metadata.get("include", []) if "color" in clause}


def _check_metadata(metadata: Sequence[Any], batch: int) -> None:
    if len(metadata) != batch:
        raise ValueError(f"geneval: got {batch} images but {len(metadata)} metadata entries")
    for index, entry in enumerate(metadata):
        if not isinstance(entry, Mapping) or "include" not in entry or "tag" not in entry:
            raise ValueError(
                f"geneval: metadata[{index}] is {entry!r}, not a GenEval entry with 'tag' and 'include'; the prompt "
                "dataset must be GenEval jsonl (one {tag, prompt, include, exclude} object per line)"
            )


class GenEvalDetections:
    """Images + metadata -> GenEval detections with the chosen detector (see module docstring)."""

    def __init__(self, detector: str = "mask2former", *, detector_model: str | None = None,
                 clip_weights: str = "openai", class_names: Sequence[str] | str | None = None, device=None,
                 dtype="fp32", detector_instance=None, color_classifier=None):
        if detector not in DETECTORS:
            raise ValueError(f"geneval: unknown detector {detector!r}: expected one of {', '.join(DETECTORS)}")
        self.kind = detector
        self.detector = detector_instance
        self.color_classifier = color_classifier
        if detector == "mask2former":
            from .color import ColorClassifier
            from .detection import MASK2FORMER_COCO, Mask2FormerDetector

            if self.detector is None:
                self.detector = Mask2FormerDetector(detector_model or MASK2FORMER_COCO, class_names=class_names,
                                                    device=device, dtype=dtype)
            if self.color_classifier is None:
                self.color_classifier = ColorClassifier(clip_weights, device=device, dtype=dtype)

    def __call__(self, images: Any, metadata: Sequence[Mapping[str, Any]]) -> list[dict]:
        batch = as_image_batch(images)
        _check_metadata(metadata, batch.shape[0])
        if self.kind == "toy":
            from flowalign.toy.detector import detect_batch

            return detect_batch(batch)
        return [self._with_colours(image, instances, entry)
                for image, instances, entry in zip(batch, self.detector(batch), metadata)]

    def _with_colours(self, image: Tensor, instances: list[dict], metadata: Mapping[str, Any]) -> dict:
        """Group instances by class (best score first) and fill ``color`` where the prompt asks for one."""
        detections: dict[str, list[dict]] = {}
        for instance in instances:
            detections.setdefault(instance["class"], []).append(
                {"box": instance["box"], "score": instance["score"], "mask": instance["mask"]}
            )
        for objects in detections.values():
            objects.sort(key=lambda obj: obj["score"], reverse=True)
        threshold = COUNTING_SCORE_THRESHOLD if metadata["tag"] == "counting" else SCORE_THRESHOLD
        for class_name in colour_classes(metadata):
            # only the objects the rules can look at: above the tag's threshold, the top 16 of the class
            kept = [obj for obj in detections.get(class_name, []) if obj["score"] > threshold][:MAX_OBJECTS_PER_CLASS]
            for obj, colour in zip(kept, self.color_classifier.classify(image, kept, class_name)):
                obj["color"] = colour
        for objects in detections.values():
            for obj in objects:
                del obj["mask"]  # judged on boxes; masks are large and not JSON
        return detections


class GenEvalReward:
    """1.0 when GenEval judges the image correct, else 0.0; or the fraction of satisfied clauses (partial credit)."""

    reads_geneval_metadata = True  # scores a prompt by its GenEval metadata (tag, include clauses)
    differentiable = False

    def __init__(self, detector: str = "mask2former", partial_credit: bool = False, **detector_kwargs: Any):
        self.detections = GenEvalDetections(detector, **detector_kwargs)
        self.partial_credit = bool(partial_credit)
        self.name = "geneval"

    def __call__(self, images: Any, prompts: Sequence[str] | None, metadata: Sequence[Mapping[str, Any]]) -> Tensor:
        return torch.tensor([v["partial" if self.partial_credit else "correct"]
                             for v in self.verdicts(images, metadata)], dtype=torch.float32)

    def verdicts(self, images: Any, metadata: Sequence[Mapping[str, Any]]) -> list[dict]:
        """Per image: ``correct`` (bool), ``partial`` (float), ``reason`` and the ``detections`` judged."""
        from flowalign.evaluation.geneval import judge
        from flowalign.toy.reward import clause_credit

        batch = as_image_batch(images)
        size = (int(batch.shape[3]), int(batch.shape[2]))
        results = []
        for entry, found in zip(metadata, self.detections(batch, metadata)):
            correct, reason = judge(entry, found, size)
            satisfied, total = clause_credit(entry, found, size)
            results.append({"correct": bool(correct), "partial": 1.0 if correct else satisfied / total,
                            "reason": reason, "detections": found})
        return results
