"""Video rewards: image rewards over frames, the modality check, temporal consistency, motion, Shell-LCC on video
latents. Every expected value is computed by hand from the clip's construction."""

from __future__ import annotations

import math

import pytest
import torch

from flowalign.config import ConfigError
from flowalign.errors import RewardInputError
from flowalign.reward_models.frames import FrameAggregation, frame_indices, over_frames, parse_frames
from flowalign.rewards import BrightnessReward, check_reward_modality, differentiable_score, reward_modality


def flat_clip(levels, batch=1, size=4):
    """``[batch, F, 3, size, size]``: frame j of video b is the constant ``levels[b][j]`` (or ``levels[j]``)."""
    rows = levels if isinstance(levels[0], (list, tuple)) else [levels] * batch
    return torch.tensor(rows, dtype=torch.float32)[:, :, None, None, None].expand(-1, -1, 3, size, size).clone()


# ------------------------------------------------------------------------------------------- frame aggregation
def test_frame_indices_every_and_count():
    assert frame_indices(5) == [0, 1, 2, 3, 4]
    assert frame_indices(5, every=2) == [0, 2, 4]
    assert frame_indices(6, every=4) == [0, 4]
    assert frame_indices(5, count=3) == [0, 2, 4]
    assert frame_indices(5, count=2) == [0, 4]
    assert frame_indices(5, count=1) == [0]
    assert frame_indices(3, count=8) == [0, 1, 2]


def test_mean_min_and_weights_over_frames_by_hand():
    levels = [[0.1, 0.5, 0.3, 0.9, 0.2], [0.4, 0.4, 0.0, 0.8, 0.6]]
    clip = flat_clip(levels)
    prompts, meta = ["a", "b"], [{}, {}]
    mean = over_frames(BrightnessReward(), {"aggregate": "mean"})
    assert mean.modality == "video" and reward_modality(mean) == "video"
    assert mean(clip, prompts, meta).tolist() == pytest.approx([2.0 / 5, 2.2 / 5])
    assert over_frames(BrightnessReward(), {"aggregate": "min"})(clip, prompts, meta).tolist() == pytest.approx(
        [0.1, 0.0])
    # every 2nd frame: frames 0, 2, 4
    assert over_frames(BrightnessReward(), {"every": 2})(clip, prompts, meta).tolist() == pytest.approx(
        [0.6 / 3, 1.0 / 3])
    # weights 1, 0, 3 over frames 0, 2, 4 (count 3), divided by their sum 4
    weighted = over_frames(BrightnessReward(), {"weights": [1, 0, 3], "count": 3})
    assert weighted(clip, prompts, meta).tolist() == pytest.approx([(0.1 + 3 * 0.2) / 4, (0.4 + 3 * 0.6) / 4])


def test_a_nan_frame_makes_the_video_invalid():
    def half_nan(images, prompts, metadata):
        scores = images.flatten(1).mean(1)
        return torch.where(scores > 0.7, torch.full_like(scores, math.nan), scores)

    clip = flat_clip([[0.1, 0.9, 0.3], [0.1, 0.2, 0.3]])
    for aggregate in ("mean", "min"):
        out = over_frames(half_nan, {"aggregate": aggregate})(clip, ["a", "b"], [{}, {}])
        assert math.isnan(out[0]) and not math.isnan(out[1])


def test_weights_of_another_length_than_the_frames_read_are_refused():
    reward = over_frames(BrightnessReward(), {"weights": [1, 1, 1]})
    with pytest.raises(RewardInputError, match=r"frames.weights has 3 weights but a video of 5 frames has 5 frames"):
        reward(flat_clip([0.1] * 5), ["a"], [{}])
    assert reward(flat_clip([0.1, 0.2, 0.6]), ["a"], [{}]).tolist() == pytest.approx([0.3])
    with pytest.raises(RewardInputError, match=r"scores videos \[B, F, 3, H, W\]"):
        reward(torch.zeros(1, 3, 4, 4), ["a"], [{}])


@pytest.mark.parametrize("frames, key, message", [
    ({"aggregate": "median"}, "reward.rewards[0].frames.aggregate", "one of mean, min, weights"),
    ({"weights": [1, -1]}, "reward.rewards[0].frames.weights", ">= 0"),
    ({"weights": [0, 0]}, "reward.rewards[0].frames.weights", "positive sum"),
    ({"aggregate": "mean", "weights": [1, 2]}, "reward.rewards[0].frames.weights", "aggregate: weights"),
    ({"every": 0}, "reward.rewards[0].frames.every", "integer >= 1"),
    ({"every": 2, "count": 3}, "reward.rewards[0].frames.count", "set one of them"),
    ({"weights": [1, 2], "count": 3}, "reward.rewards[0].frames.weights", "one weight per frame"),
    ({"stride": 2}, "reward.rewards[0].frames.stride", "not a frames setting"),
    ("mean", "reward.rewards[0].frames", "must be a mapping"),
])
def test_malformed_frames_are_config_errors_naming_the_key(frames, key, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_frames(frames, "reward.rewards[0].frames")
    assert error.value.key == key


def test_frames_are_differentiable_through_a_zoo_reward(tmp_path):
    from reward_fixtures import tiny_pickscore_dirs

    from flowalign.reward_models.pickscore import PickScore

    model, processor = tiny_pickscore_dirs(tmp_path)
    image_reward = PickScore(model=str(model), processor=str(processor))
    video_reward = over_frames(image_reward, {"weights": [1.0, 3.0], "every": 2})
    assert callable(getattr(video_reward, "forward", None))
    torch.manual_seed(0)
    clip = torch.rand(1, 3, 3, 32, 32, requires_grad=True)
    score = differentiable_score(video_reward, clip, ["a red circle"], [{}])
    (grad,) = torch.autograd.grad(score.sum(), clip)
    # by hand: 1/4 of frame 0's score and gradient plus 3/4 of frame 2's; frame 1 is not read
    frames = clip.detach()[0, [0, 2]].clone().requires_grad_(True)
    per_frame = image_reward.forward(frames, ["a red circle"] * 2)
    (frame_grad,) = torch.autograd.grad((per_frame * torch.tensor([0.25, 0.75])).sum(), frames)
    assert score.item() == pytest.approx((0.25 * per_frame[0] + 0.75 * per_frame[1]).item(), rel=1e-5)
    assert torch.allclose(grad[0, [0, 2]], frame_grad, rtol=1e-4, atol=1e-7)
    assert grad[0, 1].abs().max() == 0
    # values only: the same number without a graph
    assert video_reward(clip.detach(), ["a red circle"], [{}]).item() == pytest.approx(score.item(), rel=1e-5)


# ------------------------------------------------------------------------------------------- modality check
def test_check_reward_modality_refuses_mismatches_naming_the_key():
    check_reward_modality([{"name": "brightness"}], "image")
    check_reward_modality([{"name": "brightness", "frames": {"aggregate": "min"}}], "video")
    check_reward_modality([{"name": "shell_lcc"}], "video")  # a latent reward reads either
    cases = [
        ([{"name": "brightness"}], "video", "reward.rewards[0].frames", "frames: {aggregate: mean}"),
        ([{"name": "brightness"}, {"name": "motion"}], "image", "reward.rewards[1].name", "is a video reward"),
        ([{"name": "brightness", "frames": {}}], "image", "reward.rewards[0].frames", "remove"),
        ([{"name": "motion", "frames": {}}], "video", "reward.rewards[0].frames", "a video reward"),
        ([{"name": "shell_lcc", "frames": {}}], "video", "reward.rewards[0].frames", "a latent reward"),
        ([{"name": "brightness", "frames": {"aggregate": "max"}}], "video", "reward.rewards[0].frames.aggregate",
         "one of"),
    ]
    for specs, modality, key, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            check_reward_modality(specs, modality)
        assert error.value.key == key, (specs, modality)
    with pytest.raises(ConfigError, match="samples 5 frames of which 3 are read: give 3 weights") as error:
        check_reward_modality([{"name": "brightness", "frames": {"weights": [1, 2], "every": 2}}], "video",
                              num_frames=5)
    assert error.value.key == "reward.rewards[0].frames.weights"


def test_the_train_config_refuses_a_reward_that_does_not_fit_the_model_before_it_loads(tmp_path):
    from pathlib import Path

    from flowalign.training.builder import check_rewards_fit_modality, build_rewards
    from flowalign.training.config import TrainConfig

    toy = str(Path(__file__).resolve().parents[1] / "assets/toy-sd3")  # an image model: model_index.json only
    config = TrainConfig()
    config.model.path = toy
    config.reward.rewards[0].name, config.reward.rewards[0].kwargs = "motion", {}
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\].name = 'motion' is a video reward") as error:
        check_rewards_fit_modality(config)
    assert error.value.key == "reward.rewards[0].name"
    config.reward.rewards[0].name, config.reward.rewards[0].frames = "brightness", {"aggregate": "min"}
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\].frames scores a video's frames"):
        check_rewards_fit_modality(config)

    class VideoModel:  # the modality of a video adapter, read from its class (flowalign.models.video)
        modality = "video"

    check_rewards_fit_modality(config, VideoModel())
    (name, weight, reward), = build_rewards(config)
    assert name == "brightness" and reward.modality == "video"
    assert reward(flat_clip([0.3, 0.1, 0.2]), ["a"], [{}]).tolist() == pytest.approx([0.1])
    config.reward.rewards[0].frames = None
    with pytest.raises(ConfigError, match=r"frames: \{aggregate: mean\}"):
        check_rewards_fit_modality(config, VideoModel())
    config.reward.rewards[0].frames = {"aggregate": "mode"}
    with pytest.raises(ConfigError, match="one of mean, min, weights") as error:
        config.reward.validate()
    assert error.value.key == "reward.rewards[0].frames.aggregate"


# ------------------------------------------------------------------------------------------- temporal consistency
def test_temporal_consistency_by_hand_with_a_pooled_pixel_embedding():
    from flowalign.rewards import build_reward

    # pixels with grid 1: the frame's mean colour minus 0.5, made a unit vector
    colours = [[1.0, 0.5, 0.5], [0.5, 1.0, 0.5], [1.0, 1.0, 0.5], [1.0, 1.0, 0.5]]  # e: x, y, (x+y)/sqrt2, same
    clip = torch.tensor(colours)[None, :, :, None, None].expand(1, 4, 3, 4, 4).clone()
    reward = build_reward("temporal_consistency", embedding="pixels", embedding_kwargs={"grid": 1})
    assert reward_modality("temporal_consistency") == "video"
    expected = (0.0 + 1 / math.sqrt(2) + 1.0) / 3
    assert reward(clip, ["a"], [{}]).tolist() == pytest.approx([expected], abs=1e-6)
    still = clip[:, :1].expand(1, 5, 3, 4, 4)
    assert reward(still, ["a"], [{}]).tolist() == pytest.approx([1.0], abs=1e-6)
    # the differentiable entry point: d/dx of the similarity, through the embedding's forward
    x = clip.clone().requires_grad_(True)
    score = differentiable_score(reward, x, ["a"], [{}])
    assert score.item() == pytest.approx(expected, abs=1e-6) and score.requires_grad
    with pytest.raises(RewardInputError, match="at least two"):
        reward(clip[:, :1], ["a"], [{}])


def test_temporal_consistency_takes_any_registered_embedding():
    from flowalign.embeddings import EMBEDDINGS, register_embedding
    from flowalign.rewards import build_reward, check_reward_run

    class Brightness2D:
        """A deterministic embedding: (mean brightness, 1 - mean brightness), unit-normalised by the reward."""

        def forward(self, images):
            level = images.flatten(1).mean(1)
            return torch.stack([level, 1 - level], dim=1)

        embed = forward

    register_embedding("test_brightness_2d", lambda: Brightness2D())
    try:
        reward = build_reward("temporal_consistency", embedding="test_brightness_2d")
        # levels 0, 1, 0.5: e = (0, 1), (1, 0), (1, 1)/sqrt2 -> cos 0 and 1/sqrt2
        score = reward(flat_clip([0.0, 1.0, 0.5]), ["a"], [{}])
        assert score.tolist() == pytest.approx([(0 + 1 / math.sqrt(2)) / 2], abs=1e-6)
        with pytest.raises(ConfigError, match="unknown image embedding 'nope'") as error:
            check_reward_run("temporal_consistency", {"embedding": "nope"}, key="reward.rewards[0].kwargs",
                             model=None)
        assert error.value.key == "reward.rewards[0].kwargs.embedding"
    finally:
        EMBEDDINGS.unregister("test_brightness_2d")


# ------------------------------------------------------------------------------------------- motion
def textured_clip(dx: int, dy: int, frames: int = 4, size: int = 48) -> torch.Tensor:
    """``[1, F, 3, size, size]``: a smooth random texture whose content moves ``(dx, dy)`` pixels a frame (x right,
    y down): frame k is the window of a larger texture shifted by ``-k (dx, dy)``."""
    g = torch.Generator().manual_seed(0)
    texture = torch.nn.functional.interpolate(torch.rand(1, 3, 36, 36, generator=g), size=(144, 144), mode="bicubic",
                                              align_corners=False).clamp(0, 1)[0]
    return torch.stack([texture[:, 48 - k * dy: 48 - k * dy + size, 48 - k * dx: 48 - k * dx + size]
                        for k in range(frames)])[None]


@pytest.mark.parametrize("method", ["dis", "farneback"])
def test_motion_measures_a_known_translation_and_zero_for_a_still_clip(method):
    from flowalign.rewards import build_reward

    size = 48
    reward = build_reward("motion", method=method)
    clips = torch.cat([textured_clip(0, 0), textured_clip(2, 0), textured_clip(-1, 2)])
    scores = reward(clips, ["a"] * 3, [{}] * 3) * size  # pixels per frame
    assert scores[0].item() == pytest.approx(0.0, abs=0.02)
    assert scores[1].item() == pytest.approx(2.0, abs=0.1)
    assert scores[2].item() == pytest.approx(math.sqrt(5), abs=0.1)
    along_x = build_reward("motion", method=method, direction=[3, 0])(clips, ["a"] * 3, [{}] * 3) * size
    assert along_x.tolist() == pytest.approx([0.0, 2.0, -1.0], abs=0.1)


def test_the_flow_of_a_translating_square_is_its_displacement():
    from flowalign.reward_models.motion import optical_flow

    size, side, step = 48, 12, 3
    g = torch.Generator().manual_seed(1)
    patch = torch.rand(3, side, side, generator=g) * 0.5 + 0.5
    clip = torch.full((3, 3, size, size), 0.2)
    for k in range(3):
        clip[k, :, 16:16 + side, 8 + k * step: 8 + k * step + side] = patch
    for method in ("dis", "farneback"):
        flow = optical_flow(clip[1], clip[2], method)
        inside = flow[19:25, 8 + step + 3: 8 + step + side - 3].reshape(-1, 2).mean(0)  # the square's interior
        assert inside.tolist() == pytest.approx([step, 0.0], abs=0.25), method
        assert abs(optical_flow(clip[1], clip[1], method)).max() < 1e-3  # the square standing still


def test_motion_refuses_single_frames_and_images():
    from flowalign.reward_models.motion import MotionScore

    with pytest.raises(RewardInputError, match="at least two"):
        MotionScore()(torch.zeros(1, 1, 3, 8, 8), ["a"])
    with pytest.raises(RewardInputError, match=r"\[B, F, 3, H, W\]"):
        MotionScore()(torch.zeros(1, 3, 8, 8), ["a"])
    with pytest.raises(ValueError, match="direction must be a non-zero"):
        MotionScore(direction=[0, 0])


# ------------------------------------------------------------------------------------------- Shell-LCC on video latents
def test_shell_lcc_scores_video_latents_by_hand(tmp_path):
    """Shell-LCC's video setting (docs/methods/shell_lcc.md): every latent position of every frame is a point, and R
    is the mean of d over all of them. One basis (so the coding is 1 whatever the predictor says), skeleton
    ``(1, 0)``, a surface head answering ``log 2``: ``d = ||z - (1, 0)|| / (2 + 1e-6)``."""
    from flowalign.reward_models.shell_lcc import ShellLCC, ShellLCCReward, save_manifold
    from flowalign.rewards import score_all

    manifold = ShellLCC(embedding_dim=2, num_bases=1, hidden_dim=2).eval()
    with torch.no_grad():
        manifold.basis.copy_(torch.tensor([[1.0, 0.0]]))
        manifold.surface_head[2].weight.zero_()
        manifold.surface_head[2].bias.fill_(math.log(2.0))
    path = save_manifold(manifold, tmp_path / "m.safetensors", fitted_for=None, extra={"data_distance": 1.0})
    # [B=2, C=2, f=3, h=1, w=2]; sample 0: one position at (4, 4) (distance 5), five at (1, 2) (distance 2);
    # sample 1: positions at (1, 3) and (-2, 0) (distance 3 each)
    z = torch.empty(2, 2, 3, 1, 2)
    z[0, 0], z[0, 1] = 1.0, 2.0
    z[0, :, 1, 0, 1] = torch.tensor([4.0, 4.0])
    z[1, 0, :, :, 0], z[1, 1, :, :, 0] = 1.0, 3.0
    z[1, 0, :, :, 1], z[1, 1, :, :, 1] = -2.0, 0.0
    scale = 2.0 + 1e-6
    expected = torch.tensor([(5.0 + 5 * 2.0) / 6 / scale, 3.0 / scale])
    for variant, tau, want in (("distance", None, -expected), ("band", 1.0, -(expected - 1.0).abs())):
        reward = ShellLCCReward(str(path), variant=variant, tau=tau)
        assert torch.allclose(reward(z, ["a", "b"], [{}, {}]), want, rtol=1e-6)
        # score_all hands a latent reward the video latents in place of the decoded videos
        frames = torch.zeros(2, 3, 3, 4, 4)
        raw = score_all([("shell_lcc", 1.0, reward)], frames, ["a", "b"], [{}, {}], latents=z).raw[0]
        assert torch.allclose(raw, want, rtol=1e-6)
    # the gradient by hand: d R_0 / d z at (4, 4) is the unit vector (3, 4) / 5 over 6 positions and the scale
    x = z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(ShellLCCReward(str(path), variant="distance").forward(x)[0], x)
    assert torch.allclose(grad[0, :, 1, 0, 1], -torch.tensor([0.6, 0.8]) / 6 / scale, rtol=1e-5)
    assert torch.allclose(grad[0, :, 0, 0, 0], -torch.tensor([0.0, 1.0]) / 6 / scale, rtol=1e-5)
    assert grad[1].abs().sum() == 0
    # a video of one latent frame is the image latent (B, C, h, w)
    assert torch.equal(manifold.sample_distances(z[:, :, :1]), manifold.sample_distances(z[:, :, 0]))
