"""GenEval's rule-based scoring of object detections, re-implemented.

Reference: Dhruba Ghosh, Hanna Hajishirzi, Ludwig Schmidt. "GenEval: An object-focused framework for
evaluating text-to-image alignment." NeurIPS 2023 Datasets and Benchmarks (arXiv:2310.11513).

This module is our own code. It reads GenEval's prompt metadata (``evaluation_metadata.jsonl``, 553
prompts in six tags) and decides whether one image is correct for its prompt, given the objects a detector
found in that image. The detector and the colour classifier are not part of this module: callers pass
their output in as plain dicts, so the same rules score real images (Mask2Former + CLIP in GenEval) and
the toy world's classical detector.

Metadata (one JSON object per line)::

    {"tag": "position", "prompt": "a photo of a dog right of a teddy bear",
     "include": [{"class": "teddy bear", "count": 1},
                 {"class": "dog", "count": 1, "position": ["right of", 0]}]}

Detections: ``{class_name: [{"box": (x1, y1, x2, y2), "score": s, "color": "red"}, ...]}`` in pixels,
``color`` optional (needed only for clauses that ask for a colour).

The rules, as GenEval applies them:

1. Confidence threshold: a detection is kept when its score is strictly greater than 0.3, or than 0.9
   when the prompt's tag is ``counting``.
2. Per class, kept detections are sorted by descending score (ties keep their input order) and at most
   16 are kept. There is no non-maximum suppression.
3. ``include`` clauses are ANDed and checked in order. A clause ``(class, count)`` looks at the top
   ``count`` objects of its class:

   a. fewer than ``count`` objects -> the clause fails;
   b. else, if it names a ``color``, fewer than ``count`` of those objects having that colour -> fails;
   c. else, if it names a ``position = [relation, g]``: if clause ``g`` failed there is no target and the
      clause fails; otherwise each of its objects must stand in ``relation`` to every object matched by
      clause ``g`` (see ``relative_position``), and the first pair that does not fails the clause.

   A clause that passes records its objects as group ``i`` (its index) for later position clauses; a
   clause that fails records no group.
4. ``exclude`` clauses are ORed: the image fails when the number of kept detections of the class (after
   rules 1 and 2) is at least ``count``.
5. ``relative_position(a, b)``: offset = centre(a) - centre(b). Each component is shrunk towards zero by
   0.1 times the summed box sizes along that axis (widths for x, heights for y), clipping at zero. If
   both shrunk components are below 1e-3 in magnitude the boxes have no relation. Otherwise the shrunk
   offset is divided by the length of the *raw* offset, giving (dx, dy), and the relations are
   dx < -0.5 "left of", dx > 0.5 "right of", dy < -0.5 "above", dy > 0.5 "below" (image y grows
   downward).

An image is correct when no rule failed; the prompt-level and tag-level scores are summarised by
``summarize``. GenEval's headline number ("overall") is the unweighted mean of the six per-tag scores.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from numbers import Integral, Real
from os import PathLike
from pathlib import Path
from typing import Any

from flowalign.errors import RewardInputError

__all__ = [
    "TAGS",
    "RELATIONS",
    "GenEvalError",
    "GenEvalMetadataError",
    "load_metadata",
    "validate_metadata",
    "validate_metadata_batch",
    "relative_position",
    "judge",
    "summarize",
    "overall_standard_error",
    "format_table",
]

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")

SCORE_THRESHOLD = 0.3
COUNTING_SCORE_THRESHOLD = 0.9
MAX_OBJECTS_PER_CLASS = 16
POSITION_MARGIN = 0.1
NO_OFFSET_TOLERANCE = 1e-3
DIRECTION_CUTOFF = 0.5

INCLUDE_KEYS = ("class", "count", "color", "position")
EXCLUDE_KEYS = ("class", "count")

# A kept detection together with its index in the caller's list for that class (used in error messages).
IndexedDetection = tuple[int, Mapping[str, Any]]


class GenEvalError(ValueError):
    """Bad GenEval metadata, detections or results. The message says where and what is accepted."""


class GenEvalMetadataError(GenEvalError, RewardInputError):
    """A metadata entry that is not GenEval's (``validate_metadata``): for a reward that judges by it, bad input
    (``flowalign.errors.RewardInputError``), which a reward server answers with a 4xx."""


# --------------------------------------------------------------------------------------------- metadata


def load_metadata(path: str | PathLike[str]) -> list[dict]:
    """Read GenEval's jsonl metadata: one JSON object per line, blank lines skipped.

    Every entry is checked with ``validate_metadata``; the first problem raises ``GenEvalError`` with the
    file, the 1-based line number and the field. The parsed objects are returned unchanged, but for an editing
    prompt's condition images (``images``: paths relative to the file), which become absolute paths, each checked to
    exist (``flowalign.data.condition_images``).
    """
    from pathlib import Path

    from flowalign.data.condition_images import resolve_entry_images

    entries = []
    for where, line in located_lines(path):
        entry = _parse_json_line(line, where)
        validate_metadata(entry, where)
        try:
            resolve_entry_images(entry, Path(path).parent, where)
        except ValueError as error:
            raise GenEvalError(str(error)) from None
        entries.append(entry)
    return entries


def located_lines(path: str | PathLike[str]) -> Iterator[tuple[str, str]]:
    """``("<path>:<1-based line number>", line)`` for each non-blank line of a UTF-8 text file. A directory, or bytes
    that are not UTF-8, are a GenEvalError naming the file (and the line of the first bad byte)."""
    if Path(path).is_dir():
        raise GenEvalError(f"{path} is a directory: give the path of a prompt file (.txt or .jsonl) in it")
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data[:error.start].count(b"\n") + 1
        raise GenEvalError(f"{path}:{line_number}: not UTF-8 text (byte {data[error.start]:#04x}): save the file as "
                           "UTF-8") from None
    for line_number, line in enumerate(io.StringIO(text, newline=None), start=1):
        if line.strip():
            yield f"{path}:{line_number}", line


def _parse_json_line(line: str, where: str) -> Any:
    """Parse one jsonl line, turning a JSON syntax error into a located GenEvalError."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise GenEvalError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None


def validate_metadata(entry: Any, where: str = "<metadata>") -> None:
    """Check one metadata entry; raise GenEvalError prefixed with ``where`` on the first problem.

    Accepted: a JSON object with ``tag`` in TAGS, ``prompt`` a non-empty string, ``include`` a non-empty
    list of include clauses and, optionally, ``exclude`` a list of exclude clauses. Other top-level keys
    are allowed (pipelines add bookkeeping such as ids); unknown keys inside a clause are not, because a
    misspelt ``color`` or ``position`` would silently drop a check.
    """
    if not isinstance(entry, dict):
        raise GenEvalMetadataError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    _check_tag(entry, where)
    _check_prompt(entry, where)
    _check_include(entry, where)
    _check_exclude(entry, where)


def validate_metadata_batch(metadata: Any) -> None:
    """Check a batch's metadata, one entry per image, each named ``metadata[i]`` (``validate_metadata``): the input
    check of the rewards that judge by GenEval metadata (their ``check_inputs``)."""
    if not isinstance(metadata, Sequence) or isinstance(metadata, (str, bytes)):
        raise GenEvalMetadataError(f"metadata: expected a list of GenEval entries, got {type(metadata).__name__}")
    for index, entry in enumerate(metadata):
        validate_metadata(entry, f"metadata[{index}]")


def _fail(where: str, field: str, problem: str) -> GenEvalError:
    return GenEvalMetadataError(f"{where}: field '{field}': {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_tag(entry: dict, where: str) -> None:
    """``tag`` must be one of TAGS."""
    if "tag" not in entry:
        raise _fail(where, "tag", f"missing (expected one of {', '.join(TAGS)})")
    if entry["tag"] not in TAGS:
        raise _fail(where, "tag", f"unknown tag {entry['tag']!r} (expected one of {', '.join(TAGS)})")


def _check_prompt(entry: dict, where: str) -> None:
    """``prompt`` must be a non-empty string."""
    prompt = entry.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _fail(where, "prompt", f"got {prompt!r} (expected a non-empty string)")


def _check_include(entry: dict, where: str) -> None:
    """``include`` must be a non-empty list of include clauses."""
    clauses = entry.get("include")
    if not isinstance(clauses, list) or not clauses:
        raise _fail(where, "include", f"got {clauses!r} (expected a non-empty list of clauses)")
    for index, clause in enumerate(clauses):
        _check_include_clause(clause, index, where)


def _check_exclude(entry: dict, where: str) -> None:
    """``exclude``, when present, must be a list of exclude clauses."""
    if "exclude" not in entry:
        return
    clauses = entry["exclude"]
    if not isinstance(clauses, list):
        raise _fail(where, "exclude", f"got {clauses!r} (expected a list of clauses)")
    for index, clause in enumerate(clauses):
        _check_clause_object(clause, f"exclude[{index}]", EXCLUDE_KEYS, where)
        _check_class_and_count(clause, f"exclude[{index}]", where)


def _check_include_clause(clause: Any, index: int, where: str) -> None:
    """An include clause has ``class`` and ``count``, optionally ``color`` and ``position``."""
    field = f"include[{index}]"
    _check_clause_object(clause, field, INCLUDE_KEYS, where)
    _check_class_and_count(clause, field, where)
    if "color" in clause:
        color = clause["color"]
        if not isinstance(color, str) or not color.strip():
            raise _fail(where, f"{field}.color", f"got {color!r} (expected a non-empty string)")
    if "position" in clause:
        _check_position(clause["position"], index, where)


def _check_clause_object(clause: Any, field: str, allowed_keys: tuple[str, ...], where: str) -> None:
    """A clause is a JSON object whose keys are all in ``allowed_keys``."""
    if not isinstance(clause, dict):
        raise _fail(where, field, f"got {clause!r} (expected an object with keys {', '.join(allowed_keys)})")
    unknown = sorted(set(clause) - set(allowed_keys))
    if unknown:
        raise _fail(
            where, field, f"unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(allowed_keys)})"
        )


def _check_class_and_count(clause: dict, field: str, where: str) -> None:
    """``class`` is a non-empty string and ``count`` an integer >= 1."""
    name = clause.get("class")
    if not isinstance(name, str) or not name.strip():
        raise _fail(where, f"{field}.class", f"got {name!r} (expected a non-empty string)")
    count = clause.get("count")
    if not _is_int(count) or count < 1:
        raise _fail(where, f"{field}.count", f"got {count!r} (expected an integer >= 1)")


def _check_position(position: Any, clause_index: int, where: str) -> None:
    """``position`` is ``[relation, group]`` with a known relation and an earlier clause's index."""
    field = f"include[{clause_index}].position"
    if not isinstance(position, list) or len(position) != 2:
        raise _fail(where, field, f"got {position!r} (expected [relation, group_index])")
    relation, group = position
    if relation not in RELATIONS:
        raise _fail(where, field, f"unknown relation {relation!r} (expected one of {', '.join(RELATIONS)})")
    if not _is_int(group) or not 0 <= group < clause_index:
        accepted = f"an integer in [0, {clause_index - 1}]" if clause_index else "include[0] has none"
        raise _fail(where, field, f"group index {group!r} must refer to an earlier include clause ({accepted})")


# ------------------------------------------------------------------------------------------- detections


def _check_image_size(image_size: Any) -> tuple[float, float]:
    """``image_size`` is ``(width, height)``, two positive finite numbers."""
    if (
        not isinstance(image_size, Sequence)
        or len(image_size) != 2
        or not all(_is_number(v) and 0 < v < math.inf for v in image_size)
    ):
        raise GenEvalError(f"image_size: got {image_size!r} (expected (width, height), two positive numbers)")
    return float(image_size[0]), float(image_size[1])


def _check_detections(detections: Any, width: float, height: float) -> None:
    """Every detection has a box inside the image (x1 <= x2, y1 <= y2) and a score in [0, 1]."""
    if not isinstance(detections, Mapping):
        raise GenEvalError(f"detections: got {type(detections).__name__} (expected a dict class -> list)")
    for class_name, objects in detections.items():
        if not isinstance(objects, Sequence) or isinstance(objects, str):
            raise GenEvalError(f"detections[{class_name!r}]: got {objects!r} (expected a list of detections)")
        for index, detection in enumerate(objects):
            where = f"detections[{class_name!r}][{index}]"
            if not isinstance(detection, Mapping):
                raise GenEvalError(f"{where}: got {detection!r} (expected a dict with 'box' and 'score')")
            _check_box(detection.get("box"), width, height, where)
            _check_score(detection.get("score"), where)
            color = detection.get("color")
            if color is not None and not isinstance(color, str):
                raise GenEvalError(f"{where}: field 'color': got {color!r} (expected a string)")


def _check_box(box: Any, width: float, height: float, where: str) -> None:
    """A box is (x1, y1, x2, y2) with 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height."""
    allowed = f"(expected 4 numbers with 0 <= x1 <= x2 <= {width:g} and 0 <= y1 <= y2 <= {height:g})"
    try:
        coords = list(box)
    except TypeError:
        raise GenEvalError(f"{where}: field 'box': got {box!r} {allowed}") from None
    if len(coords) != 4 or not all(_is_number(c) for c in coords):
        raise GenEvalError(f"{where}: field 'box': got {box!r} {allowed}")
    x1, y1, x2, y2 = coords
    if not (0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height):
        shown = tuple(float(c) for c in coords)
        raise GenEvalError(f"{where}: field 'box': {shown!r} is outside the image {allowed}")


def _check_score(score: Any, where: str) -> None:
    """A score is a number in [0, 1]."""
    if not _is_number(score) or not 0 <= score <= 1:
        raise GenEvalError(f"{where}: field 'score': got {score!r} (expected a number in [0, 1])")


def _score_threshold(tag: str) -> float:
    """Rule 1: counting prompts need a score above 0.9, every other tag above 0.3."""
    return COUNTING_SCORE_THRESHOLD if tag == "counting" else SCORE_THRESHOLD


def _keep_confident(objects: Sequence[Mapping[str, Any]], threshold: float) -> list[IndexedDetection]:
    """Rules 1 and 2: keep scores strictly above ``threshold``, best first, at most 16 (no NMS).

    Python's sort is stable, so equal scores keep the caller's order.
    """
    kept = [(index, obj) for index, obj in enumerate(objects) if obj["score"] > threshold]
    kept.sort(key=lambda item: item[1]["score"], reverse=True)
    return kept[:MAX_OBJECTS_PER_CLASS]


# ----------------------------------------------------------------------------------------------- geometry


def relative_position(box_a: Sequence[float], box_b: Sequence[float]) -> set[str]:
    """Relations of box ``a`` relative to box ``b`` (rule 5), boxes as (x1, y1, x2, y2) in pixels.

    The centre offset a - b is shrunk per axis by 0.1 * (size_a + size_b) (widths for x, heights for y),
    clipped at zero. If both shrunk components are below 1e-3 the result is empty. Otherwise the shrunk
    offset divided by the length of the raw offset gives (dx, dy): dx < -0.5 "left of", dx > 0.5
    "right of", dy < -0.5 "above", dy > 0.5 "below" (y grows downward). Diagonals give two relations.
    """
    ax1, ay1, ax2, ay2 = box_a
    bx1, by1, bx2, by2 = box_b
    offset_x = (ax1 + ax2) / 2 - (bx1 + bx2) / 2
    offset_y = (ay1 + ay2) / 2 - (by1 + by2) / 2
    shrunk_x = _shrink_towards_zero(offset_x, POSITION_MARGIN * ((ax2 - ax1) + (bx2 - bx1)))
    shrunk_y = _shrink_towards_zero(offset_y, POSITION_MARGIN * ((ay2 - ay1) + (by2 - by1)))
    if abs(shrunk_x) < NO_OFFSET_TOLERANCE and abs(shrunk_y) < NO_OFFSET_TOLERANCE:
        return set()
    length = math.hypot(offset_x, offset_y)
    dx, dy = shrunk_x / length, shrunk_y / length
    relations = set()
    if dx < -DIRECTION_CUTOFF:
        relations.add("left of")
    if dx > DIRECTION_CUTOFF:
        relations.add("right of")
    if dy < -DIRECTION_CUTOFF:
        relations.add("above")
    if dy > DIRECTION_CUTOFF:
        relations.add("below")
    return relations


def _shrink_towards_zero(value: float, margin: float) -> float:
    """max(|value| - margin, 0) * sign(value)."""
    return math.copysign(max(abs(value) - margin, 0.0), value) if value else 0.0


def _describe_relations(relations: set[str]) -> str:
    """'left of and above'-style text for a relation set, or 'no clear relation' when it is empty."""
    return " and ".join(sorted(relations)) if relations else "no clear relation"


# ---------------------------------------------------------------------------------------------- judging


def judge(
    metadata: Mapping[str, Any],
    detections: Mapping[str, Sequence[Mapping[str, Any]]],
    image_size: tuple[float, float],
) -> tuple[bool, str]:
    """Decide whether one image satisfies its GenEval prompt (rules 1-4).

    Returns ``(correct, reason)``; ``reason`` joins the failure messages with newlines and is empty
    when the image is correct. Raises GenEvalError for invalid metadata, image size or detections, and
    when a colour clause meets an object whose ``color`` was not filled in by colour classification.
    """
    validate_metadata(metadata)
    width, height = _check_image_size(image_size)
    _check_detections(detections, width, height)
    threshold = _score_threshold(metadata["tag"])
    kept = {name: _keep_confident(objects, threshold) for name, objects in detections.items()}

    failures = _check_includes(metadata["include"], kept)
    failures += _check_excludes(metadata.get("exclude", []), kept)
    return not failures, "\n".join(failures)


def _check_includes(clauses: list[dict], kept: dict[str, list[IndexedDetection]]) -> list[str]:
    """Rule 3: every include clause must hold; each records its objects (or None) as a group."""
    failures: list[str] = []
    groups: list[list[IndexedDetection] | None] = []
    for clause_index, clause in enumerate(clauses):
        objects = kept.get(clause["class"], [])[: clause["count"]]
        failure = _check_one_include(clause, clause_index, objects, groups)
        groups.append(None if failure else objects)
        if failure:
            failures.append(failure)
    return failures


def _check_one_include(
    clause: dict,
    clause_index: int,
    objects: list[IndexedDetection],
    groups: list[list[IndexedDetection] | None],
) -> str | None:
    """Count, then colour, then position; the first failing check gives the clause's reason."""
    name, count = clause["class"], clause["count"]
    if len(objects) < count:
        return f"expected {name}>={count}, found {len(objects)}"
    if "color" in clause:
        failure = _check_color(clause, clause_index, objects)
        if failure:
            return failure
    if "position" in clause:
        return _check_position_clause(clause, objects, groups)
    return None


def _check_color(clause: dict, clause_index: int, objects: list[IndexedDetection]) -> str | None:
    """Rule 3b: at least ``count`` of the clause's top-``count`` objects must have its colour."""
    name, count, wanted = clause["class"], clause["count"], clause["color"]
    colors = [_color_of(obj, index, name, clause_index, wanted) for index, obj in objects]
    matching = colors.count(wanted)
    if matching >= count:
        return None
    seen = ", ".join(f"{n} {color}" for color, n in Counter(colors).items())
    return f"expected {wanted} {name}>={count}, found {matching} {wanted}; colours seen: {seen}"


def _color_of(obj: Mapping[str, Any], index: int, name: str, clause_index: int, wanted: str) -> str:
    """The detection's ``color``, which colour classification must have filled in."""
    color = obj.get("color")
    if color is None:
        raise GenEvalError(
            f"detections[{name!r}][{index}]: field 'color' is missing, but include[{clause_index}] asks for "
            f"{wanted!r}; colour classification must fill 'color' first"
        )
    return color


def _check_position_clause(
    clause: dict, objects: list[IndexedDetection], groups: list[list[IndexedDetection] | None]
) -> str | None:
    """Rule 3c: each object must stand in the relation to every object of the target group."""
    name = clause["class"]
    relation, group_index = clause["position"]
    targets = groups[group_index]
    if targets is None:
        return f"no target for {name} to be {relation}"
    for _, obj in objects:
        for _, target in targets:
            found = relative_position(obj["box"], target["box"])
            if relation not in found:
                return f"expected {name} {relation} target, found {_describe_relations(found)} to target"
    return None


def _check_excludes(clauses: list[dict], kept: dict[str, list[IndexedDetection]]) -> list[str]:
    """Rule 4: fail for each exclude clause whose class has ``count`` or more kept detections."""
    failures = []
    for clause in clauses:
        found = len(kept.get(clause["class"], []))
        if found >= clause["count"]:
            failures.append(f"expected {clause['class']}<{clause['count']}, found {found}")
    return failures


# ---------------------------------------------------------------------------------------------- summary


def summarize(results: Sequence[Mapping[str, Any]]) -> dict:
    """Aggregate per-image verdicts into GenEval's scores.

    ``results`` holds dicts with ``tag``, ``prompt`` and ``correct`` (and optionally ``prompt_id``, which
    then identifies the prompt instead of its text). Returns per-tag mean correctness and counts,
    ``overall`` = unweighted mean of the per-tag means over the tags present (GenEval's headline),
    ``images_correct`` = fraction of images correct, and ``prompts_correct`` = fraction of distinct
    prompts with at least one correct image.
    """
    if not results:
        raise GenEvalError("results: empty (expected at least one judged image)")
    per_tag: dict[str, list[bool]] = {}
    per_prompt: dict[tuple[str, Any], bool] = {}
    for index, result in enumerate(results):
        tag, prompt_key, correct = _check_result(result, index)
        per_tag.setdefault(tag, []).append(correct)
        per_prompt[prompt_key] = per_prompt.get(prompt_key, False) or correct

    tags = {tag: {"score": _mean(per_tag[tag]), "n": len(per_tag[tag])} for tag in TAGS if tag in per_tag}
    all_images = [correct for verdicts in per_tag.values() for correct in verdicts]
    return {
        "tags": tags,
        "overall": _mean([entry["score"] for entry in tags.values()]),
        "images_correct": _mean(all_images),
        "prompts_correct": _mean(list(per_prompt.values())),
        "n_images": len(all_images),
        "n_prompts": len(per_prompt),
    }


def overall_standard_error(results: Sequence[Mapping[str, Any]]) -> float:
    """The standard error of ``summarize(results)["overall"]``, the unweighted mean of the tags' accuracies.

    Each tag ``t`` has ``n_t`` verdicts ``c_i`` in {0, 1}, read as independent: ``se_t = std(c, ddof=1) / sqrt(n_t)``,
    and the mean of ``T`` independent tag means has ``se = sqrt(sum_t se_t^2) / T`` (the same rule as
    ``toy_eval.paired_difference``'s overall, for one sample). NaN when a tag has a single verdict. Several images of
    one prompt are correlated, so with many images per prompt this understates the error.
    """
    if not results:
        raise GenEvalError("results: empty (expected at least one judged image)")
    per_tag: dict[str, list[float]] = {}
    for index, result in enumerate(results):
        tag, _, correct = _check_result(result, index)
        per_tag.setdefault(tag, []).append(float(correct))
    variances = []
    for verdicts in per_tag.values():
        n = len(verdicts)
        if n < 2:
            return math.nan
        mean = _mean(verdicts)
        variances.append(sum((c - mean) ** 2 for c in verdicts) / (n - 1) / n)
    return math.sqrt(sum(variances)) / len(variances)


def _check_result(result: Any, index: int) -> tuple[str, tuple[str, Any], bool]:
    """A result has a known ``tag``, a string ``prompt`` and a bool ``correct``."""
    where = f"results[{index}]"
    if not isinstance(result, Mapping):
        raise GenEvalError(f"{where}: got {type(result).__name__} (expected a dict)")
    if result.get("tag") not in TAGS:
        raise _fail(where, "tag", f"got {result.get('tag')!r} (expected one of {', '.join(TAGS)})")
    if not isinstance(result.get("prompt"), str):
        raise _fail(where, "prompt", f"got {result.get('prompt')!r} (expected a string)")
    if not isinstance(result.get("correct"), bool):
        raise _fail(where, "correct", f"got {result.get('correct')!r} (expected true or false)")
    prompt_key = ("id", result["prompt_id"]) if "prompt_id" in result else ("text", result["prompt"])
    return result["tag"], prompt_key, result["correct"]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def format_table(summary: Mapping[str, Any]) -> str:
    """A markdown table: one row per tag present (in TAGS order), then ``overall``; scores to 3 decimals.

    The overall row's n is the number of images.
    """
    rows = ["| tag | score | n |", "|---|---:|---:|"]
    for tag in TAGS:
        if tag in summary["tags"]:
            entry = summary["tags"][tag]
            rows.append(f"| {tag} | {entry['score']:.3f} | {entry['n']} |")
    rows.append(f"| overall | {summary['overall']:.3f} | {summary['n_images']} |")
    return "\n".join(rows)
