"""Toy-world prompts in GenEval's metadata format, the fixed train/test split, and corruptions.

Vocabulary: the shapes of :data:`~flowalign.toy.scenes.SHAPES` (circle, square, triangle), the six
palette colours, counts 2-4 and GenEval's four relations. Captions follow GenEval's phrasing:

* single_object: "a photo of a circle"                               (3 captions)
* colors:        "a photo of a red circle"                           (18)
* counting:      "a photo of two circles"                            (9; exclude = count + 1)
* two_object:    "a photo of a circle and a square"                  (6 ordered pairs of shapes)
* position:      "a photo of a circle left of a square"              (24 = 6 ordered pairs x 4)
  As in GenEval, ``include[0]`` is the reference object (the second-mentioned one) and
  ``include[1]`` is the first-mentioned object with ``position = [relation, 0]``.
* color_attr:    "a photo of a red circle and a blue square"         (180 = 6 x 30 colour pairs)

Held-out split (``split_prompts``)
----------------------------------
The test set holds out attribute *combinations*, so no test caption (nor, for position and
color_attr, any rewording of the same combination) is seen in training:

* single_object: all 3 captions; training never sees a colourless single-shape caption.
* colors: 6 of 18, one per colour with each shape twice: red circle, green square, blue triangle,
  yellow circle, purple square, white triangle.
* counting: 3 of 9, a Latin square over shapes and counts: two triangles, three circles,
  four squares.
* two_object: 2 of 6, both orders of the pair {circle, triangle}.
* position: 8 of 24: one pair of shapes held out on each axis, in all four captions:
  {circle, square} side by side ("circle left of square", "circle right of square",
  "square left of circle", "square right of circle") and {circle, triangle} stacked ("... above ...",
  "... below ..."). Training still sees circle and square stacked and circle and triangle side by
  side, so the relation words are learned, but no held-out layout is the mirror image of a trained
  one (which would reward "the square goes left" shortcuts learned on the training layouts).
* color_attr: 22 of the 90 unordered (colour, shape) pairs, drawn with ``numpy`` seed
  ``COLOR_ATTR_SEED``, both orders of each, i.e. 44 of 180 captions (24.4 %).

Every colour, shape, count and relation still appears in training (checked by the tests). The
committed files ``assets/prompts/train.jsonl`` and ``assets/prompts/test.jsonl`` are produced by
:func:`write_default_prompt_sets`.
"""

from __future__ import annotations

import itertools
import json
from os import PathLike
from pathlib import Path

import numpy as np

from flowalign.toy.scenes import COLORS, SHAPES

__all__ = [
    "COUNTS",
    "RELATIONS",
    "TAGS",
    "COLOR_ATTR_SEED",
    "PROMPT_ASSET_DIR",
    "single_object",
    "colors",
    "counting",
    "two_object",
    "position",
    "color_attr",
    "all_prompts",
    "split_prompts",
    "corrupt",
    "write_prompt_sets",
    "write_default_prompt_sets",
]

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COUNTS = (2, 3, 4)
RELATIONS = ("left of", "right of", "above", "below")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
NUMBER_WORDS = {
    1: "one", 2: "two", 3: "three", 4: "four", 5: "five",
    6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten",
}  # fmt: skip

COLOR_ATTR_SEED = 20240611
COLOR_ATTR_HELD_OUT_COMBOS = 22

PROMPT_ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "prompts"

# Held-out captions, by tag (see the module docstring).
_HELD_OUT_COLORS = (
    ("red", "circle"),
    ("green", "square"),
    ("blue", "triangle"),
    ("yellow", "circle"),
    ("purple", "square"),
    ("white", "triangle"),
)
_HELD_OUT_COUNTING = (("triangle", 2), ("circle", 3), ("square", 4))
_HELD_OUT_TWO_OBJECT = (("circle", "triangle"), ("triangle", "circle"))
# (first-mentioned, relation, second-mentioned): each held-out pair on its axis, all four captions.
_HELD_OUT_POSITION = tuple(
    (a, rel, b)
    for pair, relations in ((("circle", "square"), ("left of", "right of")), (("circle", "triangle"), ("above", "below")))
    for a, b in (pair, pair[::-1])
    for rel in relations
)


# --------------------------------------------------------------------------------------------------
# Captions
# --------------------------------------------------------------------------------------------------


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _plural(kind: str) -> str:
    return kind + "es" if kind.endswith(("s", "x", "ch", "sh")) else kind + "s"


def _noun_phrase(kind: str, color: str | None = None) -> str:
    words = f"{color} {kind}" if color else kind
    return f"{_article(words)} {words}"


def single_object(kind: str) -> dict:
    return {
        "tag": "single_object",
        "include": [{"class": kind, "count": 1}],
        "prompt": f"a photo of {_noun_phrase(kind)}",
    }


def colors(color: str, kind: str) -> dict:
    return {
        "tag": "colors",
        "include": [{"class": kind, "count": 1, "color": color}],
        "prompt": f"a photo of {_noun_phrase(kind, color)}",
    }


def counting(kind: str, count: int) -> dict:
    return {
        "tag": "counting",
        "include": [{"class": kind, "count": count}],
        "exclude": [{"class": kind, "count": count + 1}],
        "prompt": f"a photo of {NUMBER_WORDS.get(count, str(count))} {_plural(kind)}",
    }


def two_object(first: str, second: str) -> dict:
    return {
        "tag": "two_object",
        "include": [{"class": first, "count": 1}, {"class": second, "count": 1}],
        "prompt": f"a photo of {_noun_phrase(first)} and {_noun_phrase(second)}",
    }


def position(first: str, relation: str, second: str) -> dict:
    """"a photo of a <first> <relation> a <second>": ``first`` stands in ``relation`` to ``second``."""
    return {
        "tag": "position",
        "include": [{"class": second, "count": 1}, {"class": first, "count": 1, "position": [relation, 0]}],
        "prompt": f"a photo of {_noun_phrase(first)} {relation} {_noun_phrase(second)}",
    }


def color_attr(color_a: str, kind_a: str, color_b: str, kind_b: str) -> dict:
    return {
        "tag": "color_attr",
        "include": [
            {"class": kind_a, "count": 1, "color": color_a},
            {"class": kind_b, "count": 1, "color": color_b},
        ],
        "prompt": f"a photo of {_noun_phrase(kind_a, color_a)} and {_noun_phrase(kind_b, color_b)}",
    }


def _shape_pairs() -> list[tuple[str, str]]:
    return list(itertools.permutations(SHAPES, 2))


def all_prompts() -> list[dict]:
    """Every caption of the toy vocabulary, grouped by tag in ``TAGS`` order (240 in all)."""
    out: list[dict] = [single_object(kind) for kind in SHAPES]
    out += [two_object(a, b) for a, b in _shape_pairs()]
    out += [counting(kind, n) for kind in SHAPES for n in COUNTS]
    out += [colors(color, kind) for color in COLORS for kind in SHAPES]
    out += [position(a, rel, b) for a, b in _shape_pairs() for rel in RELATIONS]
    out += [
        color_attr(ca, a, cb, b)
        for a, b in _shape_pairs()
        for ca, cb in itertools.permutations(COLORS, 2)
    ]
    return out


# --------------------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------------------


def _held_out_color_attr() -> set[str]:
    """Captions of the color_attr combinations drawn for the test set (both orders of each)."""
    combos = []
    for a, b in itertools.combinations(SHAPES, 2):
        for ca, cb in itertools.permutations(COLORS, 2):
            combos.append(((ca, a), (cb, b)))  # unordered: shape a always comes first here
    rng = np.random.default_rng(COLOR_ATTR_SEED)
    picked = rng.choice(len(combos), size=COLOR_ATTR_HELD_OUT_COMBOS, replace=False)
    captions = set()
    for index in sorted(int(i) for i in picked):
        (ca, a), (cb, b) = combos[index]
        captions.add(color_attr(ca, a, cb, b)["prompt"])
        captions.add(color_attr(cb, b, ca, a)["prompt"])
    return captions


def _held_out_captions() -> set[str]:
    held = {single_object(kind)["prompt"] for kind in SHAPES}
    held |= {colors(color, kind)["prompt"] for color, kind in _HELD_OUT_COLORS}
    held |= {counting(kind, n)["prompt"] for kind, n in _HELD_OUT_COUNTING}
    held |= {two_object(a, b)["prompt"] for a, b in _HELD_OUT_TWO_OBJECT}
    held |= {position(a, rel, b)["prompt"] for a, rel, b in _HELD_OUT_POSITION}
    held |= _held_out_color_attr()
    return held


def split_prompts() -> tuple[list[dict], list[dict]]:
    """The fixed ``(train, test)`` split of :func:`all_prompts` (see the module docstring)."""
    held = _held_out_captions()
    prompts = all_prompts()
    train = [p for p in prompts if p["prompt"] not in held]
    test = [p for p in prompts if p["prompt"] in held]
    assert len(test) == len(held), "a held-out caption is not in the vocabulary"
    return train, test


# --------------------------------------------------------------------------------------------------
# Corruption
# --------------------------------------------------------------------------------------------------


def _other(options, current, rng: np.random.Generator, exclude=()):
    choices = [o for o in options if o != current and o not in exclude]
    return choices[int(rng.integers(len(choices)))]


def corrupt(metadata: dict, rng: np.random.Generator) -> dict:
    """A deliberately wrong prompt of the same tag, differing in something the judge checks.

    A scene that satisfies ``metadata`` (with exactly the included objects) fails the returned
    prompt. Mutations, picked at random among those that apply:

    * single_object: another shape.
    * colors: another colour, or another shape.
    * counting: another count in ``COUNTS`` (fewer trips the exclude clause, more the include), or
      another shape.
    * two_object: one of the two shapes replaced by the third shape.
    * position: the opposite relation, or one shape replaced by the third shape. (An orthogonal
      relation is not used: a diagonal layout can satisfy both.)
    * color_attr: one object's colour changed (to a colour neither object has), the two colours
      swapped between the objects, or one shape replaced by the third shape.

    The result stays inside the toy vocabulary (it is one of :func:`all_prompts`).
    """
    tag = metadata["tag"]
    include = metadata["include"]
    if tag == "single_object":
        return single_object(_other(SHAPES, include[0]["class"], rng))
    if tag == "colors":
        kind, color = include[0]["class"], include[0]["color"]
        if rng.random() < 0.5:
            return colors(_other(COLORS, color, rng), kind)
        return colors(color, _other(SHAPES, kind, rng))
    if tag == "counting":
        kind, n = include[0]["class"], include[0]["count"]
        if rng.random() < 0.5:
            return counting(kind, _other(COUNTS, n, rng))
        return counting(_other(SHAPES, kind, rng), n)
    if tag == "two_object":
        a, b = include[0]["class"], include[1]["class"]
        third = _other(SHAPES, a, rng, exclude=(b,))
        return two_object(third, b) if rng.random() < 0.5 else two_object(a, third)
    if tag == "position":
        second, first = include[0]["class"], include[1]["class"]
        rel = include[1]["position"][0]
        if rng.random() < 0.5:
            return position(first, OPPOSITE[rel], second)
        third = _other(SHAPES, first, rng, exclude=(second,))
        if rng.random() < 0.5:
            return position(third, rel, second)
        return position(first, rel, third)
    if tag == "color_attr":
        (a, ca), (b, cb) = ((c["class"], c["color"]) for c in include)
        mutation = int(rng.integers(5))
        if mutation == 0:
            return color_attr(_other(COLORS, ca, rng, exclude=(cb,)), a, cb, b)
        if mutation == 1:
            return color_attr(ca, a, _other(COLORS, cb, rng, exclude=(ca,)), b)
        if mutation == 2:
            return color_attr(cb, a, ca, b)
        third = _other(SHAPES, a, rng, exclude=(b,))
        if mutation == 3:
            return color_attr(ca, third, cb, b)
        return color_attr(ca, a, cb, third)
    raise ValueError(f"cannot corrupt metadata with tag {tag!r}")


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, entries: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for entry in entries:
            handle.write(json.dumps(entry) + "\n")


def write_prompt_sets(out_dir: str | PathLike[str]) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` (GenEval metadata format) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = split_prompts()
    train_path, test_path = out / "train.jsonl", out / "test.jsonl"
    _write_jsonl(train_path, train)
    _write_jsonl(test_path, test)
    return train_path, test_path


def write_default_prompt_sets() -> tuple[Path, Path]:
    """Regenerate the committed prompt sets ``assets/prompts/{train,test}.jsonl``."""
    return write_prompt_sets(PROMPT_ASSET_DIR)
