"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation"), through the optional ``image-reward`` package and a small compatibility shim.

Files (hub repository ``THUDM/ImageReward``): ``ImageReward.pt`` (the BLIP ViT-L + BERT cross-encoder and the MLP
head) and ``med_config.json`` (the BERT config); plus a local BERT tokenizer directory (``bert-base-uncased``'s
``vocab.txt`` and ``tokenizer_config.json``), which the package would otherwise download at construction.

Installing: ``image-reward`` 1.5 pins ``timm==0.6.13``, but open_clip (a core dependency) needs ``timm>=1.0.17``, so
pip cannot install both. Install the package without its dependencies (``pip install --no-deps image-reward==1.5``);
the imports it needs from timm still exist (deprecated) in timm 1.x, and ``install_shim`` covers the rest:

* transformers 5 removed ``apply_chunking_to_forward``, ``prune_linear_layer`` and
  ``find_pruneable_heads_and_indices`` from ``transformers.modeling_utils``; the shim puts them back (the first two
  from ``transformers.pytorch_utils`` when present, else small local versions);
* ``fairscale`` (only used for gradient checkpointing of the ViT) is replaced by an identity ``checkpoint_wrapper``
  when it is not installed;
* the package's ``__init__`` imports its ReFL trainer (``datasets``, old diffusers APIs) and ``ImageReward.models``'
  imports OpenAI's ``clip`` package; the shim registers both packages without running their ``__init__``, so only
  the BLIP model modules load;
* BLIP's BERT calls ``init_weights()`` in its constructors, where transformers 5 needs ``post_init()``, and uses
  ``invert_attention_mask`` and ``get_head_mask``, which transformers 5 dropped from ``PreTrainedModel``; the shim
  routes the call through ``post_init`` and adds the two helpers back (small local versions);
* the BERT tokenizer is read from ``tokenizer`` (a local directory) instead of the hub.

Preprocessing: resize the shorter side to 224 (bicubic), centre crop 224, OpenAI CLIP mean/std; prompts are
tokenised to 35 tokens (padding to max length). Score: the MLP on the cross-encoder's [CLS] feature, standardised
with the package's constants, ``(r - 0.16717) / 1.03334`` (about -2 to 2).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Sequence

import torch
from torch import Tensor

from .base import RewardModel
from .images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize, resize_shortest_center_crop
from .weights import load_state_dict, looks_local, require_dir, require_file

__all__ = ["ImageRewardModel", "find_pruneable_heads_and_indices", "install_shim"]

IMAGEREWARD_SOURCE = "the hub repository THUDM/ImageReward"
BERT_SOURCE = "the hub repository google-bert/bert-base-uncased (vocab.txt, tokenizer_config.json)"
INSTALL_HINT = "pip install --no-deps image-reward==1.5 (see reward_models/imagereward.py for why --no-deps)"


def find_pruneable_heads_and_indices(heads, n_heads: int, head_size: int, already_pruned_heads):
    """The heads of ``heads`` not yet pruned, and the flat indices of the kept head dimensions (a LongTensor)."""
    heads = set(heads) - set(already_pruned_heads)
    mask = torch.ones(n_heads, head_size)
    for head in heads:
        shift = sum(1 for pruned in already_pruned_heads if pruned < head)  # earlier pruning shifted the index
        mask[head - shift] = 0
    index = torch.arange(len(mask.view(-1)))[mask.view(-1).eq(1)].long()
    return heads, index


def install_shim() -> None:
    """Make ``ImageReward.ImageReward`` importable with transformers 5 and timm 1.x (see module docstring)."""
    import transformers.modeling_utils as modeling_utils

    try:
        from transformers import pytorch_utils
    except ImportError:  # pragma: no cover - present in every transformers this project supports
        pytorch_utils = None
    for name in ("apply_chunking_to_forward", "prune_linear_layer"):
        if not hasattr(modeling_utils, name) and pytorch_utils is not None and hasattr(pytorch_utils, name):
            setattr(modeling_utils, name, getattr(pytorch_utils, name))
    if not hasattr(modeling_utils, "find_pruneable_heads_and_indices"):
        modeling_utils.find_pruneable_heads_and_indices = find_pruneable_heads_and_indices

    if "fairscale" not in sys.modules and importlib.util.find_spec("fairscale") is None:
        for name in ("fairscale", "fairscale.nn", "fairscale.nn.checkpoint"):
            sys.modules[name] = _stub_module(name, path=None)
        leaf = _stub_module("fairscale.nn.checkpoint.checkpoint_activations", path=None)
        leaf.checkpoint_wrapper = lambda module, *args, **kwargs: module  # only used with grad checkpointing
        sys.modules[leaf.__name__] = leaf

    if "ImageReward" not in sys.modules:
        spec = importlib.util.find_spec("ImageReward")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"imagereward: the image-reward package is not installed; {INSTALL_HINT}")
        root = spec.submodule_search_locations[0]
        # packages whose __init__ is not run: ImageReward's imports ReFL, ImageReward.models' imports OpenAI `clip`
        for name, path in (("ImageReward", root), ("ImageReward.models", f"{root}/models")):
            sys.modules[name] = _stub_module(name, path)
    _patch_bert_init()


def _stub_module(name: str, path: str | None) -> types.ModuleType:
    """An empty module (a package searching ``path`` for submodules when given) with a spec, as importlib expects."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
    if path is not None:
        module.__path__ = [path]
        module.__spec__.submodule_search_locations = [path]
    return module


def _patch_bert_init() -> None:
    """BLIP's BERT calls ``init_weights()`` where transformers 5 expects ``post_init()`` (which registers the tied
    weight keys ``init_weights`` then reads); route the first call through ``post_init``."""
    from ImageReward.models.BLIP import med

    original = med.BertPreTrainedModel.init_weights
    if getattr(original, "_flowalign_shim", False):
        return

    def init_weights(self):
        if hasattr(type(self), "post_init") and "all_tied_weights_keys" not in self.__dict__:
            self.post_init()  # transformers 5: registers the keys, then calls init_weights again (the branch below)
        else:
            original(self)

    init_weights._flowalign_shim = True
    med.BertPreTrainedModel.init_weights = init_weights
    for name, method in (("invert_attention_mask", _invert_attention_mask), ("get_head_mask", _get_head_mask)):
        if not hasattr(med.BertPreTrainedModel, name):
            setattr(med.BertPreTrainedModel, name, method)


def _invert_attention_mask(self, mask: Tensor) -> Tensor:
    """A 0/1 key mask ``[B, S]`` (or ``[B, S, S]``) as an additive mask: 0 where attended, dtype-min elsewhere."""
    extended = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None, :, :]
    extended = extended.to(dtype=self.dtype)
    return (1.0 - extended) * torch.finfo(self.dtype).min


def _get_head_mask(self, head_mask, num_hidden_layers: int):
    """``[None] * layers`` without a head mask; else a per-layer ``[layers, B?, heads, 1, 1]`` multiplicative mask."""
    if head_mask is None:
        return [None] * num_hidden_layers
    if head_mask.dim() == 1:
        head_mask = head_mask[None, None, :, None, None].expand(num_hidden_layers, -1, -1, -1, -1)
    elif head_mask.dim() == 2:
        head_mask = head_mask[:, None, :, None, None]
    return head_mask.to(dtype=self.dtype)


def _local_tokenizer_factory(tokenizer_dir: str):
    def init_tokenizer():
        from transformers import BertTokenizer

        tokenizer = BertTokenizer.from_pretrained(tokenizer_dir)
        # ImageReward's BLIP adds these two tokens; its embeddings (vocab 30524 in med_config.json) include them.
        tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        tokenizer.add_tokens(["[ENC]"], special_tokens=True)  # ids: [DEC] = len(vocab), [ENC] = len(vocab) + 1
        tokenizer.enc_token_id = tokenizer.convert_tokens_to_ids("[ENC]")
        return tokenizer

    return init_tokenizer


class ImageRewardModel(RewardModel):
    """ImageReward v1.0 (see module docstring). All three paths are required and local."""

    name = "imagereward"

    def __init__(self, checkpoint: str, med_config: str, tokenizer: str, *, device=None, dtype="fp32",
                 batch_size: int = 16, max_length: int = 35):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        checkpoint_path = require_file(checkpoint, reward=self.name, key="checkpoint",
                                       source=f"{IMAGEREWARD_SOURCE} (ImageReward.pt)")
        config_path = require_file(med_config, reward=self.name, key="med_config",
                                   source=f"{IMAGEREWARD_SOURCE} (med_config.json)")
        if not looks_local(tokenizer):
            raise ValueError(f"imagereward: tokenizer must be a local directory, got {tokenizer!r}")
        require_dir(tokenizer, reward=self.name, key="tokenizer", source=BERT_SOURCE, files=("vocab.txt",))
        install_shim()
        from ImageReward.models.BLIP import blip_pretrain

        blip_pretrain.init_tokenizer = _local_tokenizer_factory(str(tokenizer))
        from ImageReward.ImageReward import ImageReward

        model = ImageReward(med_config=str(config_path), device=str(self.device))
        state = load_state_dict(checkpoint_path)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [key for key in missing if not key.endswith("position_ids")]
        if missing:
            raise ValueError(f"imagereward: {str(checkpoint_path)!r} lacks {len(missing)} weights of the model, e.g. "
                             f"{missing[:5]} (is it ImageReward.pt, and med_config.json the matching config?)")
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.max_length = max_length

    def preprocess(self, images: Tensor) -> Tensor:
        return normalize(resize_shortest_center_crop(images.float(), 224), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    def forward(self, images: Tensor, prompts: Sequence[str], metadata=None) -> Tensor:
        blip = self.model.blip
        tokens = blip.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        image_embeds = blip.visual_encoder(self.preprocess(images).to(self.dtype))
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        text = blip.text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask,
                                 encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                 return_dict=True)
        rewards = self.model.mlp(text.last_hidden_state[:, 0, :]).squeeze(-1).float()
        return (rewards - self.model.mean) / self.model.std
