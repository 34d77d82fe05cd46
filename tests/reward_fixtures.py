"""Tiny, randomly initialised backbones of the reward models' architecture families (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_OPEN_CLIP = "flowalign-tiny-clip"
TINY_OPEN_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def register_tiny_open_clip(directory: Path) -> str:
    """Register the tiny open_clip architecture (same family as ViT-H-14 / ViT-L-14) in this process."""
    import open_clip

    path = Path(directory) / f"{TINY_OPEN_CLIP}.json"
    path.write_text(json.dumps(TINY_OPEN_CLIP_CONFIG))
    open_clip.add_model_config(path)
    return TINY_OPEN_CLIP


def tiny_open_clip_checkpoint(directory: Path, seed: int = 0, wrap: bool = True) -> Path:
    """A random tiny open_clip model saved like HPS's checkpoints (``{"state_dict": ...}``)."""
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.create_model(TINY_OPEN_CLIP, pretrained=None)
    path = Path(directory) / f"tiny-clip-{seed}.pt"
    state = model.state_dict()
    torch.save({"state_dict": state} if wrap else state, path)
    return path


def tiny_pickscore_dirs(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny transformers CLIPModel and a processor directory (word-level tokenizer + CLIPImageProcessor)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from flowalign.models.tiny import word_level_tokenizer

    words = "a photo of red green blue circle square cat dog".split()
    tokenizer = word_level_tokenizer(words, max_length=16)
    text = dict(vocab_size=len(words) + 3, hidden_size=32, intermediate_size=64, projection_dim=16,
                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16, bos_token_id=0,
                eos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, projection_dim=16, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=8)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    model_dir, processor_dir = Path(directory) / "pickscore", Path(directory) / "processor"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(processor_dir)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(processor_dir)
    return model_dir, processor_dir


def tiny_mask2former_dir(directory: Path, seed: int = 0) -> Path:
    """A random tiny Mask2Former (Swin backbone, 80 COCO labels) with its image processor, saved to a directory."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor, SwinConfig

    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, num_labels=80, hidden_dim=32, feature_size=32,
                               mask_feature_size=32, num_queries=12, encoder_layers=1, decoder_layers=2,
                               num_attention_heads=2, encoder_feedforward_dim=64, dim_feedforward=64,
                               use_pretrained_backbone=False)
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(config).eval()
    with torch.no_grad():  # a confident detector: label 0 ("person") wins every query, so scores pass 0.3
        model.class_predictor.bias[0] = 20.0
    path = Path(directory) / "mask2former"
    model.save_pretrained(path)
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(path)
    return path


def image_reward_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ImageReward") is not None


def tiny_imagereward_files(directory: Path, monkeypatch, seed: int = 0):
    """ImageReward's own model class with a 1-layer BERT and a 1-layer ViT (its ViT-L is too big for CI), saved as
    ``ImageReward.pt`` + ``med_config.json`` + a BERT vocabulary: ``(kwargs of build_reward("imagereward"),
    reference model)``. ``monkeypatch`` keeps BLIP's ``create_vit`` small for as long as the test runs (the reward
    builds its ViT through it). Needs the optional image-reward package."""
    from flowalign.reward_models.imagereward import _local_tokenizer_factory, install_shim

    install_shim()
    from ImageReward.ImageReward import ImageReward
    from ImageReward.models.BLIP import blip_pretrain
    from ImageReward.models.BLIP.vit import VisionTransformer

    directory = Path(directory)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"a photo of red blue green circle square cat".split()]
    tokenizer_dir = directory / "bert"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    (tokenizer_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    med_config = directory / "med_config.json"
    med_config.write_text(json.dumps({
        "architectures": ["BertModel"], "hidden_size": 768, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": len(vocab) + 2, "max_position_embeddings": 64,
        "add_cross_attention": True, "hidden_act": "gelu", "type_vocab_size": 2, "pad_token_id": 0,
    }))
    small_vit = lambda vit, image_size, *args, **kwargs: (  # noqa: E731
        VisionTransformer(img_size=image_size, patch_size=32, embed_dim=32, depth=1, num_heads=2), 32)
    monkeypatch.setattr(blip_pretrain, "create_vit", small_vit)
    monkeypatch.setattr(blip_pretrain, "init_tokenizer", _local_tokenizer_factory(str(tokenizer_dir)))
    torch.manual_seed(seed)
    reference = ImageReward(med_config=str(med_config), device="cpu").eval()
    with torch.no_grad():
        # ImageReward initialises its head with std 1/769: five such layers make the score a constant (~1e-9 of the
        # image); a variance-preserving init makes it depend on the image, as the trained head does
        for layer in reference.mlp.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.normal_(0.0, layer.in_features ** -0.5, generator=torch.Generator().manual_seed(seed))
        reference.mlp.layers[-1].bias.fill_(0.3)  # so the standardisation is visible
    checkpoint = directory / "ImageReward.pt"
    torch.save(reference.state_dict(), checkpoint)
    kwargs = {"checkpoint": str(checkpoint), "med_config": str(med_config), "tokenizer": str(tokenizer_dir)}
    return kwargs, reference


def tiny_zoo_kwargs(directory: Path, monkeypatch=None, seed: int = 0) -> dict[str, dict]:
    """Constructor kwargs (``build_reward(name, **kwargs)``) of every differentiable zoo scorer on a tiny random
    backbone written under ``directory``: pickscore, hps, clipscore, aesthetic, and imagereward when its optional
    package is installed (then ``monkeypatch`` is needed, see ``tiny_imagereward_files``). JSON-serialisable, so they
    also go to ``flowalign sample --rgs-reward-kwargs``; the tiny open_clip architecture is registered in this
    process."""
    from flowalign.reward_models.aesthetic import AestheticMLP

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_name = register_tiny_open_clip(directory)
    clip = str(tiny_open_clip_checkpoint(directory, seed=seed))
    # CLIPScore is w max(cos, 0): a random model whose image-text cosines are positive (seed 3 of this architecture)
    # so that the score has a gradient; at seed 0 they are negative for the test images and prompts
    positive_clip = str(tiny_open_clip_checkpoint(directory, seed=3))
    model_dir, processor_dir = tiny_pickscore_dirs(directory, seed=seed)
    torch.manual_seed(seed)
    mlp_path = directory / "aesthetic-mlp.pth"
    torch.save(AestheticMLP(input_size=TINY_OPEN_CLIP_CONFIG["embed_dim"]).state_dict(), mlp_path)
    zoo = {
        "pickscore": {"model": str(model_dir), "processor": str(processor_dir)},
        "hps": {"checkpoint": clip, "model_name": model_name},
        "clipscore": {"weights": positive_clip, "model_name": model_name, "quick_gelu": False},
        "aesthetic": {"mlp_weights": str(mlp_path), "clip_weights": clip, "model_name": model_name,
                      "quick_gelu": False},
    }
    if image_reward_installed() and monkeypatch is not None:
        zoo["imagereward"] = tiny_imagereward_files(directory / "imagereward", monkeypatch, seed=seed)[0]
    return {name: {**kwargs, "device": "cpu"} for name, kwargs in zoo.items()}
