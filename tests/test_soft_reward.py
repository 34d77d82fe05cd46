"""The toy shape segmenter and the differentiable toy-GenEval surrogate (``toy_geneval_soft``) built on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowalign.toy.scenes import Shape, render
from flowalign.toy.segmenter import (CLASSES, SegmenterConfig, degrade, load_segmenter, measure, scene_batch,
                                     train_segmenter)
from flowalign.toy.soft_reward import SoftToyGenEval, shape_area


def image(*shapes: Shape) -> torch.Tensor:
    """A clean render as ``[1, 3, 32, 32]`` in [0, 1]."""
    return torch.from_numpy(render(list(shapes))).permute(2, 0, 1)[None].float() / 255.0


@pytest.fixture(scope="module")
def soft():
    return SoftToyGenEval()


def test_the_embedded_segmenter_labels_fresh_scenes(soft):
    report = measure(soft.segmenter, np.random.default_rng(123), torch.Generator().manual_seed(0), SegmenterConfig(),
                     scenes=64)
    assert report["clean_pixel_accuracy"] > 0.98 and report["clean_object_pixel_accuracy"] > 0.9
    assert report["degraded_object_pixel_accuracy"] > 0.8


def test_training_a_segmenter_lowers_its_loss_and_saves_what_load_reads(tmp_path):
    config = SegmenterConfig(steps=30, batch_size=16, threads=1)
    threads = torch.get_num_threads()
    model = train_segmenter(config, tmp_path / "seg", log_every=0)
    assert torch.get_num_threads() == threads  # restored
    loaded = load_segmenter(tmp_path / "seg")
    images, _ = scene_batch(np.random.default_rng(5), 4)
    assert torch.equal(model(images), loaded(images))
    assert not any(p.requires_grad for p in loaded.parameters())
    assert set(loaded.state_dict()) == set(model.state_dict())


def test_load_segmenter_names_the_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="flowalign toy segmenter --out"):
        load_segmenter(tmp_path / "absent")


def test_degrade_keeps_pixels_in_range_and_blurs():
    images, _ = scene_batch(np.random.default_rng(0), 8)
    out = degrade(images, torch.Generator().manual_seed(0), SegmenterConfig(max_blur=1.5, max_fade=0.0, noise=0.0))
    assert out.shape == images.shape and out.min() >= 0 and out.max() <= 1
    # a blur spreads mass but keeps each channel's mean (replicate padding, grey borders)
    assert torch.allclose(out.mean(dim=(2, 3)), images.mean(dim=(2, 3)), atol=0.01)


def test_shape_areas_follow_the_sampled_sizes():
    # squares of 9-13 px: mean of 81..169; triangles about half a square, circles about pi/4 of one
    assert shape_area("square") == pytest.approx(np.mean([s * s for s in range(9, 14)]))
    assert 0.45 < shape_area("triangle") / shape_area("square") < 0.6
    assert 0.7 < shape_area("circle") / shape_area("square") < 0.82


RED_SQUARE = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}], "prompt": "a red square"}


def test_the_right_object_scores_high_and_wrong_ones_low(soft):
    right = soft(image(Shape("square", "red", 16, 16, 12)), ["p"], [RED_SQUARE])
    wrong_color = soft(image(Shape("square", "blue", 16, 16, 12)), ["p"], [RED_SQUARE])
    wrong_shape = soft(image(Shape("circle", "red", 16, 16, 12)), ["p"], [RED_SQUARE])
    empty = soft(image(), ["p"], [RED_SQUARE])
    assert right.item() > 0.9
    assert wrong_color.item() < 0.1 and wrong_shape.item() < 0.3 and empty.item() < 0.05


def test_position_counting_and_exclude_clauses(soft):
    left_of = {"tag": "position", "prompt": "a circle left of a square", "include": [
        {"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    right = image(Shape("circle", "green", 8.5, 16.5, 11), Shape("square", "blue", 23.5, 16.5, 11))
    swapped = image(Shape("circle", "green", 23.5, 16.5, 11), Shape("square", "blue", 8.5, 16.5, 11))
    scores = soft(torch.cat([right, swapped]), ["p", "p"], [left_of, left_of])
    assert scores[0] > 0.9 and scores[1] < 0.6  # the square's unit holds either way; the circle's needs "left of"

    two_circles = {"tag": "counting", "prompt": "two circles", "include": [{"class": "circle", "count": 2}],
                   "exclude": [{"class": "circle", "count": 3}]}
    one = image(Shape("circle", "red", 8.5, 8.5, 11))
    two = image(Shape("circle", "red", 8.5, 8.5, 11), Shape("circle", "red", 23.5, 23.5, 11))
    four = image(*[Shape("circle", "red", x, y, 11) for x in (8.5, 23.5) for y in (8.5, 23.5)])
    one_score, two_score, four_score = soft(torch.cat([one, two, four]), ["p"] * 3, [two_circles] * 3).tolist()
    assert two_score > 0.9 and two_score > one_score + 0.2 and two_score > four_score + 0.3


def test_the_gradient_reaches_the_pixels_and_ascending_it_raises_the_score(soft):
    start = image(Shape("square", "purple", 16, 16, 12))  # a purple square for "a red square"
    pixels = start.clone().requires_grad_(True)
    for _ in range(30):
        score = soft(pixels, ["p"], [RED_SQUARE])
        (grad,) = torch.autograd.grad(score.sum(), pixels)
        assert torch.isfinite(grad).all()
        with torch.no_grad():
            pixels += 0.05 * grad / grad.abs().max().clamp_min(1e-12)
            pixels.clamp_(0, 1)
    assert soft(pixels.detach(), ["p"], [RED_SQUARE]).item() > soft(start, ["p"], [RED_SQUARE]).item() + 0.3


def test_bad_input_names_the_problem(soft):
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        soft(torch.zeros(1, 1, 32, 32), ["p"], [RED_SQUARE])
    with pytest.raises(ValueError, match="2 images but 1 metadata"):
        soft(torch.zeros(2, 3, 32, 32), ["p"], [RED_SQUARE])


def test_it_is_registered_and_declares_its_gradient():
    from flowalign.rewards import build_reward

    reward = build_reward("toy_geneval_soft")
    assert reward.differentiable is True and reward.name == "toy_geneval_soft"
    assert CLASSES[0] == "background"


def test_flowalign_toy_segmenter_trains_and_saves(tmp_path, capsys):
    from flowalign.cli import main

    out = tmp_path / "seg"
    assert main(["toy", "segmenter", "--steps", "3", "--batch-size", "4", "--threads", "1", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and "clean_pixel_accuracy" in capsys.readouterr().out
    load_segmenter(out)
