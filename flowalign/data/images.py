"""Image-caption datasets: the (image, prompt) pairs the objectives on data train on.

A dataset is a JSONL index, one object per line with the image's path (relative to the index's folder) and its
caption; other keys are kept but not read:

    {"image": "images/00000.png", "prompt": "a photo of a red circle"}

``path`` may name the JSONL file itself or a folder holding ``metadata.jsonl`` (the layout of Hugging Face's
``imagefolder``). Reading the index checks every line and that every image exists, naming the file and line at
fault; images load on demand as float tensors in [0, 1], ``[3, H, W]``, resized to cover the requested size and
centre-cropped (an image already at that size is used pixel for pixel).

On the toy world real data is free: the dataset ``toy`` (or ``toy:N``, N renders per prompt, 8 by default) is the
exact scene of every training prompt, rendered on demand by ``flowalign.toy.scenes`` (``ToySceneDataset``): row ``i``
is prompt ``i mod P`` with the layout drawn from the generator keyed ``(TOY_DATA_SEED, i)``, so every process and every
run reads the same images without a file. ``open_image_dataset`` and ``check_image_dataset`` take either kind of
name; the objectives and reward fitting read data through them.

``write_toy_dataset`` renders toy scenes with their captions into a folder, for tests and for the image-folder path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["ImageCaptionDataset", "ImageRecord", "ToySceneDataset", "check_image_dataset", "index_path", "load_image",
           "open_image_dataset", "read_records", "write_toy_dataset"]

METADATA = "metadata.jsonl"
TOY_DATA_SEED = 7919  # key of the toy dataset's layouts (distinct from every training seed's purpose keys)
TOY_RENDERS_PER_PROMPT = 8


@dataclass(frozen=True)
class ImageRecord:
    """One line of the index: the image file (resolved), its caption, and where the line is (for messages)."""

    image: Path
    prompt: str
    source: str  # "index.jsonl:12"


def index_path(path: str | PathLike[str]) -> Path:
    """The JSONL index ``path`` names: the file itself, or ``metadata.jsonl`` in a folder."""
    path = Path(path)
    if path.is_dir():
        index = path / METADATA
        if not index.is_file():
            raise FileNotFoundError(f"image dataset folder {str(path)!r} has no {METADATA} (one "
                                    '{"image": "relative/path.png", "prompt": "..."} per line)')
        return index
    if not path.is_file():
        raise FileNotFoundError(f"image dataset {str(path)!r} does not exist (give a JSONL file or a folder with "
                                f"{METADATA})")
    return path


def read_records(path: str | PathLike[str]) -> list[ImageRecord]:
    """Every line of the index, checked: valid JSON objects with a string ``prompt`` and an existing ``image``."""
    index = index_path(path)
    records = []
    for number, line in enumerate(index.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{index}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object {{\"image\": ..., \"prompt\": ...}}, got "
                             f"{type(entry).__name__}")
        for key in ("image", "prompt"):
            if key not in entry:
                raise ValueError(f"{where}: missing key {key!r} (each line needs \"image\" and \"prompt\")")
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f"{where}: {key!r} must be a non-empty string, got {entry[key]!r}")
        image = index.parent / entry["image"]
        if not image.is_file():
            raise FileNotFoundError(f"{where}: image {entry['image']!r} not found (looked for {image})")
        records.append(ImageRecord(image, entry["prompt"], where))
    if not records:
        raise ValueError(f"image dataset {str(index)!r} has no entries")
    return records


def load_image(path: str | PathLike[str], size: int | Sequence[int]) -> Tensor:
    """An RGB image as ``[3, H, W]`` float in [0, 1]: scaled (bicubic) to cover ``size`` and centre-cropped."""
    from PIL import Image

    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB")
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read image {str(path)!r}: {error}") from None
    if image.size != (width, height):
        scale = max(width / image.width, height / image.height)
        resized = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
        image = image.resize(resized, Image.Resampling.BICUBIC)
        left, top = (image.width - width) // 2, (image.height - height) // 2
        image = image.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())
    return pixels.permute(2, 0, 1).float() / 255


class ImageCaptionDataset:
    """The records of an index (``read_records``), with images loaded at ``size`` (an int or ``(H, W)``)."""

    def __init__(self, path: str | PathLike[str], size: int | Sequence[int]):
        self.path = Path(path)
        self.size = size
        self.records = read_records(path)

    def __len__(self) -> int:
        return len(self.records)

    def prompt(self, index: int) -> str:
        return self.records[index].prompt

    def image(self, index: int) -> Tensor:
        record = self.records[index]
        try:
            return load_image(record.image, self.size)
        except ValueError as error:
            raise ValueError(f"{record.source}: {error}") from None

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, list[str]]:
        """``([B, 3, H, W] images in [0, 1], B prompts)`` for the given indices."""
        indices = [int(i) for i in indices]
        return torch.stack([self.image(i) for i in indices]), [self.prompt(i) for i in indices]


def write_toy_dataset(folder: str | PathLike[str], count: int, *, seed: int = 0, size: int = 32) -> Path:
    """Render ``count`` toy scenes for the toy world's training prompts (cycled) into ``folder``: ``images/*.png``
    and ``metadata.jsonl``. Returns the folder (a dataset path)."""
    from PIL import Image

    from flowalign.toy.prompts import split_prompts
    from flowalign.toy.scenes import render, scene_for

    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    prompts, _ = split_prompts()
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(count):
        entry = prompts[int(rng.integers(len(prompts)))]
        name = f"images/{k:05d}.png"
        Image.fromarray(render(scene_for(entry, rng, size), size)).save(folder / name)
        lines.append(json.dumps({"image": name, "prompt": entry["prompt"], "tag": entry["tag"]}))
    (folder / METADATA).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


class ToySceneDataset:
    """The toy world's data: ``renders`` exact scenes of each training prompt (``flowalign.toy.prompts.split_prompts``),
    rendered on demand at ``size`` (square), with the ``ImageCaptionDataset`` interface."""

    def __init__(self, size: int | Sequence[int], renders: int = TOY_RENDERS_PER_PROMPT):
        from flowalign.toy.prompts import split_prompts

        height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if height != width:
            raise ValueError(f"the toy dataset renders square scenes; got image size {height}x{width}")
        if renders < 1:
            raise ValueError(f"renders per prompt must be >= 1, got {renders}")
        self.size, self.renders = height, renders
        self.entries, _ = split_prompts()

    def __len__(self) -> int:
        return len(self.entries) * self.renders

    def entry(self, index: int) -> dict:
        """The GenEval-style metadata of row ``index`` (its prompt's)."""
        return self.entries[index % len(self.entries)]

    def prompt(self, index: int) -> str:
        return self.entry(index)["prompt"]

    def image(self, index: int) -> Tensor:
        from flowalign.seeding import numpy_rng
        from flowalign.toy.scenes import render, scene_for

        pixels = render(scene_for(self.entry(index), numpy_rng(TOY_DATA_SEED, index), self.size), self.size)
        return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float() / 255

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, list[str]]:
        """``([B, 3, H, W] images in [0, 1], B prompts)`` for the given indices."""
        indices = [int(i) for i in indices]
        return torch.stack([self.image(i) for i in indices]), [self.prompt(i) for i in indices]


def _toy_renders(name: str) -> int | None:
    """N for a dataset name ``toy`` / ``toy:N``; None for any other name (a path)."""
    if name != "toy" and not name.startswith("toy:"):
        return None
    if name == "toy":
        return TOY_RENDERS_PER_PROMPT
    count = name.split(":", 1)[1]
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"image dataset {name!r}: write 'toy' or 'toy:N' with N >= 1 renders per prompt")
    return int(count)


def check_image_dataset(name: str | PathLike[str]) -> int:
    """Start-up check of a dataset name: ``toy[:N]``, or an index whose every line is valid (``read_records``).
    Returns the dataset's number of rows, found without decoding an image."""
    renders = _toy_renders(str(name))
    if renders is None:
        return len(read_records(name))
    from flowalign.toy.prompts import split_prompts

    return len(split_prompts()[0]) * renders


def open_image_dataset(name: str | PathLike[str], size: int | Sequence[int]) -> "ImageCaptionDataset | ToySceneDataset":
    """The dataset ``name`` names at ``size``: the toy scenes for ``toy[:N]``, else an image-caption index."""
    renders = _toy_renders(str(name))
    return ImageCaptionDataset(name, size) if renders is None else ToySceneDataset(size, renders)
