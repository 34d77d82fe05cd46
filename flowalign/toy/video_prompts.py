"""The toy video world's prompts, in GenEval's metadata format plus the motion, and their fixed train/test split.

Vocabulary: the image world's three shapes and six colours, counts 1-3 and the five directions of
:data:`~flowalign.toy.clips.DIRECTIONS`. Two tags (GenEval's own names, so that every GenEval tool reads the files):

* colors:   "a red circle moving to the left"   (90 = 6 colours x 3 shapes x 5 directions)
* counting: "two blue squares moving up"         (180 = counts 2-3 x 6 x 3 x 5)

The directions read "moving to the left", "moving to the right", "moving up", "moving down" and "standing still".

Every entry is a valid GenEval entry (``flowalign.evaluation.geneval.validate_metadata``) that states the objects of
*each frame* exactly: ``include = [{class, count, color}]`` and ``exclude = [{class, count + 1}]`` (so one frame's
verdict under GenEval's rules is object, colour and count), plus two top-level fields for the time axis:

* ``direction``: one of ``DIRECTIONS``; every object moves that way.
* ``motion``: ``[sx, sy]``, the sign of each object's displacement per frame along x (right) and y (down): the
  position over time that ``direction`` means (``left`` is ``[-1, 0]``, ``still`` is ``[0, 0]``).

Held-out split (``split_video_prompts``)
----------------------------------------
The test set holds out (colour, shape, direction) and (count, colour, shape, direction) *combinations*, as the image
world holds out attribute combinations: for each (colour, shape) pair one direction of the five,
``(colour index + 2 * shape index) mod 5`` (18 of 90 colors captions), and for each (count, colour, shape) one
direction, ``(colour index + 2 * shape index + 3 * count) mod 5`` (36 of 180 counting captions). So every colour,
shape, count and direction, every (colour, shape) pair with four directions, and every (shape, direction) pair are
seen in training (checked by the tests); a held-out caption's exact combination never is. The committed files
``assets/prompts/video_train.jsonl`` and ``assets/prompts/video_test.jsonl`` are written by
:func:`write_default_video_prompt_sets`.
"""

from __future__ import annotations

import json
import os
from os import PathLike
from pathlib import Path

from flowalign.toy.clips import DIRECTIONS
from flowalign.toy.prompts import NUMBER_WORDS, PROMPT_ASSET_DIR, _noun_phrase, _plural
from flowalign.toy.scenes import COLORS, SHAPES

__all__ = [
    "VIDEO_COUNTS",
    "VIDEO_TAGS",
    "VIDEO_TRAIN_FILE",
    "VIDEO_TEST_FILE",
    "all_video_prompts",
    "corrupt_direction",
    "moving",
    "split_video_prompts",
    "video_prompt",
    "write_default_video_prompt_sets",
    "write_video_prompt_sets",
]

VIDEO_TAGS = ("colors", "counting")
VIDEO_COUNTS = (1, 2, 3)
VIDEO_TRAIN_FILE = "video_train.jsonl"
VIDEO_TEST_FILE = "video_test.jsonl"

_PHRASES = {
    "left": "moving to the left",
    "right": "moving to the right",
    "up": "moving up",
    "down": "moving down",
    "still": "standing still",
}
_OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def moving(direction: str) -> str:
    """The caption words of a direction ("moving to the left", ..., "standing still")."""
    return _PHRASES[direction]


def video_prompt(color: str, kind: str, direction: str, count: int = 1) -> dict:
    """The metadata of "<count> <colour> <shape>(s) <moving ...>" (module docstring)."""
    if kind not in SHAPES or color not in COLORS or direction not in DIRECTIONS or count not in VIDEO_COUNTS:
        raise ValueError(f"not in the toy video vocabulary: {count} {color} {kind} {direction}")
    if count == 1:
        subject = _noun_phrase(kind, color)
    else:
        subject = f"{NUMBER_WORDS[count]} {color} {_plural(kind)}"
    return {
        "tag": "colors" if count == 1 else "counting",
        "prompt": f"{subject} {moving(direction)}",
        "include": [{"class": kind, "count": count, "color": color}],
        "exclude": [{"class": kind, "count": count + 1}],
        "direction": direction,
        "motion": list(DIRECTIONS[direction]),
    }


def all_video_prompts() -> list[dict]:
    """Every caption of the toy video vocabulary (270): the colors captions, then the counting ones."""
    return [video_prompt(color, kind, direction, count)
            for count in VIDEO_COUNTS for color in COLORS for kind in SHAPES for direction in DIRECTIONS]


def _held_out_direction(color: str, kind: str, count: int) -> str:
    names = tuple(DIRECTIONS)
    index = COLORS.index(color) + 2 * SHAPES.index(kind) + (3 * count if count > 1 else 0)
    return names[index % len(names)]


def split_video_prompts() -> tuple[list[dict], list[dict]]:
    """The fixed ``(train, test)`` split of :func:`all_video_prompts` (module docstring)."""
    train, test = [], []
    for entry in all_video_prompts():
        clause = entry["include"][0]
        held = _held_out_direction(clause["color"], clause["class"], clause["count"])
        (test if entry["direction"] == held else train).append(entry)
    return train, test


def corrupt_direction(metadata: dict) -> dict:
    """The same objects in another motion: the opposite direction, or ``left`` for a still clip (a render of
    ``metadata`` fails the result on direction alone)."""
    clause = metadata["include"][0]
    direction = _OPPOSITE.get(metadata["direction"], "left")
    return video_prompt(clause["color"], clause["class"], direction, clause["count"])


def _write_jsonl(path: Path, entries: list[dict]) -> None:
    """Write ``entries`` one JSON object a line, through a temporary file renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for entry in entries:
            handle.write(json.dumps(entry) + "\n")
    os.replace(tmp, path)


def write_video_prompt_sets(out_dir: str | PathLike[str]) -> tuple[Path, Path]:
    """Write ``video_train.jsonl`` and ``video_test.jsonl`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = split_video_prompts()
    paths = out / VIDEO_TRAIN_FILE, out / VIDEO_TEST_FILE
    _write_jsonl(paths[0], train)
    _write_jsonl(paths[1], test)
    return paths


def write_default_video_prompt_sets() -> tuple[Path, Path]:
    """Regenerate the committed ``assets/prompts/video_{train,test}.jsonl``."""
    return write_video_prompt_sets(PROMPT_ASSET_DIR)
