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
