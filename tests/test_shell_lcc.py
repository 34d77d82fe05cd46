"""Shell-LCC: the manifold against the public code's numbers, its checkpoints, fit-manifold, the latent reward in
training, RGS and RG-OPD, the released objective, and bad input.

The reference numbers come from needylove/Shell-LCC ``manifold/shell_lcc.py::ShellCoordinateManifold`` run outside
this repository on the state dicts of ``recipe_state`` (the same recipe: a fresh module's keys, every tensor replaced
by seeded values, so BatchNorm's running statistics are not the trivial 0 / 1) and the latents
``torch.randn(shape, generator=manual_seed(100 + seed))``: ``distance_reward`` and its gradient in eval mode, the band
``|distance_reward - tau|``, ``forward(z, stage='joint')`` in eval mode, and ``forward(z, stage='lcc')`` in train
mode (with BatchNorm's running mean after it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowalign.reward_models.shell_lcc import (ShellLCC, ShellLCCReward, load_manifold, save_manifold, sidecar_path,
                                               vae_fingerprint)

REPO = Path(__file__).resolve().parents[1]

# The public code's state-dict keys (ShellCoordinateManifold), in its order.
REFERENCE_KEYS = ["basis", "global_scale", "global_bias", "predictor.0.weight", "predictor.0.bias",
                  "predictor.1.weight", "predictor.1.bias", "predictor.1.running_mean", "predictor.1.running_var",
                  "predictor.1.num_batches_tracked", "predictor.3.weight", "predictor.3.bias", "predictor.5.weight",
                  "predictor.5.bias", "surface_head.0.weight", "surface_head.0.bias", "surface_head.2.weight",
                  "surface_head.2.bias"]

# label: (C, K, hidden, latent shape, seed, tau) and the reference module's outputs.
CASES = {
    "c4_t1": ((4, 8, 16, (2, 4, 1, 3, 5), 0, 3.0), dict(
        R=2.8975203037261963, grad_sum=0.7218626141548157, grad_abs=2.6377058029174805,
        grad_first=[0.049703627824783325, 0.02031821757555008, 0.013975242152810097, 0.012950893491506577,
                    -0.017353245988488197, 0.04215383157134056],
        band=0.10247969627380371, joint=12.665334701538086, lcc=6.855403900146484,
        lcc_parts=dict(mse=1.3533899784088135, locality=5.394154071807861, kl=0.05692175030708313,
                       basis_to_data=0.5093787312507629),
        running_mean_after=[-0.21188372373580933, -0.3132801949977875, 0.44276323914527893])),
    "c16": ((16, 32, 24, (2, 16, 2, 2, 3), 1, 40.0), dict(
        R=37.77626037597656, grad_sum=22.52154541015625, grad_abs=239.7575225830078,
        grad_first=[-0.11932232230901718, -0.08380971103906631, -0.038868822157382965, -0.007731405086815357,
                    -0.067471444606781, 0.06495953351259232],
        band=2.2237396240234375, joint=3043.721923828125, lcc=20.815689086914062,
        lcc_parts=dict(mse=1.2071794271469116, locality=18.761404037475586, kl=0.027101656422019005,
                       basis_to_data=8.200027465820312),
        running_mean_after=[0.338986337184906, 0.2401379495859146, 0.30125829577445984])),
}


def recipe_state(channels: int, bases: int, hidden: int, seed: int) -> dict:
    """The reference cases' state dict: num_batches_tracked 7, running_var 0.5 + U, running_mean 0.3 N,
    global_scale 1.3, every other tensor 0.5 N, drawn in key order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in ShellLCC(channels, bases, hidden).state_dict().items():
        if name.endswith("num_batches_tracked"):
            state[name] = torch.tensor(7)
        elif name.endswith("running_var"):
            state[name] = 0.5 + torch.rand(tensor.shape, generator=g)
        elif name.endswith("running_mean"):
            state[name] = 0.3 * torch.randn(tensor.shape, generator=g)
        elif name == "global_scale":
            state[name] = torch.tensor([1.3])
        else:
            state[name] = 0.5 * torch.randn(tensor.shape, generator=g)
    return state


def reference_manifold(label: str, tmp_path: Path) -> tuple[ShellLCC, torch.Tensor, tuple, dict]:
    """The case's manifold, loaded from a file in the public code's format (``{"model": DDP state dict, "config"}``)."""
    (channels, bases, hidden, shape, seed, tau), expected = CASES[label]
    path = tmp_path / f"{label}.pth"
    torch.save({"epoch": 3, "model": {f"module.{k}": v for k, v in recipe_state(channels, bases, hidden, seed).items()},
                "optimizer": {}, "config": {"embedding_dim": channels, "num_bases": bases, "hidden_dim": hidden}}, path)
    manifold, meta = load_manifold(path)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(100 + seed))
    return manifold, z, (tau,), expected


def test_the_state_dict_has_the_public_code_s_names():
    assert list(ShellLCC(4, 8, 16).state_dict()) == REFERENCE_KEYS


@pytest.mark.parametrize("label", sorted(CASES))
def test_distance_band_and_losses_match_the_public_code(label, tmp_path):
    manifold, z, (tau,), ref = reference_manifold(label, tmp_path)
    assert not manifold.training  # loaded in eval mode: BatchNorm's running statistics
    x = z.clone().requires_grad_(True)
    reward = manifold.distance_reward(x)
    (grad,) = torch.autograd.grad(reward, x)
    assert reward.item() == pytest.approx(ref["R"], rel=1e-6)
    assert grad.sum().item() == pytest.approx(ref["grad_sum"], rel=1e-5)
    assert grad.abs().sum().item() == pytest.approx(ref["grad_abs"], rel=1e-5)
    assert torch.allclose(grad.flatten()[:6], torch.tensor(ref["grad_first"]), rtol=1e-5, atol=1e-8)
    x = z.clone().requires_grad_(True)
    band = manifold.band_reward(x, tau)
    (band_grad,) = torch.autograd.grad(band, x)
    assert band.item() == pytest.approx(ref["band"], rel=1e-5)
    assert torch.allclose(band_grad, -grad, rtol=1e-6, atol=1e-9)  # tau above R: the band's gradient is flipped
    with torch.no_grad():
        assert manifold.shell_loss(z)[0].item() == pytest.approx(ref["joint"], rel=1e-6)
        manifold.train()  # stage 1 trains with BatchNorm's batch statistics, updating the running ones
        loss, parts = manifold.lcc_loss(z)
    assert loss.item() == pytest.approx(ref["lcc"], rel=1e-6)
    assert parts == pytest.approx(ref["lcc_parts"], rel=1e-6)
    assert manifold.predictor[1].running_mean[:3].tolist() == pytest.approx(ref["running_mean_after"], rel=1e-6)
    # a one-frame latent (B, C, H, W) is the video (B, C, 1, H, W)
    manifold.eval()
    if z.shape[2] == 1:
        assert torch.equal(manifold.sample_distances(z[:, :, 0]), manifold.sample_distances(z))


def test_the_reward_scores_minus_the_distance_with_its_gradient(tmp_path):
    manifold, z, (tau,), ref = reference_manifold("c4_t1", tmp_path)
    path = save_manifold(manifold, tmp_path / "m.safetensors", fitted_for=None, extra={"data_distance": 2.5})
    for variant, expected_tau in (("distance", None), ("band", 2.5)):
        reward = ShellLCCReward(str(path), variant=variant)
        latents = z[:, :, 0].clone().requires_grad_(True)
        scores = reward.forward(latents)
        distances = manifold.sample_distances(z[:, :, 0])
        assert scores.shape == (2,) and scores.requires_grad
        expected = -distances if variant == "distance" else -(distances - expected_tau).abs()
        assert torch.allclose(scores, expected)
        assert reward(z[:, :, 0], ["a", "b"], [{}, {}]).requires_grad is False
    assert ShellLCCReward(str(path), variant="band", tau=0.4).tau == 0.4


def tiny_manifold(model_path: Path, out: Path, channels: int = 4) -> Path:
    """A seeded (unfitted) manifold recorded as fitted for ``model_path``, for runs that only need one."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        manifold = ShellLCC(channels, 16, 16).eval()
    return save_manifold(manifold, out, fitted_for=vae_fingerprint(model_path), extra={"data_distance": 1.0})


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from test_presets import words

    root = tmp_path_factory.mktemp("tiny") / "sd3"
    tiny_sd3_pipeline(words(), seed=0).save_pretrained(root)
    return root


def test_fit_manifold_is_bitwise_repeatable_and_its_checkpoint_loads(tiny_sd3, tmp_path, capsys):
    from flowalign.cli import main

    args = ["--model", str(tiny_sd3), "--data", "toy:1", "--max-images", "16",
            "--num-bases", "16", "--hidden-dim", "16", "--epochs-lcc", "2", "--epochs-shell", "2", "--batch-size", "4",
            "--device", "cpu"]
    # b with the deprecated name: the same command, bitwise, plus a line on stderr naming the new one
    for name, command in (("a", ["prep", "fit-manifold"]), ("b", ["reward", "fit-manifold"])):
        assert main(command + args + ["--out", str(tmp_path / f"{name}.safetensors")]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert captured.err.count("deprecated: use `flowalign prep fit-manifold`") == 1, captured.err
    args = ["prep", "fit-manifold", *args]
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    # an existing output is refused before the model loads, as export refuses one: nothing is overwritten
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit) as refused:
        main(args + ["--out", str(tmp_path / "a.safetensors")])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "nothing is overwritten" in error and "a-2.safetensors" in error, error
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # and no temporary file is left
    meta = json.loads(sidecar_path(tmp_path / "a.safetensors").read_text())
    assert meta["latent_channels"] == 4 and meta["fitted_for"] == vae_fingerprint(tiny_sd3)
    assert meta["fit"]["images"] == 16 and meta["fitted_for"]["vae_weights_sha256"]
    reward = ShellLCCReward(str(tmp_path / "a.safetensors"))
    ShellLCCReward.check_run({"path": str(tmp_path / "a.safetensors")}, key="reward.rewards[0].kwargs",
                             model=str(tiny_sd3))
    assert reward.tau == pytest.approx(meta["data_distance"])


def train_config(model_path: Path, out: Path, *overrides: str, preset: str = "shell_lcc"):
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from golden_runs import small_run_values

    values = [f"{k}={v}" for k, v in small_run_values(model_path, out).items()]
    return load_config(TrainConfig, REPO / f"configs/methods/{preset}.yaml", values + list(overrides))


def refuse_loading(monkeypatch):
    import flowalign.training.builder as builder

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the bad input was refused")

    monkeypatch.setattr(builder, "load_flow_model", no_model)


def test_a_manifold_for_another_model_is_refused_before_the_model_loads(tiny_sd3, tmp_path, monkeypatch):
    from flowalign.errors import SetupError
    from flowalign.training.trainer import Trainer

    refuse_loading(monkeypatch)
    other_channels = tiny_manifold(tiny_sd3, tmp_path / "c16.safetensors", channels=16)
    other_vae = tiny_manifold(REPO / "assets/toy-sd3", tmp_path / "toy.safetensors")
    for path, says in ((other_channels, "16-channel latents"), (other_vae, "another VAE")):
        reward = f"reward.rewards=[{{name: shell_lcc, kwargs: {{path: {path}}}}}]"
        with pytest.raises(SetupError, match=says) as error:
            Trainer(train_config(tiny_sd3, tmp_path / "run", reward))
        assert str(path) in str(error.value) and "flowalign prep fit-manifold" in str(error.value)
        with pytest.raises(SetupError, match=says):
            Trainer(train_config(tiny_sd3, tmp_path / "run2", f"objectives.shell_lcc.path={path}",
                                     preset="shell_lcc_objective"))


def test_a_missing_manifold_names_the_command_that_makes_it(tiny_sd3, tmp_path, monkeypatch):
    from flowalign.errors import SetupError
    from flowalign.training.trainer import Trainer

    refuse_loading(monkeypatch)
    missing = tmp_path / "none.safetensors"
    with pytest.raises(SetupError, match="flowalign prep fit-manifold") as error:
        Trainer(train_config(tiny_sd3, tmp_path / "run", f"objectives.shell_lcc.path={missing}",
                                 preset="shell_lcc_objective"))
    assert str(missing) in str(error.value)
    with pytest.raises(Exception, match="flowalign prep fit-manifold"):
        Trainer(train_config(tiny_sd3, tmp_path / "run2",
                                 f"reward.rewards=[{{name: shell_lcc, kwargs: {{path: {missing}}}}}]"))


def test_a_reward_without_a_gradient_is_refused_where_one_is_needed():
    from flowalign.rewards import build_differentiable_reward, differentiable_rewards, score_latents

    assert "shell_lcc" in differentiable_rewards()
    with pytest.raises(ValueError, match="loss.rg_opd.reward 'jpeg_compressibility' is not differentiable"):
        build_differentiable_reward("jpeg_compressibility", "loss.rg_opd.reward")

    class ValuesOnly:
        name, reads_latents = "values_only", True

        def __call__(self, latents, prompts, metadata):
            return latents.flatten(1).mean(1)

    with pytest.raises(ValueError, match="'values_only' is not differentiable"):
        score_latents(ValuesOnly(), torch.zeros(1, 4, 2, 2), None, ["a"], differentiable=True)


def test_the_latent_reward_guides_rgs_without_decoding(tiny_sd3, tmp_path):
    """RGS's gradient from shell_lcc on x0_hat (``--rgs-gradient x0``: free): the latents are scored, never decoded."""
    from flowalign.inference.sample import SampleConfig, run_guided
    from flowalign.models import load_flow_model

    model = load_flow_model(str(tiny_sd3), device="cpu")
    model.transformer.requires_grad_(False)
    path = tiny_manifold(tiny_sd3, tmp_path / "m.safetensors")
    guide = ShellLCCReward(str(path), variant="distance")
    decodes = []
    decode = model.decode
    model.decode = lambda x: decodes.append(len(x)) or decode(x)
    metadata = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]
    common = dict(steps=4, budget=4, reward="brightness", rgs_gradient="x0")
    guided = run_guided(model, metadata, SampleConfig(guidance="rgs", rgs_reward="shell_lcc", **common),
                        reward_fn=guide, guide_reward=guide)
    assert decodes == [] and guided.nfe.tolist() == [4, 4]  # the gradient on x0_hat costs no transformer pass
    plain = run_guided(model, metadata, SampleConfig(guidance="none", **common), reward_fn=guide)
    assert not torch.equal(guided.final, plain.final)
    assert torch.isfinite(guided.reward).all()  # the final reward (shell_lcc here) read the latents too


def test_the_objective_resumes_bitwise_and_its_first_ratio_is_one(tiny_sd3, tmp_path):
    """The released objective on top of GRPO: 2 iterations, then the same run resumed after iteration 1."""
    from flowalign.training.trainer import Trainer

    path = tiny_manifold(tiny_sd3, tmp_path / "m.safetensors")
    settings = [f"objectives.shell_lcc.path={path}", "objectives.shell_lcc.batch_size=2", "train.checkpoint_every=1",
                "objectives.shell_lcc.drift_margin=0.0", "sampling.num_steps=4"]  # a short rollout: the objective is tested
    full = Trainer(train_config(tiny_sd3, tmp_path / "full", *settings, preset="shell_lcc_objective"))
    history = full.train()
    assert history[0]["first_ratio_max"] == 1.0
    stats = {k: v for k, v in history[0].items() if k.startswith("objectives/shell_lcc/")}
    assert stats["objectives/shell_lcc/distance"] > 0 and stats["objectives/shell_lcc/drift"] == 0.0
    checkpoint = sorted((tmp_path / "full").glob("checkpoint-*"))[0]
    resumed = Trainer(train_config(tiny_sd3, tmp_path / "resumed", *settings, f"train.resume={checkpoint}",
                                       preset="shell_lcc_objective"))
    assert resumed.iteration == 1
    resumed.train()
    for name, value in full.trainable_state().items():
        assert torch.equal(value, resumed.trainable_state()[name]), name


def test_image_statistics_tell_renders_from_blur_and_a_flat_canvas():
    import torch.nn.functional as F

    from flowalign.data.images import ToySceneDataset
    from flowalign.toy.statistics import image_statistics

    images, _ = ToySceneDataset(32, renders=1).batch(range(4))
    crisp = image_statistics(images)
    assert crisp["purity"] == 1.0 and crisp["palette_distance"] < 1e-6 and crisp["flat_fraction"] == 0.0
    blurred = image_statistics(F.avg_pool2d(images, 3, stride=1, padding=1, count_include_pad=False))
    assert blurred["purity"] < crisp["purity"] and blurred["edge_step"] < 0.5 * crisp["edge_step"]
    flat = image_statistics(torch.full((2, 3, 32, 32), 128 / 255))
    assert flat["flat_fraction"] == 1.0 and flat["background_fraction"] == 1.0 and flat["purity"] == 1.0
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        image_statistics(torch.zeros(3, 32, 32))
