"""Qwen-Image beyond the adapter contract: its VAE path against the img2img pipeline's, the template prefix the
pipeline drops, the text mask, and the model preset on the tiny pipeline."""

from pathlib import Path

import torch

from flowalign.config import load_config
from flowalign.models import QwenImageModel
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from model_families import WORDS, tiny_pipeline
from test_presets import assert_kl_follows_the_lora, small_run

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def images(batch, height, width, seed=0):
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def test_encode_images_is_the_img2img_pipelines_vae_path_and_decode_inverts_it():
    from diffusers import QwenImageImg2ImgPipeline

    pipe = tiny_pipeline("qwen_image")
    model = QwenImageModel(pipe)
    img2img = QwenImageImg2ImgPipeline(**pipe.components)
    x = images(2, 32, 48)
    pixels = img2img.image_processor.preprocess(x).unsqueeze(2)  # [B, 3, 1, H, W], as its __call__ prepares them
    with torch.no_grad():
        ours = model.encode_images(x, sample=True, generator=torch.Generator().manual_seed(3))
        expected = img2img._encode_vae_image(pixels, torch.Generator().manual_seed(3))
        rows = model.encode_images(x, sample=True, generator=[torch.Generator().manual_seed(k) for k in (5, 6)])
        expected_rows = img2img._encode_vae_image(pixels, [torch.Generator().manual_seed(k) for k in (5, 6)])
        mode = model.encode_images(x)
        decoded = model.decode(mode)
    assert tuple(ours.shape) == model.latent_shape(2, (32, 48)) == (2, 4, 8, 12)
    assert torch.equal(ours, expected[:, :, 0]) and torch.equal(rows, expected_rows[:, :, 0])
    assert not torch.equal(ours, mode)
    assert decoded.shape == x.shape and decoded.min() >= 0 and decoded.max() <= 1


def test_the_pipeline_drops_exactly_the_template_prefix_and_masks_the_padding():
    pipe = tiny_pipeline("qwen_image")
    model = QwenImageModel(pipe)
    assert pipe.prompt_template_encode_start_idx == 34  # diffusers' own template and index, kept by the tiny pipeline
    cond = model.encode(PROMPTS)
    # What is left after the drop: the prompt's own tokens, then the turn's end and the assistant header.
    tails = [len(pipe.tokenizer(pipe.prompt_template_encode.format(p)).input_ids) - 34 for p in PROMPTS]
    user = [len(pipe.tokenizer(p, add_special_tokens=False).input_ids) for p in PROMPTS]
    assert cond.mask.sum(dim=1).tolist() == tails and [t - u for t, u in zip(tails, user)] == [6, 6]
    assert cond.embeds.shape[1] == max(tails) and not cond.mask.all()
    # The padding is masked out: a row's velocity in the padded batch is its velocity alone.
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = model.velocity(x, 0.6, cond)
        alone = model.velocity(x[:1], 0.6, model.encode(PROMPTS[:1]))
    assert model.encode(PROMPTS[:1]).embeds.shape[1] < cond.embeds.shape[1]
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-5)


def test_qwen_image_preset_has_the_published_settings_and_runs_on_a_tiny_qwen_image(tmp_path):
    preset = load_config(TrainConfig, REPO / "configs/models/qwen_image.yaml", [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.guidance_scale, preset.sampling.noise_level,
            preset.sampling.window_size, preset.model.lora_rank, preset.model.lora_alpha, preset.data.group_size,
            preset.loss["grpo"].beta, preset.optim.lr, preset.sampling.image_size) == \
        ("qwen_image", 10, 4.0, 1.2, 2, 64, 128, 16, 0.0, 3e-4, 512)
    tiny_pipeline("qwen_image").save_pretrained(tmp_path / "qwen_image")
    config = load_config(TrainConfig, REPO / "configs/models/qwen_image.yaml", small_run(
        tmp_path / "qwen_image", tmp_path / "run", **{"sampling.image_size": 32}))
    trainer = Trainer(config)
    adapted = {n.split(".lora_")[0] for n, _ in trainer.model.transformer.named_parameters() if "lora_A" in n}
    assert all(any(f".{part}." in n for n in adapted) for part in ("attn", "img_mlp", "txt_mlp"))
    history = trainer.train()
    assert history[-1]["nfe"] == 2 * 2 * 10 * 2  # true CFG doubles the evaluations
    assert_kl_follows_the_lora(config, history)
