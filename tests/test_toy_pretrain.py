"""`flowalign toy pretrain` for real, at a few steps: it writes a pipeline that diffusers and the adapter load."""

import json

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from flowalign import cli
from flowalign.models import load_flow_model
from flowalign.toy.pretrain import SceneStream
from flowalign.toy.prompts import split_prompts


def test_short_pretrain_writes_a_loadable_pipeline(tmp_path):
    out = tmp_path / "toy"
    assert cli.main(["toy", "pretrain", "--out", str(out), "--vae-steps", "2", "--steps", "3", "--batch-size", "4",
                     "--calibration-images", "64", "--threads", "1"]) == 0
    assert (out / "model_index.json").is_file() and not (tmp_path / "toy.tmp").exists()
    weights = list(out.rglob("*.safetensors"))
    assert {w.parent.name for w in weights} >= {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"}
    log = json.loads((out / "pretrain_log.json").read_text())
    assert log["config"]["steps"] == 3 and log["config"]["calibration_images"] == 64 and len(log["flow_loss"]) >= 1
    pipe = StableDiffusion3Pipeline.from_pretrained(out)
    assert pipe.vae.config.shift_factor == log["latent_shift"]
    model = load_flow_model(out)
    cond = model.encode(["a photo of a red circle"])
    with torch.no_grad():
        v = model.velocity(model.prepare_noise(1, 32), 1.0, cond)
    assert v.shape == (1, 4, 16, 16) and torch.isfinite(v).all()


def test_scene_stream_uses_training_prompts_only_and_is_seeded():
    train, test = split_prompts()
    held_out = {entry["prompt"] for entry in test}
    a, b = SceneStream(train, seed=3), SceneStream(train, seed=3)
    captions, pixels = a.batch(64)
    assert not held_out & set(captions)
    assert pixels.shape == (64, 3, 32, 32) and pixels.min() >= -1 and pixels.max() <= 1
    again_captions, again_pixels = b.batch(64)
    assert captions == again_captions and torch.equal(pixels, again_pixels)
    tags = {entry["prompt"]: entry["tag"] for entry in train}
    assert len({tags[c] for c in captions}) == 5  # every training tag is sampled


def test_scene_stream_tag_weights():
    train, _ = split_prompts()
    tags = {entry["prompt"]: entry["tag"] for entry in train}
    stream = SceneStream(train, seed=0, tag_weights={"color_attr": 2.0, "counting": 0.0})
    assert dict(zip(stream.tags, stream.tag_probs.round(6))) == {
        "color_attr": 0.4, "colors": 0.2, "counting": 0.0, "position": 0.2, "two_object": 0.2
    }
    captions, _ = stream.batch(200)
    drawn = [tags[c] for c in captions]
    assert "counting" not in drawn and 0.3 < drawn.count("color_attr") / 200 < 0.5
    with pytest.raises(ValueError, match=r"no training prompt: \['single_object'\]"):
        SceneStream(train, seed=0, tag_weights={"single_object": 1.0})
    with pytest.raises(ValueError, match="finite and >= 0"):
        SceneStream(train, seed=0, tag_weights={"colors": -1.0})


def test_bad_step_counts_are_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["toy", "pretrain", "--steps", "0"])
    assert exit_info.value.code == 2 and "--steps" in capsys.readouterr().err
