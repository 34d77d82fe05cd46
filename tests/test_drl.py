"""DRL: the projection logit, the logistic + R1 loss, the Fréchet distance, `prep train-discriminator`, the drl
preset (2 iterations, resume) and bad discriminator checkpoints refused before any model loads."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import load_config
from flowalign.errors import SetupError
from flowalign.evaluation.frechet import frechet_distance, gaussian_frechet_distance
from flowalign.reward_models.discriminator import (
    DiscriminatorReward, ProjectionDiscriminator, check_discriminator, discriminator_loss, untrained_discriminator)
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import small_run_values, torch_threads

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "assets/toy-sd3"
PRESET = REPO / "configs/methods/drl.yaml"


def rewards(path) -> str:
    """The override ``reward.rewards`` of a run scored by the discriminator at ``path``."""
    return "[{name: discriminator, kwargs: {path: " + str(path) + "}}]"


# ------------------------------------------------------------------------------------------------ the math


def test_projection_logit_is_phi_h_plus_the_text_projection():
    """r = phi(h f) + <h f, e(c)> + b(c) with hand-set weights: h f = (1, 2), phi = 3 h1 - h2 + 0.5 = 1.5,
    e(c) = (2, -1) (c = (1, 0)), <h f, e> = 0, b(c) = 0.25 + 0.75 = 1: r = 2.5; prompt-free: 1.5."""
    head = ProjectionDiscriminator(2, text_dim=2, width=2)
    with torch.no_grad():
        head.h.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        head.h.bias.zero_()
        head.phi.weight.copy_(torch.tensor([[3.0, -1.0]]))
        head.phi.bias.fill_(0.5)
        head.e.weight.copy_(torch.tensor([[2.0, 0.0], [-1.0, 0.0]]))
        head.e.bias.zero_()
        head.b.weight.copy_(torch.tensor([[0.75, 0.0]]))
        head.b.bias.fill_(0.25)
    f, c = torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    assert head(f, c).tolist() == [2.5]
    free = ProjectionDiscriminator(2, width=2)
    free.load_state_dict({k: v for k, v in head.state_dict().items() if k.split(".")[0] in ("h", "phi")})
    assert free(f).tolist() == [1.5]
    assert ProjectionDiscriminator(2, text_dim=3, width=4)(f, torch.ones(1, 3)).shape == (1,)  # e, b start at 0


def test_logistic_loss_with_r1_on_the_image_matches_the_hand_computation():
    """Features = the flattened image, so r(x) = a.x + k with a = H^T w and grad_x r = a for every image: the R1
    term is ||a||^2 and the loss softplus(-r_real) + softplus(r_fake) + gamma/2 ||a||^2."""
    head = ProjectionDiscriminator(4, width=2)
    with torch.no_grad():
        head.h.weight.copy_(torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.5, 1.0, 0.0, 0.0]]))
        head.h.bias.copy_(torch.tensor([0.1, -0.2]))
        head.phi.weight.copy_(torch.tensor([[1.0, 2.0]]))
        head.phi.bias.fill_(-0.3)
    a = torch.tensor([2.0, 2.0, -1.0, 2.0])  # H^T w
    k = 0.1 - 0.4 - 0.3
    real = torch.tensor([[0.5, 0.25, 1.0, 0.0], [0.0, 1.0, 0.5, 0.5]]).view(2, 1, 2, 2)
    fake = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).view(1, 1, 2, 2)
    gamma = 0.3
    parts = discriminator_loss(lambda x, c: head(x.flatten(1), c), real, fake, gamma=gamma)
    r_real = real.flatten(1) @ a + k
    r_fake = fake.flatten(1) @ a + k
    softplus = lambda z: math.log1p(math.exp(z))  # noqa: E731
    expected_real = sum(softplus(-float(r)) for r in r_real) / 2
    expected_fake = softplus(float(r_fake[0]))
    assert parts["r1"].item() == pytest.approx(float(a @ a))  # 13
    assert parts["real"].item() == pytest.approx(expected_real, rel=1e-6)
    assert parts["fake"].item() == pytest.approx(expected_fake, rel=1e-6)
    assert parts["loss"].item() == pytest.approx(expected_real + expected_fake + gamma / 2 * 13, rel=1e-6)
    parts["loss"].backward()  # R1's gradient reaches the head (create_graph)
    assert head.h.weight.grad.abs().sum() > 0
    assert discriminator_loss(lambda x, c: head(x.flatten(1), c), real, fake, gamma=0.0)["r1"].item() == 0.0


def test_frechet_distance_of_a_hand_computed_gaussian_pair():
    """N((0,0), diag(1,4)) vs N((1,2), diag(4,1)): |dmu|^2 = 5, tr = 5 + 5, 2 tr sqrt(C_a^1/2 C_b C_a^1/2) =
    2 (2 + 2): FD = 7. A rotated covariance gives the same (the formula is basis-free); samples: FD of a set with
    itself is 0 and a shift by d adds |d|^2."""
    assert gaussian_frechet_distance([0, 0], np.diag([1.0, 4.0]), [1, 2], np.diag([4.0, 1.0])) == pytest.approx(7.0)
    rotation = np.array([[0.6, -0.8], [0.8, 0.6]])
    assert gaussian_frechet_distance([0, 0], rotation @ np.diag([1.0, 4.0]) @ rotation.T, [1, 2],
                                     rotation @ np.diag([4.0, 1.0]) @ rotation.T) == pytest.approx(7.0)
    x = torch.randn(200, 3, generator=torch.Generator().manual_seed(0))
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-9)
    assert frechet_distance(x, x + torch.tensor([1.0, -2.0, 0.5])) == pytest.approx(5.25, rel=1e-9)
    with pytest.raises(ValueError, match="same D"):
        frechet_distance(x, x[:, :2])


# ------------------------------------------------------------------------------------------------ the command


def _train_args(data, out, command=("prep", "train-discriminator")):
    return [*command, "--model", str(TOY), "--data", str(data), "--image-size", "32",
            "--sample-steps", "2", "--batch-size", "16", "--buffer-batches", "1", "--epochs", "5", "--max-steps", "10",
            "--validate-every", "5", "--val-fraction", "0.25", "--lr", "1e-2", "--width", "64", "--gamma", "0",
            "--conditioning", "none", "--out", str(out)]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from flowalign.data.images import write_toy_dataset

    return write_toy_dataset(tmp_path_factory.mktemp("toy-data"), 24, seed=3, size=32)


def test_train_discriminator_separates_data_from_samples_and_repeats_bitwise(toy_data, tmp_path, capsys):
    from flowalign.cli import main
    from flowalign.data.images import open_image_dataset
    from flowalign.models.loading import load_flow_model
    from flowalign.prep.train_discriminator import DiscriminatorTrainConfig, _fakes

    with torch_threads(1):  # b with the deprecated name: the same command, bitwise, plus a line naming the new one
        for name, command in (("a", ("prep", "train-discriminator")), ("b", ("reward", "train-discriminator"))):
            assert main(_train_args(toy_data, tmp_path / name / "d.safetensors", command)) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert captured.err.count("deprecated: use `flowalign prep train-discriminator`") == 1, captured.err
    # an existing output is refused before the model loads, as export refuses one: nothing is overwritten
    before = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    with pytest.raises(SystemExit) as refused:
        main(_train_args(toy_data, tmp_path / "a" / "d.safetensors"))
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "nothing is overwritten" in error and "d-2.safetensors" in error, error
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == before  # no temporary file is left
    a, b = (load_file(str(tmp_path / n / "d.safetensors")) for n in ("a", "b"))
    assert set(a) == {"h.weight", "h.bias", "phi.weight", "phi.bias"} and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tmp_path / "a" / "d.json").read_text())
    assert meta["history"] == json.loads((tmp_path / "b" / "d.json").read_text())["history"]
    assert meta["image_size"] == [32, 32] and meta["features"]["kind"] == "segmenter"
    assert meta["conditioning"] == "none" and meta["val_images"] == 6 and meta["model"] == str(TOY)
    assert meta["val_accuracy"] > 0.5, meta["history"]
    # the reward it makes: fresh data renders score above fresh base samples (noise keys the training never drew)
    reward = DiscriminatorReward(str(tmp_path / "a" / "d.safetensors"), device="cpu")
    real, prompts = open_image_dataset("toy:1", 32).batch(range(100, 108))
    with torch_threads(1):
        fake = _fakes(load_flow_model(TOY), prompts, [(99, j) for j in range(8)],
                      DiscriminatorTrainConfig(sample_steps=2), 32)
    assert reward(real, prompts, [{}] * 8).mean() > reward(fake, prompts, [{}] * 8).mean()
    scores = reward.forward(real.requires_grad_(True), prompts)
    scores.sum().backward()
    assert real.grad.abs().sum() > 0  # differentiable in the images
    with pytest.raises(ValueError, match="scores 32x32 images, got 16x16"):
        reward(real[:, :, :16, :16], prompts, [{}] * 8)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("images, fraction", [(2, 0.9), (3, 0.9), (1, 0.1)])
def test_a_split_that_leaves_no_training_row_is_refused_before_the_model_loads(tmp_path, capsys, images, fraction):
    """held = max(1, round(val_fraction * rows)): 2 rows at 0.9 hold out 2, 3 rows at 0.9 hold out 3, 1 row holds out
    its only row. The model path does not exist, so a refusal that names val_fraction ran before any model load."""
    from flowalign.cli import main
    from flowalign.data.images import write_toy_dataset

    data = write_toy_dataset(tmp_path / "data", images, size=32)
    args = ["prep", "train-discriminator", "--model", str(tmp_path / "no-model"), "--data", str(data),
            "--val-fraction", str(fraction), "--out", str(tmp_path / "d.safetensors")]
    with pytest.raises(SystemExit) as exit_status:
        main(args)
    err = capsys.readouterr().err
    assert exit_status.value.code == 2 and f"val_fraction = {fraction} holds out" in err and f"of the {images} rows" in err and "leaving 0" in err
    assert "lower val_fraction" in err and "Traceback" not in err and "no-model" not in err
    assert not (tmp_path / "d.safetensors").exists()


def test_a_discriminator_for_another_model_size_or_features_is_refused_naming_the_file_and_the_fix(tmp_path):
    from diffusers import SD3Transformer2DModel

    from flowalign.models.tiny import tiny_sd3_pipeline

    tiny_sd3_pipeline(["a", "red", "circle"], seed=0).save_pretrained(tmp_path / "tiny")
    copy = shutil.copytree(tmp_path / "tiny", tmp_path / "copy")  # the same model elsewhere is the same model
    path = untrained_discriminator(tmp_path / "tiny", tmp_path / "d.safetensors", image_size=32, width=8)
    assert check_discriminator(path, model=str(copy), image_size=32)["model_fingerprint"]
    transformer = SD3Transformer2DModel.from_pretrained(tmp_path / "tiny" / "transformer")
    with torch.no_grad():
        next(transformer.parameters()).add_(1.0)  # a fine-tuned transformer of the same architecture
    transformer.save_pretrained(tmp_path / "copy" / "transformer")
    with pytest.raises(ValueError, match=r"d\.safetensors.*another base model.*flowalign prep train-discriminator"):
        check_discriminator(path, model=str(copy), image_size=32)
    with pytest.raises(ValueError, match=r"d\.safetensors.*trained on 32x32 images, the run samples 64x64"):
        check_discriminator(path, model=str(tmp_path / "tiny"), image_size=64)
    meta = json.loads((tmp_path / "d.json").read_text())
    meta["features"]["fingerprint"] = "0" * 16
    (tmp_path / "d.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"d\.safetensors.*other segmenter features.*train-discriminator"):
        check_discriminator(path, model=str(tmp_path / "tiny"), image_size=32)
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors.*flowalign prep train-discriminator"):
        check_discriminator(tmp_path / "missing.safetensors", model=str(tmp_path / "tiny"))


def test_the_trainer_refuses_a_missing_or_foreign_discriminator_before_the_model_loads(tmp_path, monkeypatch):
    import flowalign.training.builder as builder

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the discriminator was checked")

    monkeypatch.setattr(builder, "load_flow_model", no_model)
    values = {**small_run_values(TOY, tmp_path / "run"), "reward.rewards": rewards(tmp_path / "absent.safetensors")}
    config = load_config(TrainConfig, PRESET, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(SetupError, match=r"reward\.rewards\[0\]\.kwargs\.path.*absent\.safetensors.*"
                                         r"flowalign prep train-discriminator"):
        Trainer(config)
    other = untrained_discriminator(tmp_path / "elsewhere", tmp_path / "d.safetensors", image_size=32, width=8)
    values["reward.rewards"] = rewards(other)
    config = load_config(TrainConfig, PRESET, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(SetupError, match=r"d\.safetensors.*another base model"):
        Trainer(config)


# ------------------------------------------------------------------------------------------------ the preset


def test_drl_preset_trains_with_the_kl_and_resumes_bitwise(tmp_path):
    """2 iterations (first ratio exactly 1, the KL 0 then > 0; a text-conditioned discriminator) against the run
    resumed from its first checkpoint into another directory: the same rewards and weights, bitwise."""
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    tiny_sd3_pipeline(sorted({w for e in train + test for w in e["prompt"].split()}), seed=0).save_pretrained(
        tmp_path / "tiny")
    path = untrained_discriminator(tmp_path / "tiny", tmp_path / "d.safetensors", image_size=32, width=16,
                                   conditioning="text")

    def run(out, iterations, **extra):
        values = {**small_run_values(tmp_path / "tiny", out), "train.iterations": iterations,
                  "train.checkpoint_every": 1, "reward.rewards": rewards(path),
                  **extra}
        return Trainer(load_config(TrainConfig, PRESET, [f"{k}={v}" for k, v in values.items()])).train()

    full = run(tmp_path / "full", 2)
    assert full[0]["first_ratio_max"] == 1.0 and full[0]["kl"] == 0.0 and full[1]["kl"] > 0
    assert full[0]["reward_std"] > 0
    resumed = run(tmp_path / "split", 2, **{"train.resume": str(tmp_path / "full" / "checkpoint-000001")})
    assert [m["reward"] for m in resumed[1:]] == [m["reward"] for m in full[1:]]
    a = load_file(str(tmp_path / "full" / "checkpoint-000002" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000002" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dinov2_features_from_a_local_tiny_checkpoint_score_images_with_gradients(tmp_path):
    """The real-model feature path: transformers' Dinov2Model from a local directory (a tiny config saved in-process,
    no hub), its CLS token after the final layer norm; the reward on it is differentiable on the image (R1 needs it)
    and a checkpoint made on other DINOv2 weights is refused."""
    from transformers import Dinov2Config, Dinov2Model

    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.reward_models.discriminator import build_features

    config = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          image_size=28, patch_size=14)
    torch.manual_seed(0)
    dinov2 = Dinov2Model(config).eval()
    dinov2.save_pretrained(tmp_path / "dinov2")
    features = build_features("dinov2", str(tmp_path / "dinov2"))
    images = torch.rand(2, 3, 32, 32)
    expected = dinov2(pixel_values=(torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear")
                                    - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
                      / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)).pooler_output
    torch.testing.assert_close(features(images), expected)
    assert not any(p.requires_grad for p in features.parameters())  # frozen

    tiny_sd3_pipeline(["a", "red", "circle"], seed=0).save_pretrained(tmp_path / "tiny")
    path = untrained_discriminator(tmp_path / "tiny", tmp_path / "d.safetensors", image_size=32, width=8,
                                   features="dinov2", features_path=str(tmp_path / "dinov2"))
    reward = DiscriminatorReward(str(path))
    pixels = images.clone().requires_grad_(True)
    scores = reward.forward(pixels, ["a red circle"] * 2)
    assert scores.shape == (2,)
    (grad,) = torch.autograd.grad(scores.sum(), pixels)
    assert grad.abs().sum() > 0
    check_discriminator(path, model=str(tmp_path / "tiny"), image_size=32)
    with torch.no_grad():
        next(dinov2.parameters()).add_(1.0)
    dinov2.save_pretrained(tmp_path / "dinov2")  # other DINOv2 weights at the same path
    with pytest.raises(ValueError, match=r"d\.safetensors.*other dinov2 features"):
        check_discriminator(path, model=str(tmp_path / "tiny"), image_size=32)
