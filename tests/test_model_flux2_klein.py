"""FLUX.2-Klein beyond the adapter contract: the latent space (batch-norm normalised 2x2 patches) against the
pipeline's VAE path, the encoder layers, distilled models without CFG, and the model preset on the tiny pipeline."""

from pathlib import Path

import torch

from flowalign.config import load_config
from flowalign.models import Flux2KleinModel
from flowalign.models.flux2 import klein_out_layers
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from model_families import tiny_pipeline
from test_presets import assert_kl_follows_the_lora, small_run

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def test_encode_images_is_the_pipelines_condition_image_path_and_to_vae_latents_undoes_it():
    pipe = tiny_pipeline("flux2_klein")
    model = Flux2KleinModel(pipe)
    x = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.encode_images(x)
        expected = pipe._encode_vae_image(pipe.image_processor.preprocess(x), generator=None)
        mode = pipe.vae.encode(pipe.image_processor.preprocess(x)).latent_dist.mode()
    assert tuple(ours.shape) == model.latent_shape(2, (32, 48)) == (2, 16, 8, 12)
    assert torch.equal(ours, expected)
    torch.testing.assert_close(model.to_vae_latents(ours), mode, rtol=1e-5, atol=1e-5)


def test_text_features_are_the_chosen_encoder_layers_side_by_side():
    assert klein_out_layers(36) == (9, 18, 27) and klein_out_layers(28) == (9, 18, 27)
    assert klein_out_layers(4) == (1, 2, 3)
    pipe = tiny_pipeline("flux2_klein")
    model = Flux2KleinModel(pipe)
    cond = model.encode(PROMPTS)
    assert cond.embeds.shape == (2, model.max_sequence_length, 3 * pipe.text_encoder.config.hidden_size)
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = pipe.tokenizer(text, return_tensors="pt", padding="max_length", max_length=model.max_sequence_length)
    with torch.no_grad():
        hidden = pipe.text_encoder(**ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(cond.embeds[:1], torch.cat([hidden[k] for k in (1, 2, 3)], dim=-1))


def test_a_distilled_klein_takes_no_cfg():
    pipe = tiny_pipeline("flux2_klein")
    model = Flux2KleinModel(pipe)
    assert model.uses_cfg(4.0)
    pipe.register_to_config(is_distilled=True)
    try:
        assert not model.uses_cfg(4.0)
        cond = model.encode(PROMPTS)
        x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model.velocity(x, 0.5, cond, 4.0), model.velocity(x, 0.5, cond))
    finally:
        pipe.register_to_config(is_distilled=False)


def test_flux2_klein_preset_has_the_published_settings_and_runs_on_a_tiny_klein(tmp_path):
    preset = load_config(TrainConfig, REPO / "configs/models/flux2_klein.yaml", [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.guidance_scale, preset.sampling.noise_level,
            preset.sampling.window_size, preset.model.lora_rank, preset.model.lora_alpha, preset.data.group_size,
            preset.loss["grpo"].beta, preset.optim.lr, preset.sampling.image_size) == \
        ("flux2_klein", 4, 1.0, 0.5, 1, 64, 128, 16, 0.0, 3e-4, 384)
    tiny_pipeline("flux2_klein").save_pretrained(tmp_path / "klein")
    config = load_config(TrainConfig, REPO / "configs/models/flux2_klein.yaml", small_run(
        tmp_path / "klein", tmp_path / "run", **{"sampling.image_size": 32}))
    trainer = Trainer(config)
    adapted = {n.split(".lora_")[0] for n, _ in trainer.model.transformer.named_parameters() if "lora_A" in n}
    assert all(any(n.endswith(part) for n in adapted) for part in ("ff.linear_in", "ff_context.linear_out",
                                                                   "attn.to_qkv_mlp_proj"))
    history = trainer.train()
    assert history[-1]["nfe"] == 2 * 2 * 4  # no CFG: one pass per step
    assert_kl_follows_the_lora(config, history)
