"""VideoReward (VideoAlign; Liu et al. 2025, "Improving Video Generation with Human Feedback", arXiv:2501.13918) from
local weights: a Qwen2-VL with a linear reward head read at three special tokens, scoring visual quality (VQ),
motion quality (MQ) and text alignment (TA) of a video against its prompt.

Read from the public code (KwaiVGI/VideoAlign: ``trainer.py::Qwen2VLRewardModelBT``, ``inference.py``,
``prompt_template.py``, ``train_reward.py``), re-implemented here:

* **Model.** ``transformers``' ``Qwen2VLForConditionalGeneration`` (the base, ``Qwen/Qwen2-VL-2B-Instruct`` in the
  release) with the tokens ``<|VQ_reward|>``, ``<|MQ_reward|>``, ``<|TA_reward|>`` added to its tokenizer (its
  embeddings resized to match) and ``rm_head = Linear(hidden, output_dim, bias=False)`` on the language model's last
  hidden states (after its final norm). With ``reward_token: special`` (the release) the head is read at the three
  special tokens, in order: ``output_dim`` 3 takes the diagonal (head k at token k), ``output_dim`` 1 the one value
  at each; ``reward_token: last`` reads the last token's ``output_dim`` (>= 3) values.
* **Input.** The prompt filled into the ``detailed_special`` template (the release's; it names the three special
  tokens), after the video, in Qwen2-VL's chat format with the generation prompt:
  ``<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>`` +
  ``<|video_pad|>`` x (tokens of the video) + ``<|vision_end|>`` + text + ``<|im_end|>\n<|im_start|>assistant\n``.
  The video: ``num_frames`` frames sampled as Qwen2-VL's video processor samples them (``arange(0, F, F / n)``;
  default: the checkpoint's ``num_frames``, else every frame: a tensor has no fps to sample ``fps: 2`` by), each
  frame resized (bicubic, antialiased) to Qwen2-VL's ``smart_resize`` size between ``min_pixels`` (qwen-vl-utils'
  ``128 * 28 * 28``) and ``max_pixels`` (the checkpoint's ``max_frame_pixels``), normalised with the CLIP mean and
  std and patchified by the video processor's own ``patchify`` (an odd frame count repeats the last frame). All in
  torch, so ``forward`` is differentiable in the frames.
* **Scores.** ``VQ, MQ, TA``, each standardised with the checkpoint's ``inference_config`` (``(x - mean) / std``)
  when ``normalize`` and it has one, and ``Overall = VQ + MQ + TA``; ``output`` picks the one the reward returns.
* **Files.** ``path``: the VideoReward directory, holding ``model_config.json`` and ``checkpoint-<step>/`` with either
  ``model.pth`` (a full state dict) or ``adapter_model.safetensors`` (LoRA, merged here: ``W += s B A``,
  ``s = lora_alpha / lora_r``, ``/ sqrt(r)`` with rsLoRA) and ``non_lora_state_dict.pth``; ``.pth`` files are read with
  ``torch.load(weights_only=True)``. ``base``: the local Qwen2-VL directory (config, tokenizer, weights); default the
  checkpoint's ``model_name_or_path`` when that is a local directory. Keys of the released layout (``visual.*``,
  ``model.*`` for the language model; PEFT's ``base_model.model.`` prefix) are renamed to the installed transformers'
  (``model.visual.*``, ``model.language_model.*``).

What differs from the public code: the frames come as a tensor and are sampled by count, not decoded from a file at
``fps`` (qwen-vl-utils), and resized by torch's bicubic resize rather than the processor's (a few 1/255 steps); one
video is scored per forward (the public code pads a batch on the right, which changes no special-token position);
attention is transformers' default (sdpa) instead of flash-attention 2. Unverified here: the released weights and
their exact ``model_config.json`` (no hub access); the tests build a tiny Qwen2-VL of the real classes.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flowalign.devices import resolve_device, resolve_dtype
from flowalign.errors import RewardInputError

from .images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize
from .weights import MissingWeightsError, require_dir, require_file

__all__ = ["DIMENSIONS", "OUTPUTS", "SPECIAL_TOKENS", "VideoAlign", "chat_text", "released_prompt"]

DIMENSIONS = ("VQ", "MQ", "TA")
OUTPUTS = (*DIMENSIONS, "Overall")
SPECIAL_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
SOURCE = "the hub repository KwaiVGI/VideoReward (git clone https://huggingface.co/KwaiVGI/VideoReward)"
BASE_SOURCE = "the hub repository Qwen/Qwen2-VL-2B-Instruct"
VIDEO_MIN_PIXELS = 128 * 28 * 28  # qwen-vl-utils' least pixels of a video frame (smaller frames are scaled up)

# The released model's prompt (``detailed_special`` in VideoAlign's prompt_template.py): the model was trained on
# exactly this text, so it is reproduced as it is; {text_prompt} is the video's prompt.
DETAILED_SPECIAL = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""


def released_prompt(prompt: str) -> str:
    """The text the released model reads for ``prompt`` (its ``detailed_special`` template)."""
    return DETAILED_SPECIAL.replace("{text_prompt}", prompt)


def chat_text(text: str, video_tokens: int) -> str:
    """Qwen2-VL's chat format of one user turn holding a video of ``video_tokens`` tokens and ``text``, with the
    generation prompt (module docstring)."""
    return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            + "<|video_pad|>" * video_tokens + "<|vision_end|>" + text + "<|im_end|>\n<|im_start|>assistant\n")


def _checkpoint_dir(path: Path, step: int | None) -> Path:
    steps = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)))
    if not steps:
        raise MissingWeightsError(f"videoalign: {str(path)!r} holds no checkpoint-<step> directory. It usually comes "
                                  f"from {SOURCE}; set it with the reward's `path` argument (config key "
                                  "reward.rewards[i].kwargs.path).")
    if step is None:
        return steps[-1][1]
    for number, folder in steps:
        if number == step:
            return folder
    raise MissingWeightsError(f"videoalign: {str(path)!r} has no checkpoint-{step} (it has "
                              f"{', '.join(p.name for _, p in steps)}); set reward.rewards[i].kwargs.checkpoint_step")


def _released_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """PEFT's wrappers taken off the keys (``base_model.model.``, ``modules_to_save.default.``, the frozen
    ``original_module`` copies dropped)."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("base_model.model.")
        if ".original_module." in key:
            continue
        out[key.replace(".modules_to_save.default.", ".")] = value
    return out


def _installed_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The released layout (``visual.*``, ``model.*`` for the language model) in the installed transformers'
    (``model.visual.*``, ``model.language_model.*``); keys already in that layout stay."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^visual\.", "model.visual.", key)
        key = re.sub(r"^model\.(?!language_model\.|visual\.)", "model.language_model.", key)
        out[key] = value
    return out


def merge_lora(state: dict[str, Tensor], lora: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """``state`` with each LoRA pair of ``lora`` (``X.lora_A[.default].weight``, ``X.lora_B[...]``) merged into
    ``X.weight``: ``W + scale B A``. A pair whose base weight is missing is a ValueError naming it."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in _released_names(lora).items():
        match = re.fullmatch(r"(.*)\.lora_([AB])(?:\.default)?\.weight", key)
        if match is None:
            continue  # not a LoRA factor (PEFT saves only these and modules_to_save)
        pairs.setdefault(match.group(1), {})[match.group(2)] = value
    merged = dict(state)
    for module, factors in pairs.items():
        target = f"{module}.weight"
        if target not in merged or set(factors) != {"A", "B"}:
            raise ValueError(f"videoalign: the LoRA of {module!r} has no base weight or lacks one of its factors")
        weight = merged[target]
        merged[target] = (weight.float() + scale * factors["B"].float() @ factors["A"].float()).to(weight.dtype)
    return merged


class VideoAlign:
    """The ``videoalign`` video reward (module docstring). Settings: ``path`` (the VideoReward directory), ``base``
    (the local Qwen2-VL directory), ``output`` (``Overall``, ``VQ``, ``MQ`` or ``TA``), ``normalize``,
    ``num_frames``, ``max_pixels``, ``min_pixels``, ``checkpoint_step`` (None: the latest), ``device``, ``dtype``."""

    name = "videoalign"
    modality = "video"

    def __init__(self, path: str, base: str | None = None, *, output: str = "Overall", normalize: bool = True,
                 num_frames: int | None = None, max_pixels: int | None = None, min_pixels: int = VIDEO_MIN_PIXELS,
                 checkpoint_step: int | None = None, device: str | None = None, dtype: str = "fp32"):
        from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        from flowalign.serialization import read_safetensors, safe_load

        if output not in OUTPUTS:
            raise ValueError(f"videoalign output must be one of {', '.join(OUTPUTS)}, got {output!r}")
        for setting, value in (("num_frames", num_frames), ("max_pixels", max_pixels), ("min_pixels", min_pixels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"videoalign {setting} must be an integer >= 1 (or null), got {value!r}")
        folder = require_dir(path, reward=self.name, key="path", source=SOURCE, files=("model_config.json",))
        config = json.loads((folder / "model_config.json").read_text())
        data, model_config = config.get("data_config", {}), config.get("model_config", {})
        lora_config, self.norms = config.get("peft_lora_config", {}), config.get("inference_config")
        base = base or model_config.get("model_name_or_path")
        if base is None or not Path(base).expanduser().is_dir():
            raise MissingWeightsError(
                f"videoalign: the base model {base!r} is not a local directory. It usually comes from {BASE_SOURCE}; "
                "set it with the reward's `base` argument (config key reward.rewards[i].kwargs.base).")
        self.reward_token = model_config.get("reward_token", "special")
        self.output_dim = int(model_config.get("output_dim", 3))
        if self.reward_token not in ("special", "last") or (self.reward_token == "last" and self.output_dim < 3):
            raise ValueError(f"videoalign: {folder / 'model_config.json'} has reward_token {self.reward_token!r} and "
                             f"output_dim {self.output_dim}; this reward reads special (output_dim 1 or 3) or last "
                             "(output_dim >= 3)")
        if data.get("prompt_template_type", "detailed_special") != "detailed_special" and self.reward_token == "special":
            raise ValueError(f"videoalign: {folder / 'model_config.json'} uses prompt template "
                             f"{data.get('prompt_template_type')!r}; the special tokens need detailed_special")
        self.output, self.normalize = output, normalize
        self.num_frames = num_frames if num_frames is not None else data.get("num_frames")
        self.max_pixels = max_pixels or int(data.get("max_frame_pixels") or 448 * 448)
        self.min_pixels = min_pixels
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)

        self.tokenizer = AutoTokenizer.from_pretrained(str(Path(base).expanduser()))
        if self.reward_token == "special" or model_config.get("use_special_tokens", True):
            missing = [t for t in SPECIAL_TOKENS if t not in self.tokenizer.get_vocab()]
            if missing:
                self.tokenizer.add_tokens(missing, special_tokens=True)
        self.special_ids = self.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
        self.video_pad_id = self.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        vlm_config = Qwen2VLConfig.from_pretrained(str(Path(base).expanduser()))
        model = Qwen2VLForConditionalGeneration.from_pretrained(str(Path(base).expanduser()), dtype=torch.float32)
        if model.get_input_embeddings().weight.shape[0] < len(self.tokenizer):
            model.resize_token_embeddings(len(self.tokenizer))
        model.rm_head = torch.nn.Linear(vlm_config.text_config.hidden_size, self.output_dim, bias=False)

        checkpoint = _checkpoint_dir(folder, checkpoint_step)
        if (checkpoint / "model.pth").is_file():
            state = _released_names(safe_load(checkpoint / "model.pth", "VideoReward's full state dict"))
        else:
            lora = read_safetensors(require_file(checkpoint / "adapter_model.safetensors", reward=self.name, key="path",
                                                 source=SOURCE), "VideoReward's LoRA")
            rest = _released_names(safe_load(require_file(checkpoint / "non_lora_state_dict.pth", reward=self.name,
                                                          key="path", source=SOURCE), "VideoReward's other weights"))
            r, alpha = int(lora_config.get("lora_r", 64)), float(lora_config.get("lora_alpha", 128))
            scale = alpha / (math.sqrt(r) if lora_config.get("use_rslora") else r)
            base_state = {key: value for key, value in model.state_dict().items()}
            state = merge_lora({**base_state, **_installed_names(rest)}, _installed_names(_released_names(lora)),
                               scale)
        state = _installed_names(state)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if vlm_config.get_text_config().tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"videoalign: {checkpoint} does not fit the base model {base}: missing "
                             f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        vision = vlm_config.vision_config  # the patch geometry (14, 2, 2 in Qwen2-VL-2B)
        self.patch_size, self.merge_size = vision.patch_size, vision.spatial_merge_size
        self.temporal_patch_size = vision.temporal_patch_size
        self.patchify = functools.partial(Qwen2VLVideoProcessor.patchify, None)  # the processor's own; self unused

    def __repr__(self) -> str:
        return f"VideoAlign(output={self.output!r}, device={str(self.device)!r}, dtype={self.dtype})"

    @classmethod
    def check_run(cls, kwargs: dict, *, key: str, model: str | None, image_size: Any = None) -> None:
        """Before it is built and before any model loads (``flowalign.rewards.check_reward_run``): ``path`` holds
        ``model_config.json`` and a checkpoint, and the base model is a local directory; each error names the file,
        where it comes from and ``key.<setting>``."""
        if "path" not in kwargs:
            raise ValueError(f"{key}.path is required: the VideoReward directory ({SOURCE})")
        folder = require_dir(kwargs["path"], reward=cls.name, key="path", source=SOURCE, files=("model_config.json",))
        _checkpoint_dir(folder, kwargs.get("checkpoint_step"))
        base = kwargs.get("base") or json.loads((folder / "model_config.json").read_text()).get(
            "model_config", {}).get("model_name_or_path")
        if base is None or not Path(base).expanduser().is_dir():
            raise MissingWeightsError(f"videoalign: the base model {base!r} is not a local directory. It usually comes "
                                      f"from {BASE_SOURCE}; set it with {key}.base.")

    # ------------------------------------------------------------------------------------------ input
    def frame_indices(self, frames: int) -> list[int]:
        """The frames read of a clip of ``frames`` frames (Qwen2-VL's video processor's sampling by count)."""
        if self.num_frames is None or self.num_frames >= frames:
            return list(range(frames))
        count = max(self.temporal_patch_size,
                    round(self.num_frames / self.temporal_patch_size) * self.temporal_patch_size)
        return torch.arange(0, frames, frames / count).int().tolist()

    def pixel_values(self, video: Tensor) -> tuple[Tensor, Tensor]:
        """``(pixel_values_videos [N, C T p p], video_grid_thw [1, 3])`` of one video ``[F, 3, H, W]`` in [0, 1]
        (module docstring), differentiable in it."""
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

        frames = video[self.frame_indices(video.shape[0])].float()
        height, width = smart_resize(frames.shape[-2], frames.shape[-1], factor=self.patch_size * self.merge_size,
                                     min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        if (height, width) != tuple(frames.shape[-2:]):
            frames = F.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        frames = normalize(frames.clamp(0, 1), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
        patches, grid_t, grid_h, grid_w = self.patchify(frames[None], self.patch_size, self.merge_size,
                                                        self.temporal_patch_size)
        return patches[0], torch.tensor([[grid_t, grid_h, grid_w]])

    def input_ids(self, prompt: str, video_tokens: int) -> Tensor:
        """The token ids ``[1, L]`` of ``prompt`` around a video of ``video_tokens`` tokens."""
        text = chat_text(released_prompt(prompt), video_tokens)
        return torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])

    # ------------------------------------------------------------------------------------------ scoring
    def heads(self, video: Tensor, prompt: str) -> Tensor:
        """The raw ``[VQ, MQ, TA]`` of one video ``[F, 3, H, W]`` (module docstring), differentiable in it."""
        pixels, grid = self.pixel_values(video)
        ids = self.input_ids(prompt, int(grid.prod()) // self.merge_size**2).to(self.device)
        kinds = (ids == self.video_pad_id).long() * 2  # transformers' modality ids: 0 text, 2 video (M-RoPE)
        hidden = self.model.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
                                  pixel_values_videos=pixels.to(self.device, self.dtype),
                                  video_grid_thw=grid.to(self.device)).last_hidden_state[0]
        logits = self.model.rm_head(hidden).float()  # [L, output_dim]
        if self.reward_token == "last":
            return logits[-1, :3]
        at = torch.cat([(ids[0] == token).nonzero().flatten() for token in self.special_ids])
        if at.numel() != 3:
            raise RewardInputError(f"videoalign: the prompt {prompt[:60]!r} holds a reward token of its own; remove "
                                   f"{', '.join(SPECIAL_TOKENS)} from it")
        picked = logits[at]  # [3, output_dim]
        return picked.diagonal() if self.output_dim == 3 else picked[:, 0]

    def scores(self, videos: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        """``{VQ, MQ, TA, Overall}``, each ``[B]``, of ``videos [B, F, 3, H, W]`` in [0, 1] (standardised with the
        checkpoint's statistics when ``normalize``), differentiable in them."""
        if not isinstance(videos, Tensor) or videos.dim() != 5 or videos.shape[2] != 3:
            shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
            raise RewardInputError(f"reward 'videoalign' scores videos [B, F, 3, H, W], got {shape}")
        prompts = list(prompts)
        if len(prompts) != videos.shape[0]:
            raise ValueError(f"videoalign: got {videos.shape[0]} videos but {len(prompts)} prompts")
        raw = torch.stack([self.heads(video, prompt) for video, prompt in zip(videos, prompts)])  # [B, 3]
        out = {name: raw[:, k] for k, name in enumerate(DIMENSIONS)}
        if self.normalize and self.norms is not None:
            out = {name: (value - self.norms[f"{name}_mean"]) / self.norms[f"{name}_std"] for name, value in out.items()}
        out["Overall"] = out["VQ"] + out["MQ"] + out["TA"]
        return out

    def forward(self, videos: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """The ``output`` score ``[B]`` of ``videos``, differentiable in them."""
        return self.scores(videos.to(self.device), prompts)[self.output]

    def __call__(self, videos: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` float32 on the CPU, without gradients."""
        with torch.no_grad():
            return self.forward(videos, prompts, metadata).float().cpu()
