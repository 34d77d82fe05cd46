"""Z-Image beyond the adapter contract: its time and sign conventions and CFG form, the per-prompt token lists, the
VAE path, and the model preset on the tiny pipeline."""

from pathlib import Path

import torch

from flowalign.config import load_config
from flowalign.models import ZImageModel
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from model_families import tiny_pipeline
from test_presets import assert_kl_follows_the_lora, small_run

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def test_model_time_is_flipped_the_output_negated_and_cfg_is_the_usual_form_at_scale_plus_one():
    model = ZImageModel(tiny_pipeline("z_image"))
    cond = model.encode(PROMPTS, negative_prompts=["", ""])
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32
    sigma = 0.7
    with torch.no_grad():
        raw = {}
        for name, (embeds, mask) in {"pos": (cond.embeds, cond.mask), "neg": (cond.negative_embeds,
                                                                               cond.negative_mask)}.items():
            out = model.transformer([row[:, None] for row in x], torch.full((2,), 1 - sigma),
                                    [e[m] for e, m in zip(embeds, mask)], return_dict=False)[0]
            raw[name] = torch.stack(out).squeeze(2)
        plain = model.velocity(x, sigma, cond)
        guided = model.velocity(x, sigma, cond, guidance_scale=4.0)
    torch.testing.assert_close(plain, -raw["pos"], rtol=1e-6, atol=1e-6)  # model time 1 - sigma, output negated
    usual = -(raw["neg"] + 4.0 * (raw["pos"] - raw["neg"]))  # flowalign's scale 4 = the pipeline's 3
    torch.testing.assert_close(guided, usual, rtol=1e-5, atol=1e-5)
    assert not model.uses_cfg(1.0) and model.uses_cfg(1.5)


def test_prompts_keep_only_their_own_tokens_and_rows_regroup():
    pipe = tiny_pipeline("z_image")
    model = ZImageModel(pipe)
    cond = model.encode(PROMPTS)
    templated = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True) for p in PROMPTS]
    assert templated[0] == "<|im_start|>user\na photo of a red circle<|im_end|>\n<|im_start|>assistant\n"
    assert cond.mask.sum(dim=1).tolist() == [len(pipe.tokenizer(t).input_ids) for t in templated]
    assert torch.isfinite(cond.embeds).all() and (cond.embeds[~cond.mask] == 0).all()
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        both = model.velocity(x, 0.5, cond)
        second = model.velocity(x[1:], 0.5, cond.index([1]))  # a padded row alone: its padding is dropped again
    assert torch.isfinite(both).all()
    torch.testing.assert_close(second, both[1:], rtol=1e-5, atol=1e-5)


def test_encode_images_is_the_img2img_pipelines_vae_path():
    model = ZImageModel(tiny_pipeline("z_image"))
    vae = model.pipe.vae
    x = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.encode_images(x, sample=True, generator=torch.Generator().manual_seed(3))
        pixels = model.pipe.image_processor.preprocess(x)
        posterior = vae.encode(pixels).latent_dist
        expected = (posterior.sample(torch.Generator().manual_seed(3)) - vae.config.shift_factor) \
            * vae.config.scaling_factor
    assert tuple(ours.shape) == model.latent_shape(2, (32, 48)) and ours.dtype == torch.float32
    assert torch.equal(ours, expected)


def test_z_image_preset_has_the_published_settings_and_runs_on_a_tiny_z_image(tmp_path):
    preset = load_config(TrainConfig, REPO / "configs/models/z_image.yaml", [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.guidance_scale, preset.sampling.noise_level,
            preset.sampling.window_size, preset.model.lora_rank, preset.model.lora_alpha, preset.data.group_size,
            preset.loss["grpo"].beta, preset.optim.lr, preset.sampling.image_size) == \
        ("z_image", 10, 5.0, 0.7, 1, 64, 128, 16, 0.0, 3e-4, 512)
    tiny_pipeline("z_image").save_pretrained(tmp_path / "z_image")
    config = load_config(TrainConfig, REPO / "configs/models/z_image.yaml", small_run(
        tmp_path / "z_image", tmp_path / "run", **{"sampling.image_size": 32}))
    history = Trainer(config).train()
    assert history[-1]["nfe"] == 2 * 2 * 10 * 2  # CFG doubles the evaluations
    assert_kl_follows_the_lora(config, history)
