"""Condition images of editing prompts: a prompt file entry ``{"prompt": ..., "images": ["path", ...]}``.

Paths are relative to the prompt file (absolute ones are kept). The loaders (``flowalign.data.prompts.load_prompts``,
``flowalign.evaluation.geneval.load_metadata``) replace them by absolute paths, after checking each exists, so the
entry that reaches a reward as its metadata (``metadata["images"]``) names files it can open. ``encode_kwargs``
turns a batch of entries into ``model.encode``'s ``images=`` (each prompt's images as RGB PIL images), or nothing
when no entry has any, so a text-to-image run calls ``encode`` exactly as before. ``check_family_takes`` refuses,
before any model loads, a prompt file with condition images for a family that takes none.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["IMAGES_KEY", "check_family_takes", "encode_kwargs", "has_condition_images", "load_condition_image",
           "resolve_entry_images"]

IMAGES_KEY = "images"


def resolve_entry_images(entry: dict, base: Path, where: str) -> None:
    """Replace ``entry["images"]`` (a list of paths relative to ``base``) by absolute path strings; ValueError
    naming ``where`` (the file and line) for a malformed list or a path that does not exist."""
    if IMAGES_KEY not in entry:
        return
    paths = entry[IMAGES_KEY]
    if not isinstance(paths, list) or not all(isinstance(p, str) and p.strip() for p in paths):
        raise ValueError(f"{where}: 'images' must be a list of image paths (relative to the prompt file), got "
                         f"{paths!r}")
    resolved = []
    for path in paths:
        full = (base / Path(path).expanduser()).resolve()
        if not full.is_file():
            raise ValueError(f"{where}: condition image {path!r} does not exist (looked for {full}; paths are "
                             "relative to the prompt file)")
        resolved.append(str(full))
    entry[IMAGES_KEY] = resolved


def has_condition_images(entries: Sequence[Mapping[str, Any]]) -> bool:
    return any(entry.get(IMAGES_KEY) for entry in entries)


@lru_cache(maxsize=256)
def load_condition_image(path: str):
    """The RGB PIL image at ``path`` (cached: a prompt's images are read once per run, not once per iteration)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def encode_kwargs(entries: Sequence[Mapping[str, Any]]) -> dict:
    """``{"images": [each entry's images as PIL images]}`` for ``model.encode`` when an entry has condition images,
    else ``{}``."""
    if not has_condition_images(entries):
        return {}
    return {IMAGES_KEY: [[load_condition_image(p) for p in entry.get(IMAGES_KEY) or ()] for entry in entries]}


def check_family_takes(adapter: type, entries: Sequence[Mapping[str, Any]], key: str, path: Any) -> None:
    """ValueError naming ``key`` (the setting that gave the prompt file ``path``) and the model family when the
    entries carry condition images the family (its adapter class) does not take, or more per prompt than it takes,
    or when the family needs one per prompt (``requires_condition_images``: the image-to-video families) and an
    entry has none."""
    with_images = [entry for entry in entries if entry.get(IMAGES_KEY)]
    family = getattr(adapter, "family", "") or adapter.__name__
    if getattr(adapter, "requires_condition_images", False):
        missing = next((entry for entry in entries if not entry.get(IMAGES_KEY)), None)
        if missing is not None:
            raise ValueError(f"{key} = {path}: model family {family!r} generates each video from a condition image, "
                             f"but the prompt {missing.get('prompt')!r} has none: give every entry one "
                             "(\"images\": [path], relative to the prompt file)")
    if not with_images:
        return
    if not getattr(adapter, "takes_condition_images", False):
        from flowalign.models.base import MODEL_FAMILIES

        editing = [name for name in MODEL_FAMILIES if MODEL_FAMILIES.get(name).takes_condition_images]
        raise ValueError(f"{key} = {path} gives prompts condition images (e.g. {with_images[0]['prompt']!r}), but "
                         f"model family {family!r} takes none: use an editing model "
                         f"({', '.join(editing) or 'none registered'}) or a prompt file without 'images'")
    most = getattr(adapter, "max_condition_images", None)
    over = next((entry for entry in with_images if most is not None and len(entry[IMAGES_KEY]) > most), None)
    if over is not None:
        raise ValueError(f"{key} = {path}: the prompt {over['prompt']!r} has {len(over[IMAGES_KEY])} condition "
                         f"images, but model family {family!r} takes at most {most} per prompt")
