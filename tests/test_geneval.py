"""Tests for flowalign.evaluation.geneval: GenEval's metadata, rules, geometry and summary."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from flowalign.evaluation.geneval import (
    TAGS,
    GenEvalError,
    format_table,
    judge,
    load_metadata,
    relative_position,
    summarize,
    validate_metadata,
)

REAL_METADATA = Path(__file__).resolve().parents[1].parent / "shared/data/geneval/evaluation_metadata.jsonl"
IMAGE = (100, 100)


def det(box, score=0.95, color=None):
    detection = {"box": box, "score": score}
    if color is not None:
        detection["color"] = color
    return detection


def meta(tag, include, exclude=None, prompt="a photo"):
    entry = {"tag": tag, "include": include, "prompt": prompt}
    if exclude is not None:
        entry["exclude"] = exclude
    return entry


def one(name, count=1, **extra):
    return {"class": name, "count": count, **extra}


# ---------------------------------------------------------------------------------------- real metadata


@pytest.mark.skipif(not REAL_METADATA.exists(), reason=f"GenEval metadata not present at {REAL_METADATA}")
def test_real_metadata_parses_with_expected_tag_counts():
    entries = load_metadata(REAL_METADATA)
    assert len(entries) == 553
    assert Counter(e["tag"] for e in entries) == {
        "single_object": 80,
        "two_object": 99,
        "counting": 80,
        "colors": 94,
        "position": 100,
        "color_attr": 100,
    }
    first = json.loads(REAL_METADATA.read_text(encoding="utf-8").splitlines()[0])
    assert entries[0] == first  # returned unchanged


# ------------------------------------------------------------------------------------------- threshold


@pytest.mark.parametrize(
    ("tag", "score", "expected"),
    [
        ("single_object", 0.3, False),  # strictly greater than 0.3
        ("single_object", 0.3001, True),
        ("two_object", 0.85, True),
        ("counting", 0.85, False),  # counting needs > 0.9
        ("counting", 0.9, False),
        ("counting", 0.9001, True),
    ],
)
def test_confidence_threshold(tag, score, expected):
    include = [one("cat")] if tag != "two_object" else [one("cat"), one("dog")]
    detections = {"cat": [det((0, 0, 10, 10), score)], "dog": [det((50, 50, 60, 60))]}
    correct, reason = judge(meta(tag, include), detections, IMAGE)
    assert correct is expected
    assert reason == ("" if expected else "expected cat>=1, found 0")


def test_counting_threshold_also_applies_to_exclude():
    detections = {"clock": [det((0, 0, 10, 10), 0.95), det((20, 0, 30, 10), 0.95), det((40, 0, 50, 10), 0.85)]}
    entry = meta("counting", [one("clock", 2)], [one("clock", 3)])
    assert judge(entry, detections, IMAGE) == (True, "")
    entry_loose = meta("two_object", [one("clock", 2)], [one("clock", 3)])
    assert judge(entry_loose, detections, IMAGE) == (False, "expected clock<3, found 3")


# -------------------------------------------------------------------------------------- top-16 and order


def twenty_cats():
    return {"cat": [det((i, 0, i + 5, 5), 0.5 + i / 100) for i in range(20)]}


def test_top_16_cut_hides_extra_detections_from_exclude():
    entry = meta("single_object", [one("cat")], [one("cat", 17)])
    assert judge(entry, twenty_cats(), IMAGE) == (True, "")


def test_exclude_at_16_triggers():
    entry = meta("single_object", [one("cat")], [one("cat", 16)])
    assert judge(entry, twenty_cats(), IMAGE) == (False, "expected cat<16, found 16")


def test_top_16_cut_happens_after_sorting():
    # the best detection comes last in the caller's list: it must survive the cut to 16
    detections = {"car": [det((i, 0, i + 5, 5), 0.5, "blue") for i in range(16)] + [det((0, 50, 5, 55), 0.9, "red")]}
    assert judge(meta("colors", [one("car", color="red")]), detections, IMAGE) == (True, "")


def test_descending_score_decides_which_objects_colour_check_sees():
    low_red_high_blue = {"car": [det((0, 0, 10, 10), 0.5, "red"), det((20, 0, 30, 10), 0.9, "blue")]}
    high_red_low_blue = {"car": [det((0, 0, 10, 10), 0.9, "red"), det((20, 0, 30, 10), 0.5, "blue")]}
    entry = meta("colors", [one("car", color="red")])
    correct, reason = judge(entry, low_red_high_blue, IMAGE)
    assert not correct
    assert reason == "expected red car>=1, found 0 red; colours seen: 1 blue"
    assert judge(entry, high_red_low_blue, IMAGE) == (True, "")


def test_equal_scores_keep_input_order():
    detections = {"car": [det((0, 0, 10, 10), 0.7, "green"), det((20, 0, 30, 10), 0.7, "red")]}
    assert judge(meta("colors", [one("car", color="green")]), detections, IMAGE) == (True, "")
    assert judge(meta("colors", [one("car", color="red")]), detections, IMAGE)[0] is False


# ------------------------------------------------------------------------------------------------ colour


def test_colour_pass_and_fail_with_counts():
    detections = {
        "apple": [
            det((0, 0, 10, 10), 0.99, "red"),
            det((20, 0, 30, 10), 0.98, "green"),
            det((40, 0, 50, 10), 0.97, "red"),
        ]
    }
    assert judge(meta("colors", [one("apple", 1, color="red")]), detections, IMAGE) == (True, "")
    correct, reason = judge(meta("colors", [one("apple", 2, color="red")]), detections, IMAGE)
    assert not correct  # the top 2 are red and green: the third red apple is never looked at
    assert reason == "expected red apple>=2, found 1 red; colours seen: 1 red, 1 green"


def test_missing_colour_raises():
    detections = {"apple": [det((0, 0, 10, 10), 0.99)]}
    with pytest.raises(GenEvalError, match=r"detections\['apple'\]\[0\]: field 'color'.*colour classification"):
        judge(meta("colors", [one("apple", color="red")]), detections, IMAGE)
    # without a colour clause, a missing colour is fine
    assert judge(meta("single_object", [one("apple")]), detections, IMAGE) == (True, "")


# ---------------------------------------------------------------------------------------------- position

TARGET = (40, 40, 60, 60)
PLACED = {
    "left of": (0, 40, 20, 60),
    "right of": (80, 40, 100, 60),
    "above": (40, 0, 60, 20),
    "below": (40, 80, 60, 100),
}
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def position_entry(relation):
    return meta("position", [one("kite"), one("dog", position=[relation, 0])])


@pytest.mark.parametrize("relation", list(PLACED))
def test_position_each_relation_passes(relation):
    detections = {"kite": [det(TARGET)], "dog": [det(PLACED[relation])]}
    assert judge(position_entry(relation), detections, IMAGE) == (True, "")


@pytest.mark.parametrize("relation", list(PLACED))
def test_position_each_relation_fails_when_opposite(relation):
    detections = {"kite": [det(TARGET)], "dog": [det(PLACED[OPPOSITE[relation]])]}
    correct, reason = judge(position_entry(relation), detections, IMAGE)
    assert not correct
    assert reason == f"expected dog {relation} target, found {OPPOSITE[relation]} to target"


def test_position_margin_makes_near_boxes_relation_free():
    # widths 10 + 10 -> margin 2 px; a centre offset of 1.5 px shrinks to zero
    detections = {"kite": [det((40, 40, 50, 50))], "dog": [det((41.5, 40, 51.5, 50))]}
    correct, reason = judge(position_entry("right of"), detections, IMAGE)
    assert not correct
    assert reason == "expected dog right of target, found no clear relation to target"
    # offset 5 px: (5 - 2) / 5 = 0.6 > 0.5 -> right of
    detections["dog"] = [det((45, 40, 55, 50))]
    assert judge(position_entry("right of"), detections, IMAGE) == (True, "")


def test_position_needs_every_object_against_every_target():
    entry = meta("position", [one("kite"), one("dog", 2, position=["left of", 0])])
    both_left = {"kite": [det(TARGET)], "dog": [det((0, 40, 20, 60), 0.99), det((0, 0, 20, 20), 0.98)]}
    assert judge(entry, both_left, IMAGE) == (True, "")
    one_right = {"kite": [det(TARGET)], "dog": [det((0, 40, 20, 60), 0.99), det((80, 40, 100, 60), 0.98)]}
    correct, reason = judge(entry, one_right, IMAGE)
    assert not correct
    assert reason == "expected dog left of target, found right of to target"  # one reason only


def test_position_against_failed_group_has_no_target():
    entry = meta("color_attr", [one("kite", color="red"), one("dog", position=["left of", 0])])
    detections = {"kite": [det(TARGET, color="blue")], "dog": [det(PLACED["left of"])]}
    correct, reason = judge(entry, detections, IMAGE)
    assert not correct
    assert reason.splitlines() == [
        "expected red kite>=1, found 0 red; colours seen: 1 blue",
        "no target for dog to be left of",
    ]
    detections["kite"] = []
    assert judge(entry, detections, IMAGE)[1].splitlines() == [
        "expected kite>=1, found 0",
        "no target for dog to be left of",
    ]


def test_position_not_checked_after_colour_failure():
    entry = meta("position", [one("kite"), one("dog", color="black", position=["left of", 0])])
    detections = {"kite": [det(TARGET)], "dog": [det(PLACED["right of"], color="white")]}
    assert judge(entry, detections, IMAGE) == (False, "expected black dog>=1, found 0 black; colours seen: 1 white")


# -------------------------------------------------------------------------------------- include/exclude


def test_multiple_includes_are_anded():
    entry = meta("two_object", [one("cat"), one("dog"), one("cow")])
    everything = {"cat": [det((0, 0, 10, 10))], "dog": [det((20, 0, 30, 10))], "cow": [det((40, 0, 50, 10))]}
    assert judge(entry, everything, IMAGE) == (True, "")
    missing_two = {"cat": [det((0, 0, 10, 10))]}
    assert judge(entry, missing_two, IMAGE) == (False, "expected dog>=1, found 0\nexpected cow>=1, found 0")


def test_exclude_triggers_even_when_include_passes():
    entry = meta("counting", [one("clock", 2)], [one("clock", 3)])
    three = {"clock": [det((i * 20, 0, i * 20 + 10, 10)) for i in range(3)]}
    assert judge(entry, three, IMAGE) == (False, "expected clock<3, found 3")
    assert judge(entry, {"clock": three["clock"][:2]}, IMAGE) == (True, "")


def test_count_failure_message():
    entry = meta("counting", [one("circle", 2)])
    assert judge(entry, {"circle": [det((0, 0, 10, 10))]}, IMAGE) == (False, "expected circle>=2, found 1")


# ------------------------------------------------------------------------------------- relative_position


def test_relative_position_hand_computed():
    # centres (5,5) vs (25,5): offset (-20, 0); margin 2 -> (-18, 0); dx = -0.9
    assert relative_position((0, 0, 10, 10), (20, 0, 30, 10)) == {"left of"}
    assert relative_position((20, 0, 30, 10), (0, 0, 10, 10)) == {"right of"}
    # y grows downward: a box with smaller y is above
    assert relative_position((0, 0, 10, 10), (0, 20, 10, 30)) == {"above"}
    assert relative_position((0, 20, 10, 30), (0, 0, 10, 10)) == {"below"}
    # diagonal: offset (-20, -20) -> (-18, -18) / 28.28 = -0.636 each
    assert relative_position((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    # shallow diagonal: offset (-20, -8) -> (-18, -6) / 21.54 -> dx -0.836, dy -0.279
    assert relative_position((0, 0, 10, 10), (20, 8, 30, 18)) == {"left of"}
    # different sizes: centres (2,2) vs (20,5); margins 2.4 (x), 1.4 (y); (-15.6, -1.6) / 18.25
    assert relative_position((0, 0, 4, 4), (10, 0, 30, 10)) == {"left of"}
    # identical boxes and overlapping boxes inside the margin have no relation
    assert relative_position((10, 10, 20, 20), (10, 10, 20, 20)) == set()
    assert relative_position((10, 10, 20, 20), (11, 11, 21, 21)) == set()


def test_relative_position_divides_by_raw_offset_length():
    # offset 3, margin 2 -> shrunk 1; 1 / 3 < 0.5 -> no relation (dividing by the shrunk length would give 1)
    assert relative_position((3, 0, 13, 10), (0, 0, 10, 10)) == set()
    # offset 5 -> 3 / 5 = 0.6 -> right of
    assert relative_position((5, 0, 15, 10), (0, 0, 10, 10)) == {"right of"}


# ------------------------------------------------------------------------------------------------ summary


def sample_results():
    return [
        {"tag": "single_object", "prompt": "a", "correct": True},
        {"tag": "single_object", "prompt": "a", "correct": False},
        {"tag": "single_object", "prompt": "b", "correct": True},
        {"tag": "single_object", "prompt": "c", "correct": True},
        {"tag": "position", "prompt": "d", "correct": False},
        {"tag": "position", "prompt": "d", "correct": False},
    ]


def test_summarize_hand_computed():
    summary = summarize(sample_results())
    assert summary["tags"] == {"single_object": {"score": 0.75, "n": 4}, "position": {"score": 0.0, "n": 2}}
    assert summary["overall"] == pytest.approx(0.375)  # (0.75 + 0.0) / 2, not the image mean 0.5
    assert summary["images_correct"] == pytest.approx(0.5)
    assert summary["prompts_correct"] == pytest.approx(0.75)  # a, b, c of a, b, c, d
    assert summary["n_images"] == 6
    assert summary["n_prompts"] == 4


def test_summarize_prompt_id_identifies_prompts():
    results = [
        {"tag": "colors", "prompt": "same text", "prompt_id": 1, "correct": True},
        {"tag": "colors", "prompt": "same text", "prompt_id": 2, "correct": False},
    ]
    summary = summarize(results)
    assert summary["n_prompts"] == 2
    assert summary["prompts_correct"] == pytest.approx(0.5)
    without_ids = summarize([{k: v for k, v in r.items() if k != "prompt_id"} for r in results])
    assert without_ids["n_prompts"] == 1
    assert without_ids["prompts_correct"] == pytest.approx(1.0)


def test_summarize_rejects_bad_results():
    with pytest.raises(GenEvalError, match=r"results\[1\]: field 'correct'"):
        summarize([{"tag": "colors", "prompt": "p", "correct": True}, {"tag": "colors", "prompt": "p", "correct": 1}])
    with pytest.raises(GenEvalError, match="empty"):
        summarize([])


def test_format_table_rows_in_tag_order():
    table = format_table(summarize(list(reversed(sample_results()))))
    assert table.splitlines() == [
        "| tag | score | n |",
        "|---|---:|---:|",
        "| single_object | 0.750 | 4 |",
        "| position | 0.000 | 2 |",
        "| overall | 0.375 | 6 |",
    ]


def test_tags_constant():
    assert TAGS == ("single_object", "two_object", "counting", "colors", "position", "color_attr")


# ---------------------------------------------------------------------------------------------- bad input

GOOD_LINE = json.dumps(meta("single_object", [one("cat")], prompt="a photo of a cat"))


def load_with_bad_third_line(tmp_path, bad_line):
    """Line 1 is valid, line 2 blank (skipped but counted), line 3 the bad one."""
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text(f"{GOOD_LINE}\n\n{bad_line}\n{GOOD_LINE}\n", encoding="utf-8")
    with pytest.raises(GenEvalError) as info:
        load_metadata(path)
    message = str(info.value)
    assert "evaluation_metadata.jsonl:3:" in message
    return message


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(f"{GOOD_LINE}\n\n   \n{GOOD_LINE}\n", encoding="utf-8")
    assert load_metadata(path) == [json.loads(GOOD_LINE)] * 2


def test_malformed_json_line(tmp_path):
    message = load_with_bad_third_line(tmp_path, '{"tag": "colors", "prompt": ')
    assert "not valid JSON" in message


def test_non_object_line(tmp_path):
    message = load_with_bad_third_line(tmp_path, "[1, 2]")
    assert "expected a JSON object" in message


def test_unknown_tag(tmp_path):
    bad = json.dumps(meta("colour", [one("cat")]))
    message = load_with_bad_third_line(tmp_path, bad)
    assert "field 'tag': unknown tag 'colour' (expected one of single_object, two_object" in message


def test_missing_include(tmp_path):
    message = load_with_bad_third_line(tmp_path, json.dumps({"tag": "colors", "prompt": "a photo"}))
    assert "field 'include'" in message
    assert "non-empty list" in message


def test_empty_prompt(tmp_path):
    message = load_with_bad_third_line(tmp_path, json.dumps(meta("colors", [one("cat")], prompt="")))
    assert "field 'prompt'" in message


def test_bad_count(tmp_path):
    message = load_with_bad_third_line(tmp_path, json.dumps(meta("counting", [one("cat", 0)])))
    assert "field 'include[0].count': got 0 (expected an integer >= 1)" in message


def test_misspelt_clause_key(tmp_path):
    message = load_with_bad_third_line(tmp_path, json.dumps(meta("colors", [one("cat", colour="red")])))
    assert "field 'include[0]': unknown key(s) 'colour'" in message


def test_bad_position_relation(tmp_path):
    bad = json.dumps(meta("position", [one("cat"), one("dog", position=["next to", 0])]))
    message = load_with_bad_third_line(tmp_path, bad)
    assert "field 'include[1].position': unknown relation 'next to'" in message
    assert "left of, right of, above, below" in message


@pytest.mark.parametrize("group", [1, 2, -1])
def test_position_must_reference_an_earlier_group(tmp_path, group):
    bad = json.dumps(meta("position", [one("cat"), one("dog", position=["left of", group])]))
    message = load_with_bad_third_line(tmp_path, bad)
    assert f"field 'include[1].position': group index {group}" in message
    assert "[0, 0]" in message


def test_bad_exclude_clause(tmp_path):
    message = load_with_bad_third_line(tmp_path, json.dumps(meta("counting", [one("cat")], [{"class": "cat"}])))
    assert "field 'exclude[0].count'" in message


def test_validate_metadata_uses_where_prefix():
    with pytest.raises(GenEvalError, match=r"^prompt 7: field 'include\[0\].class'"):
        validate_metadata(meta("colors", [{"class": "", "count": 1}]), where="prompt 7")
    validate_metadata(meta("colors", [one("cat")]))  # a good entry passes silently


@pytest.mark.parametrize(
    "box",
    [(-1, 0, 10, 10), (0, 0, 101, 10), (0, 0, 10, 100.5), (20, 0, 10, 10), (0, 30, 10, 20), (0, 0, 10)],
)
def test_detection_box_must_lie_in_the_image(box):
    detections = {"cat": [det((0, 0, 10, 10)), det(box)]}
    with pytest.raises(GenEvalError) as info:
        judge(meta("single_object", [one("cat")]), detections, IMAGE)
    message = str(info.value)
    assert "detections['cat'][1]: field 'box'" in message
    assert str(box[-1]) in message and str(box[0]) in message
    assert "0 <= x1 <= x2 <= 100 and 0 <= y1 <= y2 <= 100" in message


@pytest.mark.parametrize("score", [1.5, -0.1, math.nan, "0.5"])
def test_detection_score_must_be_in_unit_interval(score):
    detections = {"dog": [det((0, 0, 10, 10), score)]}
    with pytest.raises(GenEvalError) as info:
        judge(meta("single_object", [one("cat")]), detections, IMAGE)  # every class is checked
    message = str(info.value)
    assert f"detections['dog'][0]: field 'score': got {score!r}" in message
    assert "[0, 1]" in message


def test_judge_validates_metadata_and_image_size():
    with pytest.raises(GenEvalError, match="field 'tag'"):
        judge(meta("nope", [one("cat")]), {}, IMAGE)
    with pytest.raises(GenEvalError, match="image_size"):
        judge(meta("single_object", [one("cat")]), {}, (0, 100))


def test_overall_standard_error_hand_computed():
    from flowalign.evaluation.geneval import overall_standard_error

    # single_object [1, 0, 1, 1]: var (ddof 1) 0.25, se^2 0.25 / 4; position [0, 0]: se 0; overall sqrt(1/16) / 2 tags
    assert overall_standard_error(sample_results()) == pytest.approx(0.125)
    assert math.isnan(overall_standard_error(sample_results()[:5]))  # position has one verdict: no spread to estimate
    with pytest.raises(GenEvalError, match="empty"):
        overall_standard_error([])
