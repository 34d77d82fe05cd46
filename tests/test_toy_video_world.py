"""The toy video world: clips of moving shapes, the video prompts and their split, and the exact verifier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowalign.errors import RewardInputError
from flowalign.evaluation.geneval import load_metadata, validate_metadata
from flowalign.rewards import REWARDS, build_reward, reward_modality, score_range
from flowalign.toy import video_prompts as V
from flowalign.toy.clips import DIRECTIONS, TRAVEL_RANGE, Clip, clip_for, clips_tensor, motion_offsets, render_clip
from flowalign.toy.prompts import PROMPT_ASSET_DIR
from flowalign.toy.scenes import BACKGROUND, BORDER, OBJECT_GAP, Shape, render, shape_box
from flowalign.toy.video_reward import ToyVideoReward, direction_holds, direction_progress, judge_clip, track


def _verdict(entry, clip):
    return ToyVideoReward().verdicts(clips_tensor([clip]), [entry])[0]


# ------------------------------------------------------------------------------------------------ clips


def test_motion_offsets_are_whole_pixels_rounded_along_the_direction():
    # t * 10 / 4 = 0, 2.5, 5, 7.5, 10, rounded half to even.
    assert motion_offsets("left", 10, 5) == ((0, 0), (-2, 0), (-5, 0), (-8, 0), (-10, 0))
    assert motion_offsets("down", 8, 9) == tuple((0, t) for t in range(9))
    assert motion_offsets("still", 0, 5) == ((0, 0),) * 5
    with pytest.raises(ValueError, match="num_frames >= 2"):
        motion_offsets("up", 8, 1)
    with pytest.raises(ValueError, match="unknown direction 'sideways'"):
        motion_offsets("sideways", 8, 5)


def test_each_frame_is_the_image_worlds_render_of_the_shifted_shapes():
    clip = Clip((Shape("square", "red", 10.5, 16.5, 9.0),), motion_offsets("right", 8, 5), "right")
    frames = render_clip(clip, 32)
    assert frames.shape == (5, 32, 32, 3) and frames.dtype == np.uint8
    for t, dx in enumerate((0, 2, 4, 6, 8)):
        assert np.array_equal(frames[t], render([Shape("square", "red", 10.5 + dx, 16.5, 9.0)], 32))
    video = clips_tensor([clip, clip])
    assert video.shape == (2, 5, 3, 32, 32) and video.dtype == torch.float32
    assert torch.equal(video[1, 3], torch.from_numpy(frames[3]).permute(2, 0, 1).float() / 255)


def test_sampled_clips_travel_in_range_stay_inside_and_apart_on_every_frame():
    rng = np.random.default_rng(3)
    for entry in V.all_video_prompts()[::3]:
        clip = clip_for(entry, rng)
        clause = entry["include"][0]
        assert [(s.kind, s.color) for s in clip.shapes] == [(clause["class"], clause["color"])] * clause["count"]
        dx, dy = clip.offsets[-1]
        ux, uy = DIRECTIONS[entry["direction"]]
        travel = dx * ux + dy * uy
        assert (travel == 0) if entry["direction"] == "still" else TRAVEL_RANGE[0] <= travel <= TRAVEL_RANGE[1]
        for t in range(clip.num_frames):
            boxes = [shape_box(s, 32) for s in clip.frame(t)]
            for x1, y1, x2, y2 in boxes:
                assert x1 >= BORDER and y1 >= BORDER and x2 <= 32 - BORDER and y2 <= 32 - BORDER
            for i, a in enumerate(boxes):
                for b in boxes[i + 1:]:
                    assert (a[2] + OBJECT_GAP <= b[0] or b[2] + OBJECT_GAP <= a[0] or a[3] + OBJECT_GAP <= b[1]
                            or b[3] + OBJECT_GAP <= a[1])


# ------------------------------------------------------------------------------------------------ prompts


def test_video_prompts_are_geneval_metadata_with_the_motion():
    entries = V.all_video_prompts()
    assert len(entries) == 270 == len({e["prompt"] for e in entries})
    for entry in entries:
        validate_metadata(entry)
    assert V.video_prompt("red", "circle", "left") == {
        "tag": "colors", "prompt": "a red circle moving to the left",
        "include": [{"class": "circle", "count": 1, "color": "red"}],
        "exclude": [{"class": "circle", "count": 2}], "direction": "left", "motion": [-1, 0]}
    two = V.video_prompt("blue", "square", "up", 2)
    assert two["prompt"] == "two blue squares moving up" and two["tag"] == "counting"
    assert two["exclude"] == [{"class": "square", "count": 3}] and two["motion"] == [0, -1]
    assert V.video_prompt("white", "triangle", "still", 3)["prompt"] == "three white triangles standing still"


def test_split_holds_out_combinations_and_trains_every_word():
    train, test = V.split_video_prompts()
    assert len(train) == 216 and len(test) == 54
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in test}
    assert {tag: sum(e["tag"] == tag for e in test) for tag in V.VIDEO_TAGS} == {"colors": 18, "counting": 36}

    def key(entry, *fields):
        clause = entry["include"][0]
        values = {"color": clause["color"], "class": clause["class"], "count": clause["count"],
                  "direction": entry["direction"]}
        return tuple(values[f] for f in fields)

    # Every (count, colour, shape) has exactly one held-out direction; every pair of attributes is trained.
    held = [key(e, "count", "color", "class") for e in test]
    assert len(held) == len(set(held)) == 54
    for fields in (("color", "class"), ("class", "direction"), ("color", "direction"), ("count", "direction")):
        assert {key(e, *fields) for e in test} <= {key(e, *fields) for e in train}


def test_committed_video_prompt_files_match_the_split(tmp_path):
    train, test = V.split_video_prompts()
    assert load_metadata(PROMPT_ASSET_DIR / V.VIDEO_TRAIN_FILE) == train
    assert load_metadata(PROMPT_ASSET_DIR / V.VIDEO_TEST_FILE) == test
    paths = V.write_video_prompt_sets(tmp_path)
    assert [p.read_bytes() for p in paths] == [(PROMPT_ASSET_DIR / name).read_bytes()
                                                for name in (V.VIDEO_TRAIN_FILE, V.VIDEO_TEST_FILE)]


# ------------------------------------------------------------------------------------------------ verifier


def test_rendered_clips_score_one_on_their_own_prompts_and_fail_only_direction_on_the_opposite():
    rng = np.random.default_rng(0)
    entries = V.all_video_prompts()
    videos = clips_tensor([clip_for(e, rng) for e in entries])
    reward = build_reward("toy_video")
    assert reward.modality == "video" and reward_modality("toy_video") == "video"
    assert score_range("toy_video") == (0.0, 1.0) and "toy_video" in REWARDS
    assert reward(videos, [e["prompt"] for e in entries], entries).tolist() == [1.0] * len(entries)
    wrong = [V.corrupt_direction(e) for e in entries]
    verdicts = reward.verdicts(videos, wrong)
    assert [v["checks"] for v in verdicts] == [{"object": 1.0, "count": 1.0, "color": 1.0, "direction": 0.0}] * 270
    assert ToyVideoReward(partial_credit=True)(videos, [], wrong).tolist() == [0.75] * 270


def test_wrong_colour_and_wrong_count_fail_their_own_check():
    rng = np.random.default_rng(1)
    one_red = clip_for(V.video_prompt("red", "circle", "left"), rng)
    two_red = clip_for(V.video_prompt("red", "circle", "left", 2), rng)
    assert _verdict(V.video_prompt("blue", "circle", "left"), one_red)["checks"] == {
        "object": 1.0, "count": 1.0, "color": 0.0, "direction": 1.0}
    # Two circles for "a red circle": one too many on every frame; the top circle is red and moves left.
    assert _verdict(V.video_prompt("red", "circle", "left"), two_red)["checks"] == {
        "object": 1.0, "count": 0.0, "color": 1.0, "direction": 1.0}
    # One circle for "two red circles": too few to count, to colour or to track.
    verdict = _verdict(V.video_prompt("red", "circle", "left", 2), one_red)
    assert verdict["checks"] == {"object": 1.0, "count": 0.0, "color": 0.0, "direction": 0.0}
    assert "fewer than 2 circle to track" in verdict["reason"]
    assert _verdict(V.video_prompt("red", "square", "left"), one_red)["checks"] == {
        "object": 0.0, "count": 0.0, "color": 0.0, "direction": 0.0}


def test_a_blank_frame_costs_a_fifth_of_each_frame_check_and_the_whole_direction():
    entry = V.video_prompt("green", "triangle", "down")
    clip = clip_for(entry, np.random.default_rng(2))
    video = clips_tensor([clip])
    video[0, 2] = torch.tensor(BACKGROUND, dtype=torch.float32).view(3, 1, 1) / 255
    verdict = ToyVideoReward().verdicts(video, [entry])[0]
    assert verdict["checks"] == {"object": 0.8, "count": 0.8, "color": 0.8, "direction": 0.0}
    assert verdict["partial"] == pytest.approx(0.6) and not verdict["correct"] and verdict["tracks"] is None
    assert "frame(s) [2]" in verdict["reason"]


def test_tracks_follow_box_centres_and_direction_needs_travel_without_drift_or_steps_back():
    # Two 9 px squares, boxes from (4, 20) and (18, 12), moving up 2 px a frame: box centres (8.5, 24.5 - 2t) and
    # (22.5, 16.5 - 2t), each linked to its own track.
    clip = Clip((Shape("square", "blue", 8.5, 24.5, 9.0), Shape("square", "blue", 22.5, 16.5, 9.0)),
                motion_offsets("up", 8, 5), "up")
    verdict = _verdict(V.video_prompt("blue", "square", "up", 2), clip)
    assert verdict["correct"]
    assert sorted(verdict["tracks"]) == [[[8.5, 24.5 - 2 * t] for t in range(5)], [[22.5, 16.5 - 2 * t] for t in range(5)]]
    assert track([np.array([[0.0, 0.0], [10.0, 0.0]]), np.array([[11.0, 1.0], [1.0, 1.0]])]).tolist() == [
        [[0.0, 0.0], [1.0, 1.0]], [[10.0, 0.0], [11.0, 1.0]]]

    def path(*xy):
        return np.asarray([xy], dtype=np.float64)

    assert direction_holds(path((10, 5), (8, 5), (6, 5)), "left") == (True, "")
    assert direction_holds(path((10, 5), (9, 5), (7, 5)), "left")[0] is False  # 3 px < 4
    assert "drifted" in direction_holds(path((10, 5), (8, 7), (6, 8)), "left")[1]  # 3 px across 4 px
    assert "stepped back" in direction_holds(path((10, 5), (4, 5), (6, 5), (2, 5)), "left")[1]
    assert direction_holds(path((10, 5), (11.5, 4), (10, 6.5)), "still") == (True, "")
    assert "moved 2.0 px" in direction_holds(path((10, 5), (12, 5)), "still")[1]

    # The graded motion term: each factor by hand, 1 exactly where the check holds.
    assert direction_progress(path((10, 5), (8, 5), (6, 5)), "left") == 1.0
    assert direction_progress(path((10, 5), (9, 5), (7, 5)), "left") == 0.75  # 3 px of the 4
    assert direction_progress(path((10, 5), (8, 7), (6, 8)), "left") == 0.75  # drift 3 px, 1 px past half of 4
    assert direction_progress(path((10, 5), (4, 5), (6, 5), (2, 5)), "left") == 0.75  # a 2 px step back, 1 px past 1
    assert direction_progress(path((10, 5), (12, 5)), "left") == 0.0  # the wrong way
    assert direction_progress(path((10, 5), (11.5, 4), (10, 6.5)), "still") == 1.0
    assert direction_progress(path((10, 5), (12, 5)), "still") == pytest.approx(2 - 2 / 1.5)
    assert direction_progress(path((10, 5), (14, 5)), "still") == 0.0
    # Two tracks: the worst one counts (2 px of 4 against a whole path).
    assert direction_progress(np.concatenate([path((10, 5), (6, 5)), path((20, 5), (18, 5))]), "left") == 0.5


def test_the_graded_motion_term_rewards_travel_toward_the_prompt_and_is_refused_without_partial_credit():
    rng = np.random.default_rng(3)
    entries = [V.video_prompt("red", "circle", "left"), V.video_prompt("blue", "square", "up", 2)]
    videos = clips_tensor([clip_for(e, rng) for e in entries])
    graded = build_reward("toy_video", partial_credit=True, motion="graded")
    assert graded(videos, [], entries).tolist() == [1.0, 1.0]
    # The opposite direction: the frame checks hold, the motion term is 0 (every track went the wrong way).
    wrong = [V.corrupt_direction(e) for e in entries]
    verdicts = graded.verdicts(videos, wrong)
    assert [v["motion"] for v in verdicts] == [0.0, 0.0] and graded(videos, [], wrong).tolist() == [0.75, 0.75]
    # A still clip judged against a direction: it travels nothing, so scores as the binary check.
    still = clips_tensor([clip_for(V.video_prompt("red", "circle", "still"), rng)])
    verdict = graded.verdicts(still, [V.video_prompt("red", "circle", "left")])[0]
    assert verdict["motion"] == 0.0 and verdict["partial_motion"] == verdict["partial"] == 0.75
    with pytest.raises(RewardInputError, match="kwarg 'motion' must be one of binary, graded, got 'smooth'"):
        ToyVideoReward(partial_credit=True, motion="smooth")
    with pytest.raises(RewardInputError, match="set 'partial_credit: true' with them"):
        ToyVideoReward(motion="graded")


def test_the_joint_credit_pays_only_for_right_frames_scaled_by_the_motion():
    rng = np.random.default_rng(4)
    entry = V.video_prompt("red", "circle", "left")
    one_red, two_red = (clips_tensor([clip_for(V.video_prompt("red", "circle", "left", n), rng)]) for n in (1, 2))
    joint = ToyVideoReward(partial_credit=True, credit="joint")
    assert joint(one_red, [], [entry]).tolist() == [1.0]
    # Two circles for "a red circle": object, colour and direction hold (the mean: 0.75), no frame is right.
    verdict = joint.verdicts(two_red, [entry])[0]
    assert verdict["partial"] == 0.75 and verdict["frames_correct"] == 0.0 and joint(two_red, [], [entry]).item() == 0
    # The wrong direction: every frame right, the motion term 0 (binary or graded).
    wrong = V.corrupt_direction(entry)
    verdict = joint.verdicts(one_red, [wrong])[0]
    assert verdict["frames_correct"] == 1.0 and verdict["joint"] == verdict["joint_motion"] == 0.0
    # A blank frame: 4 of the 5 frames right, nothing to track.
    video = one_red.clone()
    video[0, 2] = torch.tensor(BACKGROUND, dtype=torch.float32).view(3, 1, 1) / 255
    verdict = joint.verdicts(video, [entry])[0]
    assert verdict["frames_correct"] == pytest.approx(0.8) and verdict["joint"] == 0.0
    # A clip 3 px short of the travel: right frames, 3/4 of the graded motion (the binary check fails).
    graded = ToyVideoReward(partial_credit=True, credit="joint", motion="graded")
    base = clip_for(entry, rng)
    short = clips_tensor([Clip(base.shapes, motion_offsets("left", 3, base.num_frames), "left")])
    verdict = graded.verdicts(short, [entry])[0]
    assert verdict["frames_correct"] == 1.0 and verdict["checks"]["direction"] == 0.0
    assert graded(short, [], [entry]).item() == pytest.approx(verdict["motion"]) and 0 < verdict["motion"] < 1
    with pytest.raises(RewardInputError, match="kwarg 'credit' must be one of mean, joint, got 'product'"):
        ToyVideoReward(partial_credit=True, credit="product")
    with pytest.raises(RewardInputError, match="'credit: joint' shape the partial credit"):
        ToyVideoReward(credit="joint")


def test_bad_input_is_refused_naming_the_field():
    reward = ToyVideoReward()
    entry = V.video_prompt("red", "circle", "left")
    video = clips_tensor([clip_for(entry, np.random.default_rng(0))])
    with pytest.raises(RewardInputError, match=r"metadata\[0\]: field 'direction'"):
        reward(video, [], [{k: v for k, v in entry.items() if k != "direction"}])
    with pytest.raises(RewardInputError, match=r"field 'motion'.*means \[-1, 0\]"):
        reward(video, [], [{**entry, "motion": [1, 0]}])
    with pytest.raises(RewardInputError, match="one clause"):
        reward.check_inputs([], [{**entry, "include": entry["include"] * 2}])
    with pytest.raises(ValueError, match=r"videos \[B, F, 3, H, W\].*\(1, 3, 32, 32\)"):
        reward(video[:, 0], [], [entry])
    with pytest.raises(ValueError, match="1 videos but 2 metadata"):
        reward(video, [], [entry, entry])
    with pytest.raises(RewardInputError, match="direction"):
        judge_clip({**entry, "direction": "sideways"}, [], (32, 32))


def test_paired_difference_reads_the_partial_credit_by_name():
    from flowalign.evaluation.toy_eval import paired_difference

    def rows(values):
        return [{"prompt_id": i, "image_index": 0, "tag": "colors", "prompt": "p", "correct": v == 1.0, "partial": v}
                for i, v in enumerate(values)]

    before, after = rows([0.25, 0.5, 0.0]), rows([0.75, 0.5, 1.0])
    partial = paired_difference(before, after, score="partial")["overall"]
    # d = (0.5, 0, 1): mean 0.5, std (ddof 1) 0.5, SE 0.5 / sqrt(3)
    assert partial["diff"] == pytest.approx(0.5) and partial["se"] == pytest.approx(0.5 / 3 ** 0.5)
    assert paired_difference(before, after)["overall"]["diff"] == pytest.approx(1 / 3)  # correct: 0, 0, 0 -> 0, 0, 1
