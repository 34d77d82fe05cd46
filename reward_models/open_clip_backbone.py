"""Loading open_clip models from local weight files (or open_clip's own pretrained tags), and encoding with them.

Used by HPS v2 (ViT-H-14), CLIPScore, the LAION aesthetic predictor and GenEval's colour classifier (ViT-L-14,
OpenAI weights). ``weights`` is either a local file or an open_clip pretrained tag (``"openai"``, ``"laion2b_s32b_b79k"``,
...) that open_clip downloads itself. Local files may be:

* a state dict (``.bin``/``.pt``/``.pth``, plain or under ``state_dict``, ``module.`` prefixes stripped) or a
  ``.safetensors`` file, loaded strictly into ``open_clip.create_model(model_name, pretrained=None)``;
* OpenAI's TorchScript archive (``ViT-L-14.pt`` from the openai/CLIP release), loaded with
  ``open_clip.load_openai_model``.

OpenAI's CLIP weights were trained with QuickGELU; ``quick_gelu=True`` builds the model with it (open_clip does the
same for its ``openai`` tag). Models are returned in eval mode with gradients off (rewards are frozen).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from torch import Tensor

from .weights import MissingWeightsError, load_state_dict, require_file

__all__ = ["encode_image", "encode_text", "load_open_clip"]


def load_open_clip(model_name: str, weights: str, *, reward: str, key: str, source: str, quick_gelu: bool = False,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for the open_clip architecture ``model_name`` with ``weights`` (see module docstring)."""
    import open_clip

    if _is_weights_path(weights):
        path = require_file(weights, reward=reward, key=key, source=source)
        model = _from_file(model_name, path, quick_gelu)
    else:
        try:
            model = open_clip.create_model(model_name, pretrained=weights, force_quick_gelu=quick_gelu)
        except Exception as error:
            raise MissingWeightsError(
                f"{reward}: open_clip could not load {model_name} with pretrained={weights!r} ({type(error).__name__}: "
                f"{error}). Without hub access, download the weights file ({source}) and pass its local path as the "
                f"reward's `{key}` argument (config key reward.rewards[i].kwargs.{key})."
            ) from error
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, open_clip.get_tokenizer(model_name)


WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


def _is_weights_path(weights: str) -> bool:
    """A file path (existing, with a directory part, or a weights suffix) rather than an open_clip pretrained tag."""
    path = Path(str(weights)).expanduser()
    return path.exists() or len(path.parts) > 1 or str(weights).startswith((".", "~")) or path.suffix in WEIGHT_SUFFIXES


def _from_file(model_name: str, path: Path, quick_gelu: bool):
    import open_clip

    if _is_torchscript(path):
        return open_clip.load_openai_model(str(path), device="cpu", jit=False)
    model = open_clip.create_model(model_name, pretrained=None, force_quick_gelu=quick_gelu)
    state = load_state_dict(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{str(path)!r} does not match open_clip's {model_name}: missing keys {sorted(missing)[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected keys {sorted(unexpected)[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (is it the right checkpoint for this model?)"
        )
    return model


def _is_torchscript(path: Path) -> bool:
    """TorchScript archives hold a ``constants.pkl`` or ``code/`` entry; plain torch.save zips do not."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("constants.pkl") or "/code/" in name for name in archive.namelist())


def encode_image(model, pixels: Tensor) -> Tensor:
    """L2-normalised image embeddings ``[B, D]`` (fp32) of preprocessed ``pixels``."""
    dtype = next(model.parameters()).dtype
    features = model.encode_image(pixels.to(dtype)).float()
    return features / features.norm(dim=-1, keepdim=True)


def encode_text(model, tokenizer, prompts, device) -> Tensor:
    """L2-normalised text embeddings ``[B, D]`` (fp32) of ``prompts``, tokenised with open_clip's tokenizer."""
    tokens = tokenizer(list(prompts)).to(device)
    features = model.encode_text(tokens).float()
    return features / features.norm(dim=-1, keepdim=True)
