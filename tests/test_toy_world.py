"""Toy world: rendering, scene sampling, the classical detector, prompts and the fixed split."""

from __future__ import annotations

import numpy as np
import pytest

from flowalign.evaluation.geneval import judge, load_metadata, validate_metadata
from flowalign.toy import prompts as P
from flowalign.toy.detector import detect, detect_batch
from flowalign.toy.scenes import (
    BACKGROUND,
    COLORS,
    IMAGE_SIZE,
    PALETTE,
    SHAPES,
    SceneError,
    Shape,
    render,
    scene_for,
    shape_box,
)

SIZE = (IMAGE_SIZE, IMAGE_SIZE)


def _by_tag(entries):
    out = {tag: [] for tag in P.TAGS}
    for entry in entries:
        out[entry["tag"]].append(entry)
    return out


# --------------------------------------------------------------------------------------- rendering


def test_palette_is_distinct_and_far_from_background():
    assert len(PALETTE) == 6 and set(COLORS) == {"red", "green", "blue", "yellow", "purple", "white"}
    rgb = np.array([PALETTE[c] for c in COLORS], dtype=float)
    pairwise = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1)
    assert pairwise[~np.eye(6, dtype=bool)].min() > 2 * 70
    assert np.linalg.norm(rgb - np.array(BACKGROUND), axis=-1).min() > 90
    assert SHAPES == ("circle", "square", "triangle")


def test_render_square_pixels_exact():
    image = render([Shape("square", "red", cx=10.0, cy=12.0, size=6.0)])
    assert image.dtype == np.uint8 and image.shape == (32, 32, 3)
    inside = np.zeros((32, 32), dtype=bool)
    inside[9:15, 7:13] = True  # rows y 9..14, cols x 7..12
    assert (image[inside] == PALETTE["red"]).all()
    assert (image[~inside] == BACKGROUND).all()
    assert shape_box(Shape("square", "red", 10.0, 12.0, 6.0)) == (7, 9, 13, 15)


def test_render_circle_and_triangle_geometry():
    circle = render([Shape("circle", "blue", cx=16.0, cy=16.0, size=10.0)])
    assert (circle[16, 16] == PALETTE["blue"]).all()
    for y, x in [(11, 11), (11, 20), (20, 11), (20, 20)]:  # bbox corners are outside a disc
        assert (circle[y, x] == BACKGROUND).all()
    assert (circle[0, 0] == BACKGROUND).all()

    tri = render([Shape("triangle", "yellow", cx=16.5, cy=16.5, size=11.0)])
    mask = (tri == PALETTE["yellow"]).all(axis=-1)
    rows = np.flatnonzero(mask.any(axis=1))
    widths = mask[rows].sum(axis=1)
    assert widths[0] <= 2 and widths[-1] >= 10  # apex up, base down
    assert (np.diff(widths) >= 0).all()
    # Only palette colours and the background, no anti-aliasing.
    values = {tuple(v) for v in tri.reshape(-1, 3)}
    assert values == {BACKGROUND, PALETTE["yellow"]}


def test_render_draws_later_shapes_on_top():
    image = render([Shape("square", "red", 16, 16, 10), Shape("square", "white", 16, 16, 4)])
    assert (image[16, 16] == PALETTE["white"]).all() and (image[12, 12] == PALETTE["red"]).all()


# ------------------------------------------------------------------------------------------ scenes


@pytest.mark.parametrize("tag", P.TAGS)
def test_scene_for_satisfies_metadata(tag):
    rng = np.random.default_rng(7)
    entries = _by_tag(P.all_prompts())[tag]
    for entry in entries[:40]:
        for _ in range(3):
            scene = scene_for(entry, rng)
            assert len(scene) == sum(c["count"] for c in entry["include"])
            correct, reason = judge(entry, detect(render(scene)), SIZE)
            assert correct, f"{entry['prompt']}: {reason} ({scene})"


def test_scene_for_is_reproducible_and_varied():
    entry = P.color_attr("red", "circle", "blue", "square")
    a = scene_for(entry, np.random.default_rng(3))
    b = scene_for(entry, np.random.default_rng(3))
    assert a == b
    scenes = [scene_for(entry, np.random.default_rng(seed)) for seed in range(20)]
    layouts = {tuple((s.cx, s.cy, s.size) for s in scene) for scene in scenes}
    assert len(layouts) > 15


def test_scene_for_reports_impossible_scenes():
    with pytest.raises(SceneError, match="cannot fit|could not place"):
        scene_for(P.counting("square", 30), np.random.default_rng(0))
    with pytest.raises(SceneError, match="toy shape"):
        scene_for({"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a dog"},
                  np.random.default_rng(0))


# ---------------------------------------------------------------------------------------- detector


def test_detector_accuracy_own_vs_corrupted_prompts():
    """>= 99% of fresh renders pass their own prompt and <= 1% pass a corrupted one."""
    rng = np.random.default_rng(2024)
    by_tag = _by_tag(P.all_prompts())
    n = 600
    own = corrupted = 0
    for i in range(n):
        entries = by_tag[P.TAGS[i % len(P.TAGS)]]
        entry = entries[int(rng.integers(len(entries)))]
        detections = detect(render(scene_for(entry, rng)))
        own += judge(entry, detections, SIZE)[0]
        wrong = P.corrupt(entry, rng)
        corrupted += judge(wrong, detections, SIZE)[0]
    assert own / n >= 0.99, f"own-prompt accuracy {own}/{n}"
    assert corrupted / n <= 0.01, f"corrupted-prompt pass rate {corrupted}/{n}"


def test_detector_output_format():
    rng = np.random.default_rng(11)
    for entry in P.all_prompts()[::12]:
        detections = detect(render(scene_for(entry, rng)))
        assert set(detections) == set(SHAPES)
        for kind, objects in detections.items():
            for obj in objects:
                x1, y1, x2, y2 = obj["box"]
                assert all(isinstance(v, int) for v in obj["box"])
                assert 0 <= x1 < x2 <= IMAGE_SIZE and 0 <= y1 < y2 <= IMAGE_SIZE
                assert 0.0 <= obj["score"] <= 1.0
                assert obj["color"] in PALETTE
        judge(entry, detections, SIZE)  # raises GenEvalError on a malformed detection


def test_detector_clean_shapes_exact():
    for kind in SHAPES:
        for size in range(7, 12):
            shape = Shape(kind, "purple", 9 + size / 2, 5 + size / 2, float(size))
            detections = detect(render([shape]))
            assert [k for k, v in detections.items() if v] == [kind]
            (obj,) = detections[kind]
            assert obj["box"] == shape_box(shape)
            assert obj["color"] == "purple"
            assert obj["score"] == pytest.approx(1.0)



def test_detector_leaves_edge_blend_nearer_the_background_out():
    """A decoded square's edge blends into the grey; blend pixels nearer the grey than the colour are background.

    Purple is the palette colour closest to the background: a 30 % purple / 70 % grey pixel is within the colour
    radius of purple, but it is the grey it resembles, and counting it as purple frays the square into a "circle".
    """
    image = render([Shape("square", "purple", 16, 16, 10)]).astype(np.float32)
    blend = 0.3 * np.asarray(PALETTE["purple"], np.float32) + 0.7 * np.asarray(BACKGROUND, np.float32)
    inside = np.zeros((32, 32), dtype=bool)
    inside[11:21, 11:21] = True
    ring = np.zeros((32, 32), dtype=bool)
    ring[10:22, 10:22] = True
    ring &= ~inside
    ring[10, 10:22:3] = ring[21, 10:22:2] = False  # a ragged fringe, not a clean bigger square
    image[ring] = blend
    detections = detect(image.astype(np.uint8))
    assert [k for k, v in detections.items() if v] == ["square"]
    assert detections["square"][0]["box"] == (11, 11, 21, 21)
    assert detections["square"][0]["score"] == pytest.approx(1.0)

def test_detector_scores_drop_on_noise_and_specks_are_ignored():
    rng = np.random.default_rng(5)
    clean = render([Shape("square", "green", 16, 16, 10)])
    mild = np.clip(clean + rng.normal(0, 20, clean.shape), 0, 255).astype(np.uint8)
    assert detect(mild)["square"][0]["score"] > 0.9  # a soft but unambiguous square stays confident
    heavy = np.clip(clean + rng.normal(0, 40, clean.shape), 0, 255).astype(np.uint8)
    scores = [d["score"] for found in detect(heavy).values() for d in found]
    assert not detect(heavy)["square"] and max(scores) < 0.9  # broken up: nothing confident enough to count
    speck = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
    speck[3:5, 3:5] = PALETTE["red"]  # 4 px: below the minimum blob area
    assert all(not v for v in detect(speck).values())
    empty = detect(np.full((32, 32, 3), BACKGROUND, dtype=np.uint8))
    assert all(not v for v in empty.values())


def test_detect_batch_layouts():
    images = np.stack(
        [render([Shape("circle", "red", 10.5, 10.5, 9)]), render([Shape("square", "white", 20, 20, 8)])]
    )
    floats = images.astype(np.float32) / 255.0
    expected = [detect(im) for im in images]
    assert detect_batch(floats) == expected  # (B, H, W, 3)
    assert detect_batch(np.transpose(floats, (0, 3, 1, 2))) == expected  # (B, 3, H, W)
    import torch
    assert detect_batch(torch.from_numpy(floats).permute(0, 3, 1, 2)) == expected


# ----------------------------------------------------------------------------------------- prompts


def test_all_prompts_are_valid_geneval_metadata():
    entries = P.all_prompts()
    counts = {tag: len(v) for tag, v in _by_tag(entries).items()}
    assert counts == {"single_object": 3, "two_object": 6, "counting": 9, "colors": 18, "position": 24,
                      "color_attr": 180}
    assert len({e["prompt"] for e in entries}) == len(entries)
    for entry in entries:
        validate_metadata(entry)
    assert P.position("circle", "left of", "square") == {
        "tag": "position",
        "include": [
            {"class": "square", "count": 1},
            {"class": "circle", "count": 1, "position": ["left of", 0]},
        ],
        "prompt": "a photo of a circle left of a square",
    }
    assert P.counting("triangle", 3)["exclude"] == [{"class": "triangle", "count": 4}]
    assert P.counting("triangle", 3)["prompt"] == "a photo of three triangles"
    prompt = P.color_attr("red", "circle", "blue", "square")["prompt"]
    assert prompt == "a photo of a red circle and a blue square"


def test_corrupt_changes_a_judged_attribute():
    rng = np.random.default_rng(9)
    vocabulary = {e["prompt"] for e in P.all_prompts()}
    for entry in P.all_prompts():
        for _ in range(3):
            wrong = P.corrupt(entry, rng)
            validate_metadata(wrong)
            assert wrong["tag"] == entry["tag"]
            assert wrong["prompt"] != entry["prompt"] and wrong["prompt"] in vocabulary


def test_split_is_disjoint_and_covers_vocabulary():
    train, test = P.split_prompts()
    train_caps, test_caps = {e["prompt"] for e in train}, {e["prompt"] for e in test}
    assert not train_caps & test_caps
    assert len(train) + len(test) == len(P.all_prompts())
    held = {tag: len(v) for tag, v in _by_tag(test).items()}
    assert held == {"single_object": 3, "two_object": 2, "counting": 3, "colors": 6, "position": 8,
                    "color_attr": 44}
    assert not _by_tag(train)["single_object"]

    clauses = [c for e in train for c in e["include"]]
    assert {c["class"] for c in clauses} == set(SHAPES)
    assert {c["color"] for c in clauses if "color" in c} == set(COLORS)
    assert {c["count"] for e in train if e["tag"] == "counting" for c in e["include"]} == set(P.COUNTS)
    assert {c["position"][0] for c in clauses if "position" in c} == set(P.RELATIONS)
    # Held-out colors: one per colour, each shape twice; counting: one per shape and per count.
    held_colors = [e["include"][0] for e in test if e["tag"] == "colors"]
    assert sorted(c["color"] for c in held_colors) == sorted(COLORS)
    assert all(sum(c["class"] == k for c in held_colors) == 2 for k in SHAPES)
    held_counts = [e["include"][0] for e in test if e["tag"] == "counting"]
    assert {c["class"] for c in held_counts} == set(SHAPES)
    assert {c["count"] for c in held_counts} == set(P.COUNTS)


def _layout_key(entry):
    """Position/color_attr combination, independent of which object is mentioned first."""
    if entry["tag"] == "position":
        ref, obj = entry["include"]
        rel = obj["position"][0]
        if rel in ("right of", "below"):
            return (entry["tag"], ref["class"], P.OPPOSITE[rel], obj["class"])
        return (entry["tag"], obj["class"], rel, ref["class"])
    if entry["tag"] == "color_attr":
        return (entry["tag"], frozenset((c["class"], c["color"]) for c in entry["include"]))
    return (entry["tag"], entry["prompt"])


def test_split_holds_out_combinations_not_just_wordings():
    train, test = P.split_prompts()
    assert not {_layout_key(e) for e in train} & {_layout_key(e) for e in test}


def _pair_axis(entry):
    """Position entry -> (unordered shape pair, axis): what a mirrored caption has in common."""
    ref, obj = entry["include"]
    axis = "horizontal" if obj["position"][0] in ("left of", "right of") else "vertical"
    return frozenset((ref["class"], obj["class"])), axis


def test_position_split_holds_out_whole_pair_axes_not_mirrors():
    train, test = P.split_prompts()
    held = {_pair_axis(e) for e in test if e["tag"] == "position"}
    assert len(held) == 2 and {axis for _, axis in held} == {"horizontal", "vertical"}
    assert not held & {_pair_axis(e) for e in train if e["tag"] == "position"}
    # Every relation word is still trained on some other pair.
    trained = {e["include"][1]["position"][0] for e in train if e["tag"] == "position"}
    assert trained == set(P.RELATIONS)


def test_committed_prompt_files_match_split(tmp_path):
    train, test = P.split_prompts()
    assert load_metadata(P.PROMPT_ASSET_DIR / "train.jsonl") == train
    assert load_metadata(P.PROMPT_ASSET_DIR / "test.jsonl") == test
    train_path, test_path = P.write_prompt_sets(tmp_path)
    assert train_path.read_bytes() == (P.PROMPT_ASSET_DIR / "train.jsonl").read_bytes()
    assert test_path.read_bytes() == (P.PROMPT_ASSET_DIR / "test.jsonl").read_bytes()
