"""VideoReward (VideoAlign) on a tiny Qwen2-VL of the real transformers classes, built in-process: its scores equal
the public code's path through transformers' own Qwen2VLProcessor (the processor tokenises and patchifies, the model
runs, the head is read at the three special tokens), the released key layout and a LoRA checkpoint load, and the
standardised heads sum to Overall by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.reward_models.videoalign import SPECIAL_TOKENS, VideoAlign, chat_text, released_prompt
from flowalign.reward_models.weights import MissingWeightsError

WORDS = "a red circle moving to the left two blue squares up video quality motion text alignment rating".split()
NORMS = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -1.0, "MQ_std": 0.5, "TA_mean": 0.0, "TA_std": 4.0}
PATCH = 8  # the tiny vision tower's patch; merge 2, temporal patch 2 (frames of 16 x 16 are one merged token)


def released_layout(state: dict) -> dict:
    """Installed transformers' keys in the layout of the released checkpoint (transformers 4.4x)."""
    out = {}
    for key, value in state.items():
        key = key.replace("model.visual.", "visual.", 1) if key.startswith("model.visual.") else key
        key = key.replace("model.language_model.", "model.", 1) if key.startswith("model.language_model.") else key
        out[key] = value.clone()
    return out


@pytest.fixture(scope="module")
def tiny_videoreward(tmp_path_factory):
    """``(base, reward_dir, reference)``: a tiny Qwen2-VL base directory (config, tokenizer, weights), a VideoReward
    directory (model_config.json, checkpoint-7/model.pth in the released layout) and the model it holds."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from flowalign.models.tiny.qwen_image_edit import VISION_TOKENS, vision_chat_tokenizer

    root = tmp_path_factory.mktemp("videoreward")
    tokenizer = vision_chat_tokenizer(WORDS, 4096)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token)
           for name, token in zip(("vision_start", "image", "vision_end", "video"), VISION_TOKENS)}
    hidden, heads = 32, 2
    head_dim = hidden // heads
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [head_dim // 8, head_dim // 8,
                                                                                    head_dim // 4],
                                          "rope_theta": 1000000.0},
                         pad_token_id=0, eos_token_id=1, tie_word_embeddings=True),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=2, temporal_patch_size=2),
        **ids)
    torch.manual_seed(0)
    base_model = Qwen2VLForConditionalGeneration(config).eval()
    base = root / "qwen2-vl"
    base_model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    # the reward model: the reward tokens added, the embeddings resized, a head of output_dim 3, all fine-tuned
    tokenizer.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    model = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    model.resize_token_embeddings(len(tokenizer))
    model.rm_head = torch.nn.Linear(hidden, 3, bias=False)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    reward_dir = root / "VideoReward"
    (reward_dir / "checkpoint-7").mkdir(parents=True)
    (reward_dir / "checkpoint-3").mkdir()
    torch.save(released_layout(model.state_dict()), reward_dir / "checkpoint-7/model.pth")
    (reward_dir / "model_config.json").write_text(json.dumps({
        "data_config": {"max_frame_pixels": 16 * 32, "num_frames": None, "fps": 2.0, "eval_dim": ["VQ", "MQ", "TA"],
                        "prompt_template_type": "detailed_special", "sample_type": "uniform"},
        "model_config": {"model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "output_dim": 3,
                         "use_special_tokens": True, "reward_token": "special"},
        "peft_lora_config": {"lora_enable": False, "lora_r": 4, "lora_alpha": 8},
        "inference_config": NORMS}))
    return base, reward_dir, model, tokenizer


def reference_heads(model, tokenizer, video: torch.Tensor, prompt: str) -> torch.Tensor:
    """The public code's path: transformers' Qwen2VLProcessor builds the batch (it expands the one video
    placeholder and patchifies the frames), the model runs, the head is read at the special tokens, diagonal."""
    from flowalign.models.tiny.qwen_image_edit import tiny_vl_processor

    processor = tiny_vl_processor(tokenizer, max_pixels=16 * 32)
    batch = processor(text=[chat_text(released_prompt(prompt), 1)], videos=[video], return_tensors="pt",
                      videos_kwargs={"do_rescale": False, "do_resize": False})
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             mm_token_type_ids=batch["mm_token_type_ids"],
                             pixel_values_videos=batch["pixel_values_videos"],
                             video_grid_thw=batch["video_grid_thw"]).last_hidden_state
        logits = model.rm_head(hidden)
    ids = torch.tensor(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    mask = torch.isin(batch["input_ids"], ids)
    return logits[mask].view(1, 3, -1).diagonal(dim1=1, dim2=2)[0]


def test_videoalign_scores_equal_the_public_codes_path_and_sum_to_overall(tiny_videoreward):
    base, reward_dir, model, tokenizer = tiny_videoreward
    reward = VideoAlign(str(reward_dir), str(base), min_pixels=16 * 16, normalize=False)
    torch.manual_seed(1)
    videos = torch.rand(2, 4, 3, 16, 32)  # 4 frames of 16 x 32: two temporal patches, 2 merged tokens per frame pair
    prompts = ["a red circle moving to the left", "two blue squares moving up"]
    raw = reward.scores(videos, prompts)
    for b in range(2):
        expected = reference_heads(model, tokenizer, videos[b], prompts[b])
        got = torch.stack([raw[name][b] for name in ("VQ", "MQ", "TA")])
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got, expected)
    # standardised with the checkpoint's statistics, and Overall their sum, by hand
    normalised = VideoAlign(str(reward_dir), str(base), min_pixels=16 * 16, output="Overall")
    scores = normalised.scores(videos, prompts)
    for name in ("VQ", "MQ", "TA"):
        assert torch.allclose(scores[name], (raw[name] - NORMS[f"{name}_mean"]) / NORMS[f"{name}_std"], atol=1e-5)
    by_hand = sum((raw[n] - NORMS[f"{n}_mean"]) / NORMS[f"{n}_std"] for n in ("VQ", "MQ", "TA"))
    assert torch.allclose(normalised(videos, prompts), by_hand, atol=1e-5)
    # differentiable in the frames
    x = videos[:1].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(normalised.forward(x, prompts[:1]).sum(), x)
    assert grad.abs().sum() > 0 and torch.isfinite(grad).all()


def test_a_lora_checkpoint_merges_to_the_full_model(tiny_videoreward, tmp_path):
    """The release's LoRA layout: adapter_model.safetensors (PEFT keys, released layout) and non_lora_state_dict.pth
    (the head and the resized embeddings); merged ``W + (alpha / r) B A`` it scores as the full model does."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration

    base, reward_dir, model, tokenizer = tiny_videoreward
    folder = tmp_path / "VideoReward"
    (folder / "checkpoint-9").mkdir(parents=True)
    config = json.loads((reward_dir / "model_config.json").read_text())
    config["peft_lora_config"] = {"lora_enable": True, "lora_r": 4, "lora_alpha": 8, "use_rslora": False}
    (folder / "model_config.json").write_text(json.dumps(config))
    full = model.state_dict()
    base_state = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32).state_dict()
    torch.manual_seed(2)
    lora, merged = {}, {}
    for installed, released in (("model.language_model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
                                ("model.visual.blocks.0.mlp.fc1", "visual.blocks.0.mlp.fc1")):
        weight = base_state[f"{installed}.weight"]
        a, b = torch.randn(4, weight.shape[1]) * 0.1, torch.randn(weight.shape[0], 4) * 0.1
        lora[f"base_model.model.{released}.lora_A.weight"] = a
        lora[f"base_model.model.{released}.lora_B.weight"] = b
        merged[f"{installed}.weight"] = weight + 2.0 * b @ a
    save_file(lora, folder / "checkpoint-9/adapter_model.safetensors")
    rest = {"base_model.model.rm_head.weight": full["rm_head.weight"],
            "base_model.model.model.embed_tokens.weight": full["model.language_model.embed_tokens.weight"]}
    torch.save(rest, folder / "checkpoint-9/non_lora_state_dict.pth")
    reward = VideoAlign(str(folder), str(base), min_pixels=16 * 16, normalize=False)
    state = reward.model.state_dict()
    for key, value in merged.items():
        assert torch.allclose(state[key], value, atol=1e-6), key
    assert torch.equal(state["rm_head.weight"], full["rm_head.weight"])
    untouched = "model.language_model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(state[untouched], base_state[untouched])


def test_videoalign_refuses_missing_files_and_images(tiny_videoreward, tmp_path):
    from flowalign.errors import RewardInputError

    base, reward_dir, _, _ = tiny_videoreward
    with pytest.raises(MissingWeightsError, match="model_config.json.*KwaiVGI/VideoReward.*kwargs.path"):
        VideoAlign(str(tmp_path))
    with pytest.raises(MissingWeightsError, match="Qwen/Qwen2-VL-2B-Instruct.*kwargs.base"):
        VideoAlign(str(reward_dir))  # the config names a hub id, not a local directory
    with pytest.raises(MissingWeightsError, match="no checkpoint-5 .*checkpoint-3, checkpoint-7"):
        VideoAlign(str(reward_dir), str(base), checkpoint_step=5)
    from flowalign.rewards import check_reward_run

    key = "reward.rewards[0].kwargs"  # the same checks before anything is built or loaded
    with pytest.raises(MissingWeightsError, match=r"Qwen/Qwen2-VL-2B-Instruct.*reward.rewards\[0\].kwargs.base"):
        check_reward_run("videoalign", {"path": str(reward_dir)}, key=key, model=None)
    with pytest.raises(MissingWeightsError, match="model_config.json"):
        check_reward_run("videoalign", {"path": str(tmp_path), "base": str(base)}, key=key, model=None)
    with pytest.raises(ValueError, match=r"reward.rewards\[0\].kwargs.outputs is not a setting.*did you mean 'output'"):
        check_reward_run("videoalign", {"path": str(reward_dir), "outputs": "VQ"}, key=key, model=None)
    check_reward_run("videoalign", {"path": str(reward_dir), "base": str(base)}, key=key, model=None)
    reward = VideoAlign(str(reward_dir), str(base), min_pixels=16 * 16)
    with pytest.raises(RewardInputError, match=r"scores videos \[B, F, 3, H, W\]"):
        reward(torch.zeros(1, 3, 16, 16), ["a"])
