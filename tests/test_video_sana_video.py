"""SANA-Video beyond the video adapter contract: SANA's text (a complex human instruction), its own family when
loaded, the released flow DPM-Solver's sigmas, LoRA on the feed-forward's pointwise convolutions, and the pipeline's
frame-side rule."""

import pytest
import torch

from flowalign.models import SanaVideoModel, load_flow_model, wrap_pipeline
from flowalign.samplers import rollout

from video_families import fresh_video_pipeline, tiny_video_pipeline

PROMPTS = ["a red circle moving to the left", "two blue squares moving up"]


def test_sana_video_with_a_complex_human_instruction_is_the_pipeline_with_it_bitwise():
    pipe = tiny_video_pipeline("sana_video")
    instruction = ["describe the video of the shapes:", "the prompt:"]
    model = SanaVideoModel(pipe, num_frames=5, complex_human_instruction=instruction)
    cond = model.encode(PROMPTS, negative_prompts=["", ""])
    # Token 0 plus the last max_sequence_length - 1 tokens of the instruction-prefixed prompt; the mask is passed.
    assert cond.embeds.shape[1] == cond.negative_embeds.shape[1] == model.max_sequence_length
    assert cond.mask is not None and not torch.equal(cond.embeds, wrap_pipeline(pipe, num_frames=5).encode(PROMPTS).embeds)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32 and x.shape == (2, 4, 2, 8, 8)
    with torch.no_grad():
        ours = rollout(model.velocity_fn(cond, 3.0), x, model.sigmas(3, 32), torch.zeros(3)).final
    expected = pipe(prompt=PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                    output_type="latent", height=32, width=32, frames=5, guidance_scale=3.0,
                    use_resolution_binning=False, max_sequence_length=model.max_sequence_length,
                    complex_human_instruction=instruction).frames
    assert torch.equal(ours, expected)


def test_a_saved_sana_video_pipeline_loads_as_its_own_family(tmp_path):
    tiny_video_pipeline("sana_video").save_pretrained(tmp_path / "sana_video")
    model = load_flow_model(tmp_path / "sana_video", adapter_options={"num_frames": 5})
    assert type(model) is SanaVideoModel and model.default_image_size == (480, 832)
    in_memory = wrap_pipeline(tiny_video_pipeline("sana_video"), num_frames=5)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.velocity(x, 0.7, model.encode(PROMPTS)),
                           in_memory.velocity(x, 0.7, in_memory.encode(PROMPTS)))


def test_sigmas_are_the_released_flow_dpm_solver_sigmas():
    """diffusers' conversion of SANA-Video 480p ships DPMSolverMultistepScheduler over flow sigmas with flow_shift 8:
    the adapter's sigmas are that scheduler's."""
    from diffusers import DPMSolverMultistepScheduler

    pipe = fresh_video_pipeline("sana_video")
    pipe.scheduler = DPMSolverMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    model = wrap_pipeline(pipe, num_frames=5)
    sigmas = model.sigmas(6, 32)
    released = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    released.set_timesteps(6)
    assert torch.equal(sigmas, released.sigmas.float()) and len(sigmas) == 7 and sigmas[-1] == 0
    assert bool((sigmas.diff() < 0).all())


def test_lora_reaches_the_feed_forwards_pointwise_convolutions_and_not_its_depthwise_ones():
    model = wrap_pipeline(fresh_video_pipeline("sana_video"), num_frames=5)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    model.add_lora(rank=2, alpha=4)
    adapted = {n.split(".lora_")[0] for n, _ in model.transformer.named_parameters() if "lora_A" in n}
    assert {"transformer_blocks.0.ff.conv_inverted", "transformer_blocks.0.ff.conv_point"} <= adapted
    assert not any("conv_depth" in n or "conv_temp" in n for n in adapted)
    with torch.no_grad():
        base = model.velocity(x, 0.6, cond)
        for name, parameter in model.transformer.named_parameters():
            if "lora_B" in name and ".ff." in name:
                parameter.fill_(0.05)
        assert not torch.allclose(model.velocity(x, 0.6, cond), base)


def test_frame_sides_must_be_multiples_of_thirty_two_as_the_pipeline_says():
    model = wrap_pipeline(tiny_video_pipeline("sana_video"), num_frames=5)
    assert model.image_multiple == 32
    with pytest.raises(ValueError, match="multiple of 32"):
        model.encode_videos(torch.rand(1, 5, 3, 16, 16))


def test_the_preset_samples_at_the_models_inference_defaults():
    from pathlib import Path

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    preset = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/models/sana_video.yaml", [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.guidance_scale, preset.sampling.image_size,
            preset.sampling.num_frames, preset.model.lora_targets) == ("sana_video", 50, 6.0, None, 81, None)
    model = wrap_pipeline(tiny_video_pipeline("sana_video"), num_frames=preset.sampling.num_frames)
    assert model.default_image_size == (480, 832) and model.latent_frames() == 21
