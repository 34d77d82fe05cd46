"""Every method on video latents ``[B, C, f, h, w]``: each method preset trains 2 iterations on the tiny Wan2.1 T2V
pipeline (5 frames -> 2 latent frames, 16 px) with the ``video_brightness`` reward, its first ratio exactly 1 where it
has one; a run resumes bitwise; the generic math (every SDE kind's log-prob, the GRPO loss terms) is the same on a
video latent as on the image latent its frames fold into; the VAE decode batch and tiling and gradient checkpointing
reach the video model.

The objectives on image-caption pairs (``sft``, ``soar``) have no video data source yet: a video model refuses them
before it loads (tests/test_video_config.py), and here they are checked to do so.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import ConfigError, load_config
from flowalign.rewards import REWARDS, VideoBrightnessReward, register_reward
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import METHODS, SMALL_RUN_SHAPE, small_run_values
from video_families import tiny_video_pipeline

FRAMES, SIZE = 5, 16
# The presets whose objective trains on image-caption pairs: refused on a video model (no video data source yet).
IMAGE_DATA_PRESETS = {"sft": "objectives.flow_matching.data", "soar": "objectives.soar.data"}


def test_video_brightness_is_the_mean_of_the_frames_mean_brightness():
    videos = torch.zeros(2, 3, 3, 2, 2)
    videos[0, 0] = 1.0  # one white frame of three: 1/3
    videos[1, :, 0] = 0.5  # the red channel at 0.5 in every frame: 0.5 / 3 per frame
    videos[1, 2, 1] = 1.0  # and frame 2 green: (0.5 + 1) / 3 there
    reward = VideoBrightnessReward()
    expected = torch.tensor([1 / 3, (0.5 / 3 + 0.5 / 3 + 1.5 / 3) / 3])
    torch.testing.assert_close(reward(videos, ["a", "b"], [{}, {}]), expected)
    torch.testing.assert_close(VideoBrightnessReward(channel=1)(videos, ["a", "b"], [{}, {}]),
                               torch.tensor([1 / 3, 1 / 3]))
    pixels = videos.clone().requires_grad_(True)
    reward.forward(pixels).sum().backward()
    assert torch.equal(pixels.grad, torch.full_like(videos, 1 / (3 * 3 * 2 * 2)))
    assert reward.modality == "video" and REWARDS.get("video_brightness") is VideoBrightnessReward
    with pytest.raises(ValueError, match=r"video_brightness scores videos \[B, F, 3, H, W\], got shape \(2, 3, 2, 2\)"):
        reward(videos[:, 0], ["a", "b"], [{}, {}])


@pytest.fixture(scope="module")
def wan_path(tmp_path_factory):
    """The tiny Wan2.1 T2V pipeline, saved once for the module."""
    path = tmp_path_factory.mktemp("video") / "wan"
    tiny_video_pipeline("wan").save_pretrained(path)
    return path


@pytest.fixture
def channel_rewards():
    """Two more video rewards (one colour channel's brightness each) for GARDO's auxiliaries; unregistered after."""
    register_reward("video_red", _video_factory(0, "video_red"))
    register_reward("video_blue", _video_factory(2, "video_blue"))
    yield
    REWARDS.unregister("video_red")
    REWARDS.unregister("video_blue")


def _named(reward, name):
    reward.name = name
    return reward


def _video_factory(channel: int, name: str):
    """A factory of ``VideoBrightnessReward`` on one colour channel, declaring that it scores videos (a factory that
    is not a class says so itself: flowalign.rewards.reward_modality)."""
    def factory(**kwargs):
        return _named(VideoBrightnessReward(channel=channel, **kwargs), name)

    factory.modality = "video"
    return factory


def video_values(model_path, out, **extra) -> dict:
    """A preset's small run (golden_runs.small_run_values with its SMALL_RUN_SHAPE) on video: 5 frames of 16 px,
    scored by video_brightness."""
    return {**small_run_values(model_path, out), "sampling.image_size": SIZE, "sampling.num_frames": FRAMES,
            "reward.rewards": "[{name: video_brightness}]", **extra}


def preset_extra(name: str, model_path, tmp_path) -> dict:
    """What a preset needs on the tiny Wan beyond its small run: the video twin of each image-only part."""
    extra = dict(SMALL_RUN_SHAPE.get(name, {}))
    if name == "euphonium":
        extra["credit.process_reward"] = "video_brightness"
    if name == "pref_grpo":  # the stand-in pairwise judge on each frame's brightness, its win rates averaged per clip
        extra["reward.rewards"] = ("[{name: pairwise_preference, weight: 0.4, frames: {aggregate: mean}, kwargs: "
                                   "{judge: score, judge_kwargs: {reward: brightness}}}, "
                                   "{name: video_brightness, weight: 0.6}]")
    if name == "gardo":  # GARDO's proxy against two auxiliary video rewards, kept out of the advantage
        extra["reward.rewards"] = ("[{name: video_brightness}, {name: video_red, weight: 0.0}, "
                                   "{name: video_blue, weight: 0.0}]")
        extra["loss.gated_kl.auxiliaries"] = "[video_red, video_blue]"
    if name == "drl_adjoint":  # adjoint matching's reward gradient through the decoded videos
        extra["objectives.adjoint_matching.reward"] = "video_brightness"
        extra["objectives.adjoint_matching.reward_kwargs"] = "{}"
        # its outlier threshold, one iteration behind, masks every unit of iteration 1 on this tiny reward's losses
        extra["objectives.adjoint_matching.clip"] = "false"
    if name == "register_grpo":  # registers sized for the tiny Wan transformer, read on its video tokens
        from diffusers import WanTransformer3DModel
        from flowalign.reward_models.latent_registers import LatentRegisters

        with torch.random.fork_rng():
            torch.manual_seed(0)
            transformer = WanTransformer3DModel.from_pretrained(model_path / "transformer")
            checkpoint = LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(
                tmp_path / "r.pt")
        extra["credit.registers"] = str(checkpoint)
        extra["loss.rg_opd.weight"] = 0.5  # and RG-OPD's regression onto RGS targets from the same registers
        extra["loss.rg_opd.registers"] = str(checkpoint)
    if name.startswith("shell_lcc"):  # a manifold over the Wan VAE's 4 latent channels, every latent frame a point
        from test_shell_lcc import tiny_manifold

        manifold = tiny_manifold(model_path, tmp_path / "manifold.safetensors")
        if name == "shell_lcc":
            extra["reward.rewards"] = f"[{{name: shell_lcc, kwargs: {{path: {manifold}, variant: band}}}}]"
            extra["loss.rg_opd.weight"] = 0.5  # the latent reward as RG-OPD's gradient source, on video latents
            extra["loss.rg_opd.reward"] = "shell_lcc"
            extra["loss.rg_opd.reward_kwargs"] = f"{{path: {manifold}}}"
        else:
            extra["objectives.shell_lcc.path"] = str(manifold)
            extra["objectives.shell_lcc.batch_size"] = 2
    return extra


def video_config(name, model_path, out, **extra):
    preset = next(p for p in METHODS if p.stem == name)
    values = video_values(model_path, out, **extra)
    return load_config(TrainConfig, preset, [f"{k}={v}" for k, v in values.items()])


@pytest.mark.parametrize("name", [p.stem for p in METHODS])
def test_every_method_preset_trains_two_iterations_on_the_tiny_wan(name, wan_path, tmp_path, channel_rewards):
    if name in IMAGE_DATA_PRESETS:  # no video data source: refused before the model loads, naming the key
        config = video_config(name, wan_path, tmp_path / "run", **SMALL_RUN_SHAPE.get(name, {}))
        with pytest.raises(ConfigError, match=IMAGE_DATA_PRESETS[name].replace(".", r"\.") + ".*video"):
            Trainer(config)
        return
    config = video_config(name, wan_path, tmp_path / "run", **preset_extra(name, wan_path, tmp_path))
    trainer = Trainer(config)
    assert trainer.model.modality == "video" and trainer.model.num_frames == FRAMES
    history = trainer.train()
    assert len(history) == 2
    losses = [v for h in history for k, v in h.items() if k == "loss" or (k.startswith("objectives/")
                                                                          and k.endswith("/loss"))]
    assert losses and all(math.isfinite(v) for v in losses), history
    assert all(h["grad_norm"] > 0 for h in history), [h["grad_norm"] for h in history]
    if config.loss:  # a method with a ratio: its first micro-batch is on the rollout's own policy
        assert history[0]["first_ratio_max"] == 1.0
    if "reward" in history[0]:
        assert 0 < history[0]["reward"] < 1 or name.startswith("shell_lcc")
    if name in ("register_grpo", "shell_lcc"):
        assert history[0]["rg_opd"] > 0


def test_a_video_run_resumes_bitwise(wan_path, tmp_path):
    extra = {"train.checkpoint_every": 1, "optim.ema_decay": 0.5}
    full = Trainer(video_config("flow_grpo", wan_path, tmp_path / "full", **extra)).train()
    Trainer(video_config("flow_grpo", wan_path, tmp_path / "split", **extra, **{"train.iterations": 1})).train()
    resumed = Trainer(video_config("flow_grpo", wan_path, tmp_path / "split", **extra, **{"train.resume": "latest"}))
    assert resumed.iteration == 1
    history = resumed.train()
    assert [h["reward"] for h in history[1:]] == [h["reward"] for h in full[1:]]
    for part in ("trainable", "ema"):
        a = load_file(str(tmp_path / "full" / "checkpoint-000002" / f"{part}.safetensors"))
        b = load_file(str(tmp_path / "split" / "checkpoint-000002" / f"{part}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("guidance,budget", [("none", 3), ("bon", 6), ("fk", 6), ("dts", 8), ("rgs", 8),
                                             ("euphonium", 12), ("satisdive", 40)])
def test_every_guided_sampler_runs_on_video_latents(guidance, budget, wan_path):
    """``run_guided`` with each registered sampler on the tiny Wan at 3 steps, scoring (and guiding by) the decoded
    videos' brightness: finite rewards of the sampled videos within the budget, latents with a frame axis."""
    from flowalign.inference import SAMPLERS
    from flowalign.inference.sample import SampleConfig, run_guided
    from flowalign.models import load_flow_model

    assert {"none", "bon", "fk", "dts", "rgs", "euphonium", "satisdive"} >= set(SAMPLERS.names())
    model = load_flow_model(wan_path, adapter_options={"num_frames": FRAMES})
    model.transformer.requires_grad_(False)
    # run_guided samples at the model's default size: the Wan adapter reads it from the transformer's sample_size
    model.transformer.register_to_config(sample_size=SIZE // model.vae_scale_factor)
    assert model.default_image_size == (SIZE, SIZE)
    guided = {"rgs_reward": "video_brightness"} if guidance in ("rgs", "euphonium", "satisdive") else {}
    config = SampleConfig(guidance=guidance, budget=budget, steps=3, candidates=2 if guidance == "satisdive" else 1,
                          **guided)
    config.validate()
    metadata = [{"prompt": "a red circle moving to the left"}, {"prompt": "two blue squares moving up"}]
    reward = VideoBrightnessReward()
    result = run_guided(model, metadata, config, reward_fn=reward, guide_reward=reward)
    candidates = (2,) if guidance == "satisdive" else ()  # a set of K candidates per prompt
    assert result.final.shape == (2, *candidates, *model.latent_shape(1, SIZE)[1:])
    assert torch.isfinite(result.reward).all()
    assert ((result.reward > 0) & (result.reward < 1)).all() and (result.nfe <= budget).all()


VIDEO, FOLDED = (4, 3, 2, 4, 5), (4, 6, 4, 5)  # [B, C, f, h, w] and the same elements as an image [B, C f, h, w]


def linear_velocity(x, sigma):
    """An elementwise velocity: the same function of each element whatever the layout."""
    return 0.3 * x - 0.5 * torch.as_tensor(sigma, dtype=x.dtype)


@pytest.mark.parametrize("kind", sorted(__import__("flowalign.samplers", fromlist=["SDE_KINDS"]).SDE_KINDS))
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_every_sde_kind_and_the_grpo_loss_are_the_same_on_video_as_on_its_folded_image_layout(kind, reduce):
    """The SDE kinds, the rollout's log-probs and the GRPO transition loss (policy, KL, gradient; the torch reference
    of the Triton path) reduce over every axis but the batch: on a video latent they are bitwise what they are on
    the same elements laid out as an image latent."""
    from flowalign.losses.grpo import transition_grpo_loss
    from flowalign.samplers import noise_schedule, rollout

    x = torch.randn(VIDEO, generator=torch.Generator().manual_seed(0))
    sigmas, levels = torch.linspace(1.0, 0.0, 5), noise_schedule(0.7).levels(4)
    runs = [rollout(linear_velocity, x.reshape(shape), sigmas, levels, kind=kind, reduce=reduce,
                    generator=torch.Generator().manual_seed(1)) for shape in (VIDEO, FOLDED)]
    video, image = runs
    assert video.final.shape == VIDEO and video.transitions.stochastic.any()
    assert torch.equal(video.final.reshape(FOLDED), image.final)
    assert torch.equal(video.transitions.log_prob, image.transitions.log_prob)
    t = video.transitions
    step = int(t.stochastic.nonzero()[0, 0])
    rows = (t.step == step).nonzero().flatten()
    losses = []
    for shape in (VIDEO, FOLDED):
        x_t = t.states[t.src[rows]].reshape(len(rows), *shape[1:])
        x_next = t.states[t.dst[rows]].reshape(x_t.shape)
        v = (linear_velocity(x_t, t.sigma[rows][0]) + 0.01).requires_grad_(True)
        loss, _ = transition_grpo_loss(v, x_t, x_next, t.sigma[rows], t.sigma_next[rows], t.log_prob[rows],
                                       torch.tensor([1.0, -1.0, 0.5, -0.5])[: len(rows)], clip_range=0.2, kind=kind,
                                       noise_level=t.noise_level[rows], noise_scale=t.noise_scale[rows], reduce=reduce,
                                       v_ref=linear_velocity(x_t, t.sigma[rows][0]).detach(), beta=0.1,
                                       backend="torch")
        loss.backward()
        losses.append((loss.detach(), v.grad.reshape(len(rows), -1)))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


def test_gradient_checkpointing_covers_the_wan_transformer_with_the_same_loss_and_gradients(wan_path, tmp_path):
    """model.gradient_checkpointing reaches the video transformer: its blocks' layers run again in the backward (a
    forward hook on a block's attention projection fires twice), and the velocity and the LoRA gradients are bitwise
    those without it."""
    results = []
    for checkpointing in (False, True):
        config = video_config("flow_grpo", wan_path, tmp_path / str(checkpointing),
                              **{"model.gradient_checkpointing": str(checkpointing).lower()})
        trainer = Trainer(config)
        transformer = trainer.model.transformer
        assert transformer.gradient_checkpointing is checkpointing
        calls = []
        hook = transformer.blocks[0].attn1.to_q.register_forward_hook(lambda *args: calls.append(1))
        cond = trainer.model.encode(["a red circle moving to the left", "two blue squares moving up"])
        x = trainer.model.prepare_noise(2, SIZE, generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        with torch.no_grad():  # a LoRA away from zero, so its A matrices get gradients too
            for name, p in transformer.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape) * 0.1)
        v = trainer.model.velocity(x, 0.6, cond)
        v.pow(2).mean().backward()
        hook.remove()
        grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}
        results.append((len(calls), v.detach(), grads))
    (plain_calls, plain_v, plain_grads), (ckpt_calls, ckpt_v, ckpt_grads) = results
    assert (plain_calls, ckpt_calls) == (1, 2)
    assert torch.equal(plain_v, ckpt_v) and plain_grads.keys() == ckpt_grads.keys() and plain_grads
    assert all(torch.equal(plain_grads[n], ckpt_grads[n]) for n in plain_grads)


def test_the_vae_decodes_a_rollout_vae_batch_videos_per_call_with_its_own_tiling(wan_path, tmp_path):
    """model.vae_batch and model.vae_tiling reach the adapter: the rollout's 4 videos are decoded 2 per VAE call (so
    the VAE holds at most 2 x 5 frames), with the VAE's tiling on, to the videos of one call per video."""
    config = video_config("flow_grpo", wan_path, tmp_path / "run",
                          **{"model.vae_batch": 2, "model.vae_tiling": "true", "train.iterations": 1,
                             "train.sample_every": 1})
    trainer = Trainer(config)
    model = trainer.model
    assert model.vae_batch == 2 and model.vae_tiling and model.pipe.vae.use_tiling
    rows = []
    hook = model.pipe.vae.decoder.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    history = trainer.train()
    hook.remove()
    assert rows and max(rows) == 2 and sum(rows) % 4 == 0  # 2 prompts x 2 videos, 2 per call
    assert history[0]["first_ratio_max"] == 1.0
    from PIL import Image

    from flowalign.evaluation.images import cell_size

    with Image.open(tmp_path / "run" / "samples" / "iteration-000000.png") as grid:  # frame strips, 2 a row
        width, height = cell_size(SIZE, FRAMES * SIZE)
        assert grid.size == (2 * width, 2 * height)
    latents = model.prepare_noise(4, SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = model.decode(latents)
        model.vae_batch = 1
        single = model.decode(latents)
    assert batched.shape == (4, FRAMES, 3, SIZE, SIZE)
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-6)


def test_every_credit_estimator_and_loss_term_is_covered_on_video(wan_path, tmp_path):
    """Every registered credit estimator and loss term runs in a preset above, but return-to-go (no preset) and
    RG-OPD on a video reward, which run here."""
    from flowalign.credit import CREDIT
    from flowalign.losses import LOSSES

    presets = [video_config(p.stem, wan_path, tmp_path / p.stem, **SMALL_RUN_SHAPE.get(p.stem, {})) for p in METHODS]
    covered = {c.credit.name for c in presets}
    assert set(CREDIT.names()) - covered == {"return_to_go"}
    assert set(LOSSES.names()) == {"grpo", "gated_kl", "rg_opd"}  # gardo; register_grpo and shell_lcc
    history = Trainer(video_config("flow_grpo", wan_path, tmp_path / "run", **{
        "credit.name": "return_to_go", "loss.rg_opd.weight": 0.5, "loss.rg_opd.reward": "video_brightness"})).train()
    assert history[0]["first_ratio_max"] == 1.0 and history[0]["rg_opd"] > 0
    assert all(math.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in history)
