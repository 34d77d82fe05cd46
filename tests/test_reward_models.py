"""The reward model zoo on tiny random backbones of each architecture family: preprocessing, formulas, batching,
checkpoint round trips through the local-path loaders, the differentiable entry point (gradients to the images, dtype),
and the errors for missing weights and odd images."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import torch.nn.functional as F

from flowalign.rewards import (
    REWARDS,
    build_differentiable_reward,
    build_reward,
    differentiable_rewards,
    differentiable_score,
    require_differentiable,
    reward_class,
)
from flowalign.reward_models.images import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    as_image_batch,
    resize_longest_pad_square,
    resize_shortest_center_crop,
)
from flowalign.reward_models.weights import MissingWeightsError
from reward_fixtures import (
    image_reward_installed,
    register_tiny_open_clip,
    tiny_imagereward_files,
    tiny_open_clip_checkpoint,
    tiny_pickscore_dirs,
    tiny_zoo_kwargs,
)

PROMPTS = ["a photo of a red circle", "a photo of a blue square", "a photo of a green cat"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip")
    register_tiny_open_clip(directory)
    return directory


@pytest.fixture(scope="module")
def clip_ckpt(clip_dir):
    return tiny_open_clip_checkpoint(clip_dir, seed=0)


def _images(batch=3, height=40, width=56, seed=0):
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def _normalized(x):
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


# ----------------------------------------------------------------------------------------------- images


def test_as_image_batch_converts_modes_and_layouts():
    rgb = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    reference = torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255
    assert torch.equal(as_image_batch(Image.fromarray(rgb)), reference)
    rgba = Image.fromarray(np.dstack([rgb, np.full((20, 30), 7, np.uint8)]), "RGBA")
    assert torch.equal(as_image_batch(rgba), reference)  # alpha dropped, as PIL's convert("RGB")
    grey = as_image_batch(Image.fromarray(rgb[..., 0], "L"))
    assert torch.equal(grey, reference[:, :1].expand(1, 3, 20, 30))  # the one channel, repeated to RGB
    assert torch.equal(as_image_batch(rgb), reference)  # numpy HWC uint8
    assert torch.equal(as_image_batch(torch.from_numpy(rgb)[None]), reference)  # channels-last tensor
    assert as_image_batch(torch.full((3, 4, 4), 2.0)).max() == 1.0  # clamped
    with pytest.raises(ValueError, match="different sizes"):
        as_image_batch([Image.fromarray(rgb), Image.fromarray(rgb[:10])])


def _bicubic(x, size):
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)


def test_resize_helpers_by_hand():
    x = _images(2, 48, 64)
    # shorter side 48 -> 32: 48x64 -> 32x43 (rounded), then the centred 32 columns 5..36
    assert torch.equal(resize_shortest_center_crop(x, 32), _bicubic(x, (32, 43))[..., :, 5:37])
    assert torch.equal(resize_shortest_center_crop(x[..., :32, :32], 32), x[..., :32, :32])  # already square: kept
    flat = torch.full((1, 3, 48, 64), 0.25)
    assert torch.allclose(resize_shortest_center_crop(flat, 32), torch.full((1, 3, 32, 32), 0.25), atol=1e-6)
    padded = resize_longest_pad_square(x, 32, fill=0.0)
    # 48x64 -> 24x32: 4 rows of fill on top and on the bottom, none on the sides, the resized image between
    assert torch.all(padded[..., :4, :] == 0) and torch.all(padded[..., -4:, :] == 0)
    assert torch.equal(padded[..., 4:28, :], _bicubic(x, (24, 32)))
    odd_input = _images(1, 64, 35)
    odd = resize_longest_pad_square(odd_input, 32, fill=0.5)  # 64x35 -> 32x18 (rounded): pad 7 left, 7 right
    assert torch.all(odd[..., :, :7] == 0.5) and torch.all(odd[..., :, -7:] == 0.5)
    assert torch.equal(odd[..., :, 7:25], _bicubic(odd_input, (32, 18)))


# ----------------------------------------------------------------------------------------------- HPS v2


@pytest.fixture(scope="module")
def hps(clip_dir, clip_ckpt):
    from flowalign.reward_models.hps import HPSv2

    return HPSv2(str(clip_ckpt), model_name="flowalign-tiny-clip", device="cpu", batch_size=2)


def test_hps_preprocessing_and_formula(hps):
    images = _images(3, 48, 64)
    pixels = hps.preprocess(images)
    assert pixels.shape == (3, 3, 32, 32)
    pad = _normalized(torch.zeros(1, 3, 1, 1)).view(3)
    assert torch.allclose(pixels[0, :, 0, 0], pad)  # black padding, then normalised
    model = hps.model
    image_features = model.encode_image(pixels)
    text_features = model.encode_text(hps.tokenizer(PROMPTS))
    expected = torch.nn.functional.cosine_similarity(image_features, text_features, dim=-1)
    scores = hps(images, PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert torch.allclose(scores, expected, atol=1e-5)


def test_hps_batch_invariance_and_gradient(hps):
    images = _images(3, 48, 64)
    together = hps(images, PROMPTS)  # batch_size=2: chunks of 2 and 1
    alone = torch.cat([hps(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5)
    leaf = images.clone().requires_grad_(True)
    hps.forward(leaf, PROMPTS).sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_hps_checkpoint_round_trip(clip_dir, hps, tmp_path):
    from flowalign.reward_models.hps import HPSv2

    path = tmp_path / "resaved.pt"
    torch.save({key: value.clone() for key, value in hps.model.state_dict().items()}, path)  # plain state dict
    again = HPSv2(str(path), model_name="flowalign-tiny-clip", device="cpu")
    images = _images(2, 32, 32, seed=3)
    assert torch.allclose(again(images, PROMPTS[:2]), hps(images, PROMPTS[:2]), atol=1e-6)
    other = HPSv2(str(tiny_open_clip_checkpoint(clip_dir, seed=1)), model_name="flowalign-tiny-clip", device="cpu")
    assert not torch.allclose(other(images, PROMPTS[:2]), hps(images, PROMPTS[:2]))  # the weights really load


def test_hps_missing_checkpoint_names_file_source_and_key(tmp_path):
    missing = tmp_path / "HPS_v2.1_compressed.pt"
    with pytest.raises(MissingWeightsError) as error:
        build_reward("hps", checkpoint=str(missing))
    message = str(error.value)
    assert str(missing) in message and "xswu/HPSv2" in message and "reward.rewards[i].kwargs.checkpoint" in message


def test_hps_wrong_image_mode_and_size_converted(hps):
    rgb = (np.random.default_rng(1).random((40, 30, 3)) * 255).astype(np.uint8)
    as_rgb = hps(Image.fromarray(rgb), PROMPTS[:1])
    as_rgba = hps(Image.fromarray(np.dstack([rgb, np.zeros((40, 30), np.uint8)]), "RGBA"), PROMPTS[:1])
    assert torch.allclose(as_rgb, as_rgba)
    as_grey = hps(Image.fromarray(rgb).convert("L"), PROMPTS[:1])
    # PIL's L: (299 R + 587 G + 114 B) / 1000 in fixed point, rounded; repeated to three channels
    r, g, b = (rgb[..., c].astype(np.int64) for c in range(3))
    luma = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)
    by_hand = hps(torch.from_numpy(luma)[None, None].float().div(255).expand(1, 3, 40, 30), PROMPTS[:1])
    assert torch.allclose(as_grey, by_hand, atol=1e-6) and not torch.allclose(as_grey, as_rgb, atol=1e-4)


# -------------------------------------------------------------------------------------- CLIPScore, aesthetic


def test_clipscore_formula_and_round_trip(clip_dir, clip_ckpt):
    from flowalign.reward_models.clipscore import CLIPScore

    scorer = build_reward("clipscore", weights=str(clip_ckpt), model_name="flowalign-tiny-clip", quick_gelu=False,
                          device="cpu", w=2.5)
    assert isinstance(scorer, CLIPScore)
    images = _images(3, 50, 40)
    pixels = scorer_pixels = resize_shortest_center_crop(images, 32)
    assert scorer_pixels.shape == (3, 3, 32, 32)
    image_features = scorer.model.encode_image(_normalized(pixels))
    text_features = scorer.model.encode_text(scorer.tokenizer(PROMPTS))
    cos = torch.nn.functional.cosine_similarity(image_features, text_features, dim=-1)
    assert torch.allclose(scorer(images, PROMPTS), 2.5 * cos.clamp(min=0), atol=1e-5)
    alone = torch.cat([scorer(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)])
    assert torch.allclose(scorer(images, PROMPTS), alone, atol=1e-5)


def test_aesthetic_formula_round_trip_and_missing_mlp(clip_dir, clip_ckpt, tmp_path):
    from flowalign.reward_models.aesthetic import AestheticMLP

    torch.manual_seed(0)
    mlp = AestheticMLP(input_size=16)
    path = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), path)
    scorer = build_reward("aesthetic", mlp_weights=str(path), clip_weights=str(clip_ckpt),
                          model_name="flowalign-tiny-clip", quick_gelu=False, device="cpu", batch_size=2)
    images = _images(3, 36, 36)
    features = scorer.clip.encode_image(_normalized(resize_shortest_center_crop(images, 32)))
    features = features / features.norm(dim=-1, keepdim=True)
    hidden = features
    for layer in (mlp.layers[0], mlp.layers[2], mlp.layers[4], mlp.layers[6], mlp.layers[7]):  # linear, no activation
        hidden = hidden @ layer.weight.T + layer.bias
    scores = scorer(images, ["ignored"] * 3)
    assert torch.allclose(scores, hidden.squeeze(-1), atol=1e-5)
    assert torch.allclose(scores, torch.cat([scorer(images[i : i + 1], ["x"]) for i in range(3)]), atol=1e-5)
    with pytest.raises(MissingWeightsError, match="improved-aesthetic-predictor.*kwargs.mlp_weights"):
        build_reward("aesthetic", mlp_weights=str(tmp_path / "nope.pth"), clip_weights=str(clip_ckpt))


# ---------------------------------------------------------------------------------------------- PickScore


def test_pickscore_formula_preprocessing_round_trip(tmp_path):
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    model_dir, processor_dir = tiny_pickscore_dirs(tmp_path)
    scorer = build_reward("pickscore", model=str(model_dir), processor=str(processor_dir), device="cpu", batch_size=2)
    images = _images(3, 48, 40)
    pixels = scorer.preprocess(images)
    assert pixels.shape == (3, 3, 32, 32)
    # our torch preprocessing vs the transformers processor (PIL resize on uint8): close, not bit-exact
    uint8 = (images * 255).round().to(torch.uint8)
    reference = CLIPImageProcessor.from_pretrained(processor_dir)(
        images=[img.permute(1, 2, 0).numpy() for img in uint8], return_tensors="pt")["pixel_values"]
    assert (scorer.preprocess(uint8.float() / 255) - reference).abs().mean() < 0.03

    model = CLIPModel.from_pretrained(model_dir)
    tokens = AutoTokenizer.from_pretrained(processor_dir)(PROMPTS, padding=True, return_tensors="pt")
    out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels)
    image_embeds = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    expected = model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1)
    scores = scorer(images, PROMPTS)
    assert torch.allclose(scores, expected, atol=1e-4)
    assert torch.allclose(out.logits_per_image.diagonal(), expected, atol=1e-4)  # transformers' own logits agree
    assert torch.allclose(scores, torch.cat([scorer(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)]),
                          atol=1e-4)


def test_pickscore_missing_directory_names_file(tmp_path):
    _, processor_dir = tiny_pickscore_dirs(tmp_path)
    empty = tmp_path / "PickScore_v1"
    empty.mkdir()
    with pytest.raises(MissingWeightsError) as error:
        build_reward("pickscore", model=str(empty), processor=str(processor_dir))
    assert str(empty / "config.json") in str(error.value) and "kwargs.model" in str(error.value)


# -------------------------------------------------------------------------------------------------- JPEG


def test_jpeg_rewards_match_pil_sizes():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noisy = _images(1, 64, 64)
    images = torch.cat([flat, noisy])
    expected = []
    for image in images:
        buffer = io.BytesIO()
        array = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        expected.append(len(buffer.getvalue()) / 1000)
    compress = build_reward("jpeg_compressibility")
    incompress = build_reward("jpeg_incompressibility")
    assert torch.allclose(compress(images, ["", ""], [{}, {}]), -torch.tensor(expected))
    assert torch.allclose(incompress(images, ["", ""], [{}, {}]), torch.tensor(expected))
    assert compress(images, None)[0] > compress(images, None)[1]  # a flat image compresses better
    with pytest.raises(ValueError, match="'jpeg_compressibility' is not differentiable"):
        require_differentiable(compress, "--rgs-reward")


# ------------------------------------------------------------------------------------------ ImageReward


def test_find_pruneable_heads_by_hand():
    from flowalign.reward_models.imagereward import find_pruneable_heads_and_indices

    heads, index = find_pruneable_heads_and_indices([1, 3], n_heads=4, head_size=2, already_pruned_heads=set())
    assert heads == {1, 3} and index.tolist() == [0, 1, 4, 5]
    # original heads 0..3 with 0 already pruned: 3 heads left (originals 1, 2, 3); original 2 sits at position 1
    heads, index = find_pruneable_heads_and_indices([2, 0], n_heads=3, head_size=2, already_pruned_heads={0})
    assert heads == {2} and index.tolist() == [0, 1, 4, 5]


def test_imagereward_missing_files_named(tmp_path):
    with pytest.raises(MissingWeightsError, match="ImageReward.pt.*kwargs.checkpoint"):
        build_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), med_config="x", tokenizer="y")
    (tmp_path / "ImageReward.pt").write_bytes(b"")
    (tmp_path / "med_config.json").write_text("{}")
    with pytest.raises(MissingWeightsError, match="vocab.txt.*kwargs.tokenizer"):
        build_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"),
                     med_config=str(tmp_path / "med_config.json"), tokenizer=str(tmp_path))


def _require_image_reward():
    import importlib.util

    if importlib.util.find_spec("ImageReward") is None:
        pytest.skip("optional extra missing: pip install --no-deps image-reward==1.5")


def test_imagereward_shim_loads_the_package_modules():
    _require_image_reward()
    from flowalign.reward_models.imagereward import install_shim

    install_shim()
    from ImageReward.models.BLIP.med import BertConfig, BertModel

    config = BertConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40)
    config.encoder_width = 16
    config.add_cross_attention = True
    model = BertModel(config, add_pooling_layer=False).eval()
    encoder = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))

    def hidden(ids, encoder_states=encoder):
        with torch.no_grad():
            return model(torch.tensor([ids]), attention_mask=torch.tensor([[1, 1, 1, 0]]),
                         encoder_hidden_states=encoder_states,
                         encoder_attention_mask=torch.ones(1, 5, dtype=torch.long), return_dict=True).last_hidden_state

    out = hidden([2, 5, 7, 0])
    # the shim's attention mask works: the masked last token does not change the others' states
    assert torch.allclose(out[:, :3], hidden([2, 5, 7, 9])[:, :3], atol=1e-6)
    assert not torch.allclose(out[:, :3], hidden([2, 5, 8, 0])[:, :3], atol=1e-4)  # an unmasked token does
    assert not torch.allclose(out, hidden([2, 5, 7, 0], encoder * 2), atol=1e-4)  # cross-attention reads the image


def test_imagereward_end_to_end_on_a_small_blip(tmp_path, monkeypatch):
    """The package's own model class with a 1-layer BERT and a 1-layer ViT (its ViT-L is too big for CI): saved,
    loaded through ImageRewardModel, and scored against the package's own ``score_gard`` and ``score``."""
    _require_image_reward()
    kwargs, reference = tiny_imagereward_files(tmp_path, monkeypatch)
    scorer = build_reward("imagereward", **kwargs, device="cpu", batch_size=2)
    images = _images(3, 240, 260)
    scores = scorer(images, PROMPTS)
    tokens = reference.blip.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35,
                                      return_tensors="pt")
    with torch.no_grad():
        expected = reference.score_gard(tokens.input_ids, tokens.attention_mask, scorer.preprocess(images))
    assert torch.allclose(scores, expected.squeeze(-1), atol=1e-5) and scores.unique().numel() == 3  # image-dependent
    assert torch.allclose(scores, torch.cat([scorer(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)]),
                          atol=1e-5)
    pil = Image.fromarray((images[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    assert reference.score(PROMPTS[0], pil) == pytest.approx(float(scores[0]), abs=0.05)  # PIL vs torch resize


# ----------------------------------------------------------------------------------------------- registry


def test_registry_resolves_each_zoo_name_to_its_class_without_building_it():
    from flowalign.reward_models.aesthetic import LaionAesthetic
    from flowalign.reward_models.clipscore import CLIPScore
    from flowalign.reward_models.discriminator import DiscriminatorReward
    from flowalign.reward_models.geneval import GenEvalReward
    from flowalign.reward_models.hps import HPSv2
    from flowalign.reward_models.imagereward import ImageRewardModel
    from flowalign.reward_models.jpeg import JpegCompressibility
    from flowalign.reward_models.pickscore import PickScore
    from flowalign.reward_models.shell_lcc import ShellLCCReward
    from flowalign.reward_models.source_similarity import SourceSimilarity

    classes = {"pickscore": PickScore, "hps": HPSv2, "imagereward": ImageRewardModel, "clipscore": CLIPScore,
               "aesthetic": LaionAesthetic, "jpeg_compressibility": JpegCompressibility,
               "jpeg_incompressibility": JpegCompressibility, "geneval": GenEvalReward,
               "discriminator": DiscriminatorReward, "shell_lcc": ShellLCCReward, "source_similarity": SourceSimilarity}
    for name, cls in classes.items():
        assert reward_class(name) is cls
    # exactly the scorers with a differentiable forward (the zoo's five, DRL's discriminator, the Shell-LCC manifold,
    # the editing reward, the soft toy reward, brightness, and the video rewards temporal consistency, video brightness
    # and VideoAlign)
    assert differentiable_rewards() == ["aesthetic", "brightness", "clipscore", "discriminator", "hps", "imagereward",
                                        "pickscore", "shell_lcc", "source_similarity", "temporal_consistency",
                                        "toy_geneval_soft", "video_brightness", "videoalign"]
    # scorers without a gradient: the detector stack, JPEG sizes, the exact toy verifiers (images and videos), optical
    # flow (OpenCV), OCR, pairwise win rates (a judge's verdicts), and the out-of-process ones (a reward server's scores
    # and a VLM judge's answers come back as numbers)
    assert set(REWARDS) - set(differentiable_rewards()) == {"geneval", "jpeg_compressibility",
                                                           "jpeg_incompressibility", "toy_geneval", "toy_video",
                                                           "motion", "ocr", "pairwise_preference", "remote",
                                                           "vlm_judge"}
    from flowalign.remote.client import RemoteReward
    from flowalign.remote.judge import VLMJudge

    assert reward_class("remote") is RemoteReward and reward_class("vlm_judge") is VLMJudge
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        reward_class("nope")


# ------------------------------------------------------------------------------- the differentiable entry point

ZOO = ["pickscore", "hps", "clipscore", "aesthetic", "imagereward"]


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    return tiny_zoo_kwargs(tmp_path, monkeypatch)


def _zoo_scorer(zoo, name, **overrides):
    if name == "imagereward":
        _require_image_reward()
    return build_differentiable_reward(name, "--rgs-reward", **{**zoo[name], **overrides})


@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_scorer_has_a_finite_nonzero_gradient_to_the_images(zoo, name):
    """``differentiable_score`` (what RGS and RG-OPD call) keeps the graph: the gradient to each image is finite,
    non-zero, its own (image 1 does not move image 0's score), and is the score's directional derivative."""
    scorer = _zoo_scorer(zoo, name)
    images = _images(2, 40, 48, seed=5).requires_grad_(True)
    scores = differentiable_score(scorer, images, PROMPTS[:2], [{}, {}])
    assert scores.requires_grad and scores.dtype == torch.float32 and scores.device == images.device
    # the same values as the gradient-free protocol (which returns them without a graph)
    gradient_free = scorer(images.detach(), PROMPTS[:2])
    assert not gradient_free.requires_grad and torch.allclose(scores.detach(), gradient_free, atol=1e-5)
    (grad,) = torch.autograd.grad(scores[0], images)
    assert torch.isfinite(grad).all() and grad[0].abs().sum() > 0 and torch.equal(grad[1], torch.zeros_like(grad[1]))
    # central difference along the normalised gradient: d score / d t = |grad|
    direction = grad[0] / grad[0].norm()
    eps = 1e-3
    with torch.no_grad():
        plus = differentiable_score(scorer, (images + eps * direction)[:1], PROMPTS[:1])
        minus = differentiable_score(scorer, (images - eps * direction)[:1], PROMPTS[:1])
    assert float((plus - minus) / (2 * eps)) == pytest.approx(float(grad[0].norm()), rel=0.05)


def test_zoo_scorer_in_bf16_gives_fp32_scores_and_gradients_close_to_fp32(zoo):
    """A bf16 backbone: preprocessing stays fp32, the images' gradient arrives in their own dtype (fp32)."""
    full = _zoo_scorer(zoo, "hps")
    half = _zoo_scorer(zoo, "hps", dtype="bf16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    images = _images(2, 40, 48, seed=6).requires_grad_(True)
    scores = differentiable_score(half, images, PROMPTS[:2])
    (grad,) = torch.autograd.grad(scores.sum(), images)
    assert scores.dtype == torch.float32 and grad.dtype == torch.float32 and torch.isfinite(grad).all()
    assert torch.allclose(scores.detach(), differentiable_score(full, images, PROMPTS[:2]).detach(), atol=0.03)
    plain = half(images.detach(), PROMPTS[:2])
    assert plain.dtype == torch.float32 and plain.device.type == "cpu"


def test_clipscore_scales_with_w_and_is_zero_with_no_gradient_below_zero_cosine(zoo):
    images = _images(4, 32, 32, seed=7)
    prompts = [*PROMPTS, "a red circle"]

    def cosines(scorer):
        image_features = scorer.model.encode_image(_normalized(images))
        text_features = scorer.model.encode_text(scorer.tokenizer(prompts))
        return torch.nn.functional.cosine_similarity(image_features, text_features, dim=-1)

    w1 = _zoo_scorer(zoo, "clipscore", w=1.0)
    cos = cosines(w1)
    assert (cos > 0).all() and torch.allclose(w1(images, prompts), cos, atol=1e-5)
    assert torch.allclose(_zoo_scorer(zoo, "clipscore", w=2.5)(images, prompts), 2.5 * cos, atol=1e-5)
    # another random model (hps's checkpoint) with negative cosines: max(cos, 0) = 0, and its gradient is 0
    negative = _zoo_scorer(zoo, "clipscore", weights=zoo["hps"]["checkpoint"])
    assert (cosines(negative) < 0).all()
    leaf = images.clone().requires_grad_(True)
    scores = differentiable_score(negative, leaf, prompts)
    (grad,) = torch.autograd.grad(scores.sum(), leaf)
    assert torch.equal(scores.detach(), torch.zeros(4)) and torch.equal(grad, torch.zeros_like(grad))
