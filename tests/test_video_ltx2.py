"""LTX-2 (audio-video) beyond the video adapter contract: the held audio stream is the pipeline's own audio draw and
really conditions the video; without it held the pipeline's joint sampling differs; the x0-space guidance rescale
against the pipeline's; the velocity at sigma 0; the connectors' sequence-length rule; the LoRA targets are
Flow-Factory's 28 projections a block."""

from __future__ import annotations

import pytest
import torch

from flowalign.models.ltx2 import AUDIO_TEXT, NEGATIVE_AUDIO_TEXT

from test_video_families import PROMPTS, adapter_latents, perturb_lora, pipeline_output, wrap
from video_families import VIDEO_FAMILIES, fresh_video_pipeline, ltx2_audio_held, tiny_video_pipeline


def test_the_held_audio_is_the_pipelines_own_audio_draw_for_the_seed():
    pipe = tiny_video_pipeline("ltx2")
    model = wrap("ltx2", audio_seed=7)
    audio_vae = pipe.audio_vae
    frames = model.audio_latent_frames()
    theirs = pipe.prepare_audio_latents(1, audio_vae.config.latent_channels, frames, audio_vae.config.mel_bins,
                                        dtype=torch.float32, device="cpu", generator=torch.Generator().manual_seed(7))
    held = model.held_audio(3)
    assert frames == 5  # 5 frames at 24 fps, 16 kHz, hop 160, 4x in time: round(0.2083 * 25)
    assert held.shape == (3, *theirs.shape[1:]) and held.is_contiguous()
    assert all(torch.equal(row, theirs[0]) for row in held)


def test_the_audio_stream_conditions_the_video_and_only_the_held_draw_makes_the_pipeline_equal():
    model = wrap("ltx2")
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, (32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        held = model.velocity(x, 0.6, cond)
        other_draw = wrap("ltx2", audio_seed=1).velocity(x, 0.6, cond)
    assert not torch.allclose(held, other_draw)  # the video stream attends to the audio tokens
    family = VIDEO_FAMILIES["ltx2"]
    joint = pipeline_output(tiny_video_pipeline("ltx2"), model, family, steps=3, size=(32, 32), guidance=1.0,
                            output_type="latent")
    ours = family.pipeline_layout(model, adapter_latents(model, family, steps=3, size=(32, 32), guidance=1.0))
    assert not torch.allclose(ours, joint)  # the pipeline's joint sampling denoises its audio alongside


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_guidance_rescale_is_the_pipelines_bitwise(guidance):
    family, pipe = VIDEO_FAMILIES["ltx2"], tiny_video_pipeline("ltx2")
    model = wrap("ltx2", guidance_rescale=0.7)
    call = family.call
    with ltx2_audio_held():
        expected = pipe(prompt=PROMPTS, num_inference_steps=3, output_type="latent", height=32, width=64,
                        num_frames=family.frames, generator=torch.Generator().manual_seed(0),
                        **{**call(model, guidance), "guidance_rescale": 0.7, "audio_guidance_rescale": 0.7}).frames
    ours = adapter_latents(model, family, steps=3, size=(32, 64), guidance=guidance)
    plain = adapter_latents(wrap("ltx2"), family, steps=3, size=(32, 64), guidance=guidance)
    assert torch.equal(family.pipeline_layout(model, ours), expected)
    if guidance == 1.0:  # without CFG x0 is rescaled against itself: the same within rounding
        torch.testing.assert_close(ours, plain, rtol=0, atol=1e-5)
    else:
        assert not torch.allclose(ours, plain, rtol=0, atol=1e-4)


def test_the_velocity_at_sigma_zero_is_the_plain_guided_velocity_with_finite_gradients():
    model = wrap("ltx2")
    cond = model.encode(PROMPTS, negative_prompts=["", ""])
    x = model.prepare_noise(2, (32, 32), generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    sigma = torch.tensor([0.0, 0.5])
    v = model.velocity(x, sigma, cond, guidance_scale=3.0)
    v.sum().backward()
    assert torch.isfinite(v).all() and torch.isfinite(x.grad).all()
    with torch.no_grad():
        raw = model.transformer(
            hidden_states=model.pack(x[:1]).repeat(2, 1, 1), audio_hidden_states=model.held_audio(2),
            encoder_hidden_states=torch.cat([cond.negative_embeds[:1], cond.embeds[:1]]),
            audio_encoder_hidden_states=torch.cat([cond.extras[NEGATIVE_AUDIO_TEXT][:1], cond.extras[AUDIO_TEXT][:1]]),
            timestep=torch.zeros(2), audio_timestep=torch.full((2,), 1000.0), sigma=torch.zeros(2),
            audio_sigma=torch.full((2,), 1000.0), encoder_attention_mask=torch.cat([cond.negative_mask[:1],
                                                                                    cond.mask[:1]]),
            audio_encoder_attention_mask=torch.cat([cond.negative_mask[:1], cond.mask[:1]]),
            num_frames=3, height=8, width=8, fps=model.frame_rate, audio_num_frames=model.audio_latent_frames(),
            use_cross_timestep=True, return_dict=False)[0].float()
        uncond, text = raw.chunk(2)
        expected = model.unpack(uncond + 3.0 * (text - uncond), (3, 8, 8))
    torch.testing.assert_close(v[:1].detach(), expected, rtol=0, atol=1e-5)  # batch of 4 vs 2: rounding


def test_a_sequence_length_the_connectors_registers_cannot_tile_is_refused():
    with pytest.raises(ValueError, match=r"max_sequence_length=10: .* 4 learnable registers.*multiple of 4"):
        wrap("ltx2", max_sequence_length=10)
    assert wrap("ltx2", max_sequence_length=8).max_sequence_length == 8


def test_lora_covers_flow_factorys_28_projections_a_block():
    from flowalign.models.ltx2 import LTX2_LORA_TARGETS

    assert len(LTX2_LORA_TARGETS) == 28 == len(set(LTX2_LORA_TARGETS))
    block = tiny_video_pipeline("ltx2").transformer.transformer_blocks[0]
    linear = {name for name, module in block.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(LTX2_LORA_TARGETS) <= linear


def test_the_ltx2_preset_has_flow_factorys_ltx2_settings_and_frames_the_vae_takes():
    from pathlib import Path

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    preset = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/models/ltx2.yaml", [])
    s = preset.sampling
    assert (preset.model.family, s.num_steps, s.kind, s.noise_level, s.stochastic_steps(), s.guidance_scale,
            s.num_frames, preset.model.lora_rank, preset.model.lora_alpha, preset.optim.lr, preset.data.group_size,
            preset.loss["grpo"].beta, preset.loss["grpo"].clip_range, preset.advantage.clip) == \
        ("ltx2", 24, "cps", 0.8, 3, 1.0, 121, 64, 128, 3e-4, 16, 0.0, 1e-4, 5.0)
    model = wrap("ltx2")
    # Flow-Factory's 512x768 at 24 fps are the adapter's defaults; 121 = 8 * 15 + 1 = 2 * 60 + 1 (released, tiny VAE).
    assert model.default_image_size == (512, 768) and model.frame_rate == 24.0 and model.guidance_rescale == 0.0
    assert model.check_num_frames(s.num_frames) == 121


def test_the_video_loss_reaches_the_audio_streams_weights_up_to_the_audio_to_video_attention():
    model = wrap("ltx2", fresh_video_pipeline("ltx2"))
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, (32, 32), generator=torch.Generator().manual_seed(0))
    model.add_lora(rank=2, alpha=4)
    model.freeze_base()
    perturb_lora(model)
    model.velocity(x, 0.6, cond).square().sum().backward()
    grads = {name.split(".lora_")[0].split("blocks.0.")[1]: parameter.grad
             for name, parameter in model.transformer.named_parameters() if "lora_A" in name}
    reached = {name for name, grad in grads.items() if grad is not None and grad.abs().sum() > 0}
    assert {"audio_attn1.to_q", "audio_attn2.to_v", "audio_to_video_attn.to_k", "attn1.to_q", "ff.net.2"} <= reached
    assert not reached & {"audio_ff.net.0.proj", "audio_ff.net.2", "video_to_audio_attn.to_q"}  # audio-only, 1 block


def test_the_x0_space_guidance_detaches_the_unconditional_branch_inside_unconditional_detached():
    from flowalign.models.base import unconditional_detached

    model = wrap("ltx2")
    latents = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    v = torch.randn(4, 6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    both = model.guided_velocity(latents, v, 0.6, 3.0)
    both.sum().backward()
    assert (v.grad[:2] != 0).any()  # the unconditional rows: (1 - g) each
    v.grad = None
    with unconditional_detached():
        conditional = model.guided_velocity(latents, v, 0.6, 3.0)
    conditional.sum().backward()
    torch.testing.assert_close(conditional, both, rtol=0, atol=1e-6)
    assert torch.equal(v.grad[:2], torch.zeros_like(v.grad[:2])) and (v.grad[2:] != 0).all()
