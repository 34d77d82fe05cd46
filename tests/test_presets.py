"""Every shipped config loads; method presets run an iteration; model presets run on tiny pipelines of their class."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from flowalign.config import diff_configs, load_config, to_dict
from flowalign.models.tiny import tiny_flux_pipeline, tiny_sd3_pipeline
from flowalign.credit.tp_grpo import RELEASED_OPTIONS
from flowalign.toy.prompts import split_prompts
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import SMALL_RUN_SHAPE, small_run_values

REPO = Path(__file__).resolve().parents[1]
METHODS = sorted((REPO / "configs/methods").glob("*.yaml"))
MODELS = sorted((REPO / "configs/models").glob("*.yaml"))


def words():
    train, test = split_prompts()
    return sorted({w for e in train + test for w in e["prompt"].split()})


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tiny_sd3_pipeline(words(), seed=0).save_pretrained(root / "sd3")
    tiny_flux_pipeline(words(), seed=0).save_pretrained(root / "flux")
    return {"sd3": root / "sd3", "flux": root / "flux"}


def small_run(model_path, out, **extra):
    values = {**small_run_values(model_path, out), **extra}
    return [f"{k}={v}" for k, v in values.items()]


def test_the_expected_presets_ship():
    assert {p.stem for p in METHODS} == {"flow_grpo", "flow_grpo_fast", "dance_grpo", "mix_grpo", "branch_grpo",
                                         "tempflow_grpo", "dense_grpo", "tp_grpo", "tp_grpo_paper",
                                         "register_grpo", "vgpo", "euphonium", "drl", "drl_adjoint", "shell_lcc",
                                         "shell_lcc_objective", "soar", "sft", "diffusion_nft", "awm", "dpo",
                                         "grpo_guard", "gardo", "pref_grpo", "flow_dppo", "dgpo", "crd"}
    assert {p.stem for p in MODELS} == {"sd35_medium", "flux_dev", "flux2_dev", "qwen_image", "z_image",
                                        "flux2_klein", "flux_kontext", "qwen_image_edit_plus", "ltx_video", "ltx2", "mochi",
                                        "skyreels_v2", "sana_video", "hunyuan_video15", "kandinsky5_t2v", "wan21_t2v",
                                        "wan21_i2v", "wan22_a14b", "wan22_ti2v_5b"}
    from flowalign.training.collectives import SUPPORTED_DISTRIBUTED_TYPES

    launches = sorted((REPO / "configs/accelerate").glob("*.yaml"))
    assert {p.stem for p in launches} == {"ddp", "multi_node"}
    for path in launches:  # no shipped launch config is one the trainer refuses
        assert yaml.safe_load(path.read_text())["distributed_type"] in SUPPORTED_DISTRIBUTED_TYPES


# (stochastic steps, NFEs of one iteration of 2 prompts: rollout + completions) at 10 steps, group 2 (16 for trees).
EXPECTED = {
    "flow_grpo": (9, 2 * 2 * 10),
    "flow_grpo_fast": (2, 2 * 2 * 10),
    "mix_grpo": (4, 2 * 2 * 10),
    "dance_grpo": (9, 2 * 2 * 10),
    "branch_grpo": (9, 2 * (1 + 2 + 2 + 4 + 4 + 8 + 8 + 16 * 3)),
    "tempflow_grpo": (9, 2 * 7 + 2 * 2 * (9 + 7 + 5 + 3)),
    "dense_grpo": (9, 2 * 2 * (10 + 55)),
    "tp_grpo": (9, 2 * 2 * (10 + 54)),  # x_9's completion is the final image: R_n = R_T, as released
    "tp_grpo_paper": (9, 2 * 2 * (10 + 55)),
    "register_grpo": (9, 2 * 2 * (10 + 1)),
    "vgpo": (9, 2 * 2 * 10),  # the instant rewards' x0_hat comes from the rollout's own passes
    "euphonium": (9, 2 * 2 * 10),  # the process reward's gradient is taken on x0_hat: decodes, no NFE
    "drl": (9, 2 * 2 * 10),
    "shell_lcc": (9, 2 * 2 * 10),  # the manifold reads the final latents: no decode, no NFE
    "shell_lcc_objective": (9, 2 * 2 * 10 + 2),  # and the objective's one forward per pair of its unit of 2
    "grpo_guard": (9, 2 * 2 * 10),  # RatioNorm reads the rollout's own velocities: no extra NFE
    "pref_grpo": (9, 2 * 2 * 10),  # the pairwise judge (here the stand-in on brightness) costs no NFE
    "flow_dppo": (5, 2 * 2 * 10),  # SDE on the first 5 steps; the mask reads the rollout's own velocities
    "gardo": (9, 2 * 2 * 10),  # the gated KL's reference pass is a training forward, not an NFE
}
# Objective-only presets (no rollout): NFEs of one iteration of 2 units of 1 pair. SOAR: a CFG step (2) plus the base
# and 6 auxiliary points (7) per pair; SFT: 1; adjoint matching (units of 1 trajectory of K = 10 steps): 10 policy
# forwards and 9 base forwards for the adjoint, then the policy and the reference at 4 trained steps in each of the
# preset's 2 epochs.
OBJECTIVE_ONLY = {"soar": 2 * (2 + 7), "sft": 2 * 1, "drl_adjoint": 2 * (10 + 9 + 2 * 2 * 4)}
# Objectives on rollouts (no loss term): NFEs of one iteration, the rollout's 2 x 2 x 10 plus the objective's passes
# per trained row. DiffusionNFT: 9 levels per sample, each evaluated by the policy, theta_old and the reference (KL);
# AWM: 6 levels, the policy, the reference and theta_ema; DPO: 9 draws per pair, its 2 rows by the policy and the
# reference. DGPO: 4 levels, the policy, the reference (the DPO reference and the KL) and v_old (the clip); CRD: 9
# levels, the policy, v_old and the reference (KL), not the sampling copy, which only the rollouts read
# (``PolicyCopy.evaluated``).
ROLLOUT_OBJECTIVES = {"diffusion_nft": 40 + 4 * 9 * 3, "awm": 40 + 4 * 6 * 3, "dpo": 40 + 2 * 9 * 2 * 2,
                      "dgpo": 40 + 4 * 4 * 3, "crd": 40 + 4 * 9 * 3}


def assert_rollout_objective_run(name, history):
    """2 iterations of an objective on rollouts: its NFEs, a real update, and the exact values at iteration 0, where
    the LoRA is still zero and every policy copy equals the trained weights."""
    assert len(history) == 2 and "first_ratio_max" not in history[0] and history[0]["reward_std"] > 0
    assert [h["nfe"] for h in history] == [ROLLOUT_OBJECTIVES[name]] * 2
    assert all(h["grad_norm"] > 0 and math.isfinite(h[f"objectives/{name}/loss"]) for h in history)
    first = {k.split("/")[-1]: v for k, v in history[0].items() if k.startswith(f"objectives/{name}/")}
    if name == "diffusion_nft":  # theta = theta_old (v+ = v- = v) and the reference: no deviation, no KL
        assert first["old_deviate"] == 0.0 and first["kl"] == 0.0 and first["r_mean"] == pytest.approx(0.5)
        assert first["positive_loss"] == first["negative_loss"]
        assert [h["copies/old/eta"] for h in history] == pytest.approx([0.001, 0.002])
    if name == "awm":  # the ratio is exactly 1; the policy is the reference and theta_ema
        assert first["ratio_mean"] == 1.0 and first["kl"] == 0.0 and first["ema_kl"] == 0.0
        assert [h["copies/kl_ema/eta"] for h in history] == pytest.approx([0.001, 0.002])
    if name == "dpo":  # at theta = ref the loss is log 2, whatever the pairs
        assert first["dpo_loss"] == pytest.approx(math.log(2)) and first["inside"] == 0.0
    if name == "dgpo":  # theta = ref = v_old: S_g = 0 (weights 1/2, DPO loss log 2), no clip, no KL
        assert first["dpo_loss"] == pytest.approx(math.log(2)) and first["weight_mean"] == 0.5
        assert first["dsm"] == first["dsm_ref"] and first["clip_frac"] == 0.0 and first["kl_loss"] == 0.0
        assert [h["copies/dgpo_old/eta"] for h in history] == pytest.approx([0.0, 0.001])
    if name == "crd":  # theta = v_old: no implicit reward, no deviation, no KL; the copies' schedules
        assert first["r_theta"] == 0.0 and first["old_deviate"] == 0.0 and first["kl"] == 0.0
        assert [h["copies/crd_old/eta"] for h in history] == pytest.approx([0.255, 0.26])
        assert [h["copies/crd_sampling/eta"] for h in history] == [0.0, 0.0]


def assert_kl_follows_the_lora(config, history):
    """With a KL on (loss.grpo.beta > 0) it is exactly 0 at iteration 0 when its one optimizer step comes after every
    loss (the LoRA is still zero, so policy and reference agree), and > 0 once the LoRA has moved (from iteration 0's
    second minibatch on, with several); with none it is 0."""
    one_step = config.optim.inner_epochs == config.optim.minibatches == 1
    if config.loss["grpo"].beta > 0:
        assert (history[0]["kl"] == 0.0) is one_step and all(h["kl"] > 0 for h in history[1:]), [
            h["kl"] for h in history]
    else:
        assert all(h["kl"] == 0.0 for h in history)


@pytest.mark.parametrize("preset", METHODS, ids=lambda p: p.stem)
def test_method_preset_runs_an_iteration(preset, tiny_paths, tmp_path):
    extra = dict(SMALL_RUN_SHAPE.get(preset.stem, {}))
    if preset.stem in ROLLOUT_OBJECTIVES:  # rollouts and rewards, no transition trained
        config = load_config(TrainConfig, preset, small_run(tiny_paths["sd3"], tmp_path, **extra))
        assert not config.loss and list(config.objectives) == [preset.stem]
        assert_rollout_objective_run(preset.stem, Trainer(config).train())
        return
    if preset.stem == "drl_adjoint":  # a discriminator made for the tiny model, its units of 1 trajectory
        from flowalign.reward_models.discriminator import untrained_discriminator

        checkpoint = untrained_discriminator(tiny_paths["sd3"], tmp_path / "d.safetensors", image_size=32, width=16)
        extra["objectives.adjoint_matching.reward_kwargs"] = "{path: " + str(checkpoint) + "}"
        extra["objectives.adjoint_matching.batch_size"] = 1
    if preset.stem in OBJECTIVE_ONLY:  # no rollout: 2 iterations of the objective alone
        config = load_config(TrainConfig, preset, small_run(tiny_paths["sd3"], tmp_path, **extra))
        history = Trainer(config).train()
        (name,) = config.objectives
        assert len(history) == 2 and not config.loss and "reward" not in history[0]
        assert [h["nfe"] for h in history] == [h["nfe/objectives"] for h in history] == [OBJECTIVE_ONLY[preset.stem]] * 2
        assert all(h[f"objectives/{name}/loss"] > 0 and h["grad_norm"] > 0 for h in history)
        return
    if preset.stem == "register_grpo":  # registers for the tiny transformer the run trains
        from diffusers import SD3Transformer2DModel
        from flowalign.reward_models.latent_registers import LatentRegisters

        transformer = SD3Transformer2DModel.from_pretrained(tiny_paths["sd3"] / "transformer")
        checkpoint = LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(tmp_path / "r.pt")
        extra["credit.registers"] = str(checkpoint)
        extra["loss.rg_opd.weight"] = 0.5  # and RG-OPD's regression onto RGS targets from the same registers
        extra["loss.rg_opd.registers"] = str(checkpoint)
    if preset.stem == "drl":  # a discriminator checkpoint made for the tiny model the run trains
        from flowalign.reward_models.discriminator import untrained_discriminator

        checkpoint = untrained_discriminator(tiny_paths["sd3"], tmp_path / "d.safetensors", image_size=32, width=16)
        extra["reward.rewards"] = "[{name: discriminator, kwargs: {path: " + str(checkpoint) + "}}]"
    if preset.stem.startswith("shell_lcc"):  # a manifold recorded as fitted for the tiny model's VAE
        from test_shell_lcc import tiny_manifold

        manifold = tiny_manifold(tiny_paths["sd3"], tmp_path / "manifold.safetensors")
        if preset.stem == "shell_lcc":  # the latent reward in GRPO, and as RG-OPD's gradient source
            extra["reward.rewards"] = f"[{{name: shell_lcc, kwargs: {{path: {manifold}, variant: band}}}}]"
            extra["loss.rg_opd.weight"] = 0.5
            extra["loss.rg_opd.reward"] = "shell_lcc"
            extra["loss.rg_opd.reward_kwargs"] = f"{{path: {manifold}}}"
        else:
            extra["objectives.shell_lcc.path"] = str(manifold)
            extra["objectives.shell_lcc.batch_size"] = 2
    config = load_config(TrainConfig, preset, small_run(tiny_paths["sd3"], tmp_path, **extra))
    history = Trainer(config).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    assert_kl_follows_the_lora(config, history)
    stochastic, nfe = EXPECTED[preset.stem]
    assert config.sampling.stochastic_steps() == stochastic
    assert history[0]["nfe"] == nfe
    if preset.stem in ("register_grpo", "shell_lcc"):
        assert history[0]["rg_opd"] > 0
    if preset.stem == "euphonium":  # guided steps 6, 7, 8; PRM of x_6 .. x_9 for a chunk of 2 samples
        assert history[0]["credit/guided_steps"] == 3 and history[0]["guidance/decodes"] == 4 * 2
        assert history[0]["guidance/shift_norm_mean"] > 0
    if preset.stem == "shell_lcc":
        assert history[0]["rewards/shell_lcc/mean"] <= 0 and history[0]["reward_std"] > 0
    if preset.stem == "shell_lcc_objective":
        assert history[0]["objectives/shell_lcc/distance"] > 0
    if preset.stem == "pref_grpo":  # a win rate in [0, 1] beside the pointwise reward, GDPO's advantages
        assert 0.0 <= history[0]["rewards/pairwise_preference/mean"] <= 1.0 and history[0]["reward_std"] > 0
    if preset.stem == "flow_dppo":  # D = 0 on the first micro-batch; the second minibatch sees the moved policy
        assert history[0]["first_clip_frac"] == 0.0 and history[0]["dppo/divergence_max"] > 0


def test_euphonium_with_the_guided_log_prob_keeps_the_first_ratio_at_one(tiny_paths, tmp_path):
    """With credit.log_prob_under=guided the rollout's log-prob and its recomputation both use the guided mean."""
    config = load_config(TrainConfig, REPO / "configs/methods/euphonium.yaml", small_run(
        tiny_paths["sd3"], tmp_path, **{"credit.process_reward": "brightness", "credit.log_prob_under": "guided",
                                        "credit.start_step": 1, "sampling.num_steps": 4, "train.iterations": 1}))
    history = Trainer(config).train()
    assert history[0]["first_ratio_max"] == 1.0 and history[0]["guidance/shift_norm_mean"] > 0
    assert history[0]["credit/guided_steps"] == 2 and history[0]["credit/pra_abs_mean"] > 0


def euphonium_with_registers(tiny_paths, tmp_path, **extra):
    """The Euphonium preset's small run with registers for the tiny transformer as its process reward."""
    from diffusers import SD3Transformer2DModel
    from flowalign.reward_models.latent_registers import LatentRegisters

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel.from_pretrained(tiny_paths["sd3"] / "transformer")
    checkpoint = LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(tmp_path / "r.pt")
    config = load_config(TrainConfig, REPO / "configs/methods/euphonium.yaml", small_run(
        tiny_paths["sd3"], tmp_path / "run", **{"credit.process_reward": "null", "credit.registers": str(checkpoint),
                                                **extra}))
    return config, checkpoint


def test_euphonium_with_registers_as_the_process_reward_trains_and_counts_its_passes(tiny_paths, tmp_path):
    """credit.registers: the PRM is the registers' score at the noisy states. On 4 steps guided from step 1, per
    sample, each of the guided states x_1, x_2 costs a forward and a backward of the reference transformer and x_3
    (credit: next) a forward: 5 NFEs on top of the rollout's 4, no decode."""
    config, _ = euphonium_with_registers(tiny_paths, tmp_path, **{"sampling.num_steps": 4, "credit.start_step": 1})
    history = Trainer(config).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    assert history[0]["nfe"] == 2 * 2 * (4 + 2 * 2 + 1)
    assert history[0]["guidance/nfe"] == 3 * 2 and history[0]["guidance/backward_nfe"] == 2 * 2  # a chunk of 2
    assert history[0]["guidance/decodes"] == 0 and history[0]["credit/guided_steps"] == 2
    assert history[0]["guidance/shift_norm_mean"] > 0 and history[0]["credit/pra_abs_mean"] > 0


def test_euphonium_register_shift_is_the_guidance_of_the_registers_own_gradient(tiny_paths, tmp_path):
    """At a guided state the shift is ``euphonium_guidance`` of ``d S / d x`` taken through ``LatentRegisters.guide``
    of a freshly loaded checkpoint, and the recorded PRM is that pass's score (heads summed)."""
    from flowalign.reward_models.latent_registers import load_registers
    from flowalign.rollout import RolloutContext, per_row_velocity
    from flowalign.samplers import euphonium_guidance

    config, checkpoint = euphonium_with_registers(tiny_paths, tmp_path)
    trainer = Trainer(config)
    model, sampling, cfg = trainer.model, config.sampling, config.credit
    prompts = trainer.prompts.prompts_for(0)[:2]
    cond = model.encode([p["prompt"] for p in prompts])
    sigmas = model.sigmas(sampling.num_steps, sampling.image_size)
    levels = torch.full((sampling.num_steps,), 0.25)
    levels[-1] = 0.0
    x = model.prepare_noise(2, sampling.image_size, generator=torch.Generator().manual_seed(3))
    step, sigma, sigma_next = 6, sigmas[6], sigmas[7]
    context = RolloutContext(model, config, 0, sigmas, levels, [], prompts)
    with torch.no_grad(), trainer.parts.credit.guidance.guide(context, prompts, cond) as (shift, finish):
        got = shift(x, model.velocity(x, sigma, cond, sampling.guidance_scale), sigma, sigma_next, step)
        record = finish(x)

    registers = load_registers(checkpoint, dict(model.transformer.config)).attach(model.transformer)
    guide = registers.guide(per_row_velocity(model, cond, sampling.guidance_scale))
    x_in = x.clone().requires_grad_(True)
    _, scores = guide(x_in, sigma, torch.arange(2))
    grad = torch.autograd.grad(scores.sum(), x_in)[0]
    registers.detach()
    expected = euphonium_guidance(grad, sigma, sigma_next, noise_level=0.25, scale=cfg.scale, normalize=cfg.normalize,
                                  scale_by_dt=cfg.scale_by_dt, norm=cfg.norm)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record["process"][:, step], scores.detach().sum(dim=1).double(), rtol=1e-5, atol=1e-6)
    assert record["nfe"] == 2 and record["backward_nfe"] == 2 and record["process"][:, :step].isnan().all()


SHELL_LCC_OBJECTIVE = {"name": "shell_lcc", "path": "outputs/manifolds/shell_lcc.safetensors", "variant": "distance",
                       "tau": None, "weight": 1.0, "batch_size": 4, "units_per_iteration": 1, "sigma_min": 0.7,
                       "sigma_max": 1.0, "drift_margin": None, "image_size": None}

# Every method preset against its base (flow_grpo against the defaults): exactly these keys differ, to these values.
# Keys a preset repeats at its base's value (e.g. branch_grpo's split_steps) are not differences.
GATED_KL = {"name": "gated_kl", "beta": 0.07, "main": None, "auxiliaries": ["toy_geneval", "jpeg_compressibility"],
            "orientation": "reference", "fraction": 0.1, "fraction_min": 0.02, "fraction_max": 0.2, "adapt": 0.1,
            "history": 20, "kl_std": "std_t"}
# What every preset built on flow_grpo.yaml sets back: one optimizer step over the whole local batch.
OWN_MINIBATCHES = {"optim.minibatches": 1, "optim.minibatch_split": "steps", "sampling.batch_size": None}


def on_flow_grpo(knobs: dict) -> tuple:
    """A preset built on flow_grpo.yaml with one optimizer step per iteration and its own ``knobs``."""
    return "flow_grpo", {**OWN_MINIBATCHES, **knobs}


PRESET_DIFFS = {
    "flow_grpo": (None, {"sampling.window_size": None, "sampling.window_start": "fixed", "sampling.window_last": None,
                         "sampling.batch_size": 16, "optim.minibatches": 2, "optim.minibatch_split": "samples"}),
    "flow_grpo_fast": on_flow_grpo({"sampling.window_size": 2, "sampling.window_start": "random",
                                     "sampling.window_last": 4}),
    "mix_grpo": on_flow_grpo({"sampling.window_size": 4, "sampling.window_start": "sliding"}),
    "dance_grpo": on_flow_grpo({"sampling.kind": "dance", "sampling.noise_level": 0.3, "sampling.shared_noise": True,
                                 "step_selection.name": "random_subset", "step_selection.count": 5}),
    "branch_grpo": on_flow_grpo({"rollout.name": "tree", "rollout.split_steps": [0, 2, 4, 6], "rollout.branching": [2],
                                  "rollout.split_noise_scale": 1.0, "credit.name": "tree", "credit.fusion": "mean",
                                  "credit.width_prune": "none", "credit.width_prune_fraction": 0.5,
                                  "credit.depth_prune_steps": [], "credit.depth_prune_sliding": False}),
    "tempflow_grpo": on_flow_grpo({"data.group_size": 8, "rollout.name": "probe", "rollout.probe_steps": [0, 2, 4, 6],
                                    "step_weighting.name": "noise_aware"}),
    "dense_grpo": on_flow_grpo({"credit.name": "dense", "credit.clean": "ode", "credit.ode_steps": None}),
    "tp_grpo": on_flow_grpo({"sampling.kind": "cps", "credit.name": "turning_point", "credit.clean": "ode",
                              "credit.ode_steps": None, "credit.process_rewards": "released_code",
                              "credit.balanced": False,
                              **{f"credit.{k}": v for k, v in RELEASED_OPTIONS.items()}}),
    "tp_grpo_paper": ("tp_grpo", {"credit.process_rewards": "paper", "credit.balanced": True}),
    "register_grpo": on_flow_grpo({"credit.name": "registers", "credit.register_pass": "policy",
                                    "credit.registers": "outputs/registers/registers.pt"}),
    "vgpo": on_flow_grpo({"credit.name": "vgpo", "credit.gamma": 0.9, "credit.k": 0.5, "credit.alpha_steps": 5,
                           "credit.eps": 1e-4, "credit.std_unbiased": False, "credit.variant": "reconstruction",
                           "credit.x0_pass": "rollout"}),
    "euphonium": on_flow_grpo({"sampling.kind": "dance", "sampling.noise_level": 0.25, "sampling.shared_noise": True,
                                "credit.name": "euphonium", "credit.process_reward": "toy_geneval_soft",
                                "credit.reward_kwargs": {}, "credit.scale": 3.0, "credit.kl_beta": None,
                                "credit.normalize": True, "credit.norm": "sample", "credit.scale_by_dt": True,
                                "credit.start_step": 6, "credit.interval": 1, "credit.log_prob_under": "unguided",
                                "credit.credit": "next", "credit.mode": "both", "credit.outcome_weight": 1.0,
                                "credit.process_weight": 1.0, "credit.eps": 1e-4, "credit.std_unbiased": True,
                                "credit.clip": 5.0, "credit.registers": None}),
    "drl": on_flow_grpo({"sampling.noise_level": 2 ** 0.5, "loss.grpo.beta": 0.04,
                          "loss.grpo.kl_std": "transition",
                          "reward.rewards": [{"name": "discriminator", "weight": 1.0,
                                              "kwargs": {"path": "outputs/discriminator/discriminator.safetensors"}}]}),
    "shell_lcc": on_flow_grpo({"reward.rewards": [{"name": "shell_lcc", "weight": 1.0, "kwargs": {
        "path": "outputs/manifolds/shell_lcc.safetensors", "variant": "band", "tau": None}}]}),
    "shell_lcc_objective": on_flow_grpo({"objectives": {"shell_lcc": SHELL_LCC_OBJECTIVE},
                                          **{f"objectives.shell_lcc.{k}": v for k, v in SHELL_LCC_OBJECTIVE.items()}}),
    "grpo_guard": on_flow_grpo({"loss.grpo.clip_range": 2e-6, "loss.grpo.ratio_norm": True,
                                 "loss.grpo.step_reweight": "inverse_dt"}),
    # UniRL's recipe keeps flow_grpo.yaml's two optimizer steps per rollout (num_updates_per_batch: 2)
    "flow_dppo": ("flow_grpo", {"loss.grpo.trust_region": "dppo", "advantage.std": "global",
                                "advantage.clip": math.inf, "sampling.window_size": 5,
                                "step_selection.name": "random_subset", "step_selection.count": 3}),
    "gardo": on_flow_grpo({
        "reward.rewards": [{"name": "toy_geneval_soft", "weight": 1.0, "kwargs": {}},
                           {"name": "toy_geneval", "weight": 0.0, "kwargs": {"partial_credit": True}},
                           {"name": "jpeg_compressibility", "weight": 0.0, "kwargs": {}}],
        "credit.name": "diversity", "credit.embedding": "auto", "credit.embedding_kwargs": {}, "credit.std": "none",
        **{f"loss.gated_kl.{k}": v for k, v in GATED_KL.items()},
        "reference.name": "adaptive", "reference.reset_every": 16, "reference.kl_threshold": 3e-4,
        "reference.kl_metric": "gated_kl"}),
    "pref_grpo": on_flow_grpo({
        "data.prompts_per_iteration": 8, "data.group_size": 8,
        "reward.rewards": [{"name": "pairwise_preference", "weight": 0.4,
                            "kwargs": {"judge": "score", "judge_kwargs": {"reward": "toy_geneval_soft"}}},
                           {"name": "toy_geneval", "weight": 0.6, "kwargs": {"partial_credit": True}}],
        "reward.combine": "gdpo", "reward.gdpo_variant": "pref_grpo", "sampling.shared_noise": True,
        "loss.grpo.ratio_norm": True}),
}


def test_soar_and_sft_presets_train_on_the_same_data_at_the_same_steps():
    soar, sft = (load_config(TrainConfig, REPO / f"configs/methods/{n}.yaml", []) for n in ("soar", "sft"))
    assert not soar.loss and not sft.loss and list(soar.objectives) == ["soar"] and list(sft.objectives) == [
        "flow_matching"]
    a, b = soar.objectives["soar"], sft.objectives["flow_matching"]
    assert (a.data, a.batch_size, a.units_per_iteration, a.logit_mean, a.logit_std, a.table_shift) == \
        (b.data, b.batch_size, b.units_per_iteration, b.logit_mean, b.logit_std, b.shift) == ("toy", 4, 4, 0.0, 1.0, 1.0)
    assert to_dict(soar.optim) == to_dict(sft.optim) and to_dict(soar.train) == to_dict(sft.train)
    assert (a.guidance_scale, a.points, a.rollout_paths, a.lambda_aux, a.aux_timestep) == (3.0, 6, 1, 1.0, "released")


# The forward-process presets against flow_grpo: the loss term off, their objective on with these settings (the
# released defaults but where the page says: the toy model's unshifted table, units of 4 samples).
FORWARD_PRESETS = {
    "diffusion_nft": ({**OWN_MINIBATCHES, "sampling.noise_level": 0.0, "advantage.std": "global"},
                      {"beta": 1.0, "kl_beta": 1e-4, "adv_clip_max": 5.0, "adv_mode": "all", "optimality": "advantage",
                       "timestep_fraction": 0.99, "timesteps": "grid", "adaptive_weighting": True, "batch_size": None,
                       "sample_with_old": True, "old_decay_rate": 0.001, "old_decay_max": 0.5, "old_decay_delay": 0}),
    "awm": ({**OWN_MINIBATCHES, "sampling.noise_level": 0.0, "advantage.std": "global"},
            {"train_sigmas": 6, "timestep_fraction": 0.9, "weighting": "ghuber", "ghuber_power": 0.25,
             "clip_range": 1.0, "adv_clip_max": 5.0, "advantage_max": 1.0, "kl_beta": 1e-3, "kl_weighting": "uniform",
             "ema_kl_beta": 1.0, "ema_kl_weighting": "uniform", "ema_kl_decay": "linear", "ema_kl_decay_max": 0.3,
             "batch_size": 4}),
    "dgpo": ({**OWN_MINIBATCHES, "sampling.noise_level": 0.0, "advantage.std": "global"},
             {"beta_dpo": 100.0, "kl_beta": 0.02, "kl_cfg": 1.0, "clip_range": 1e-2, "clip_dsm": True, "clip_kl": False,
              "use_ema_ref": False, "switch_ema_ref": 200, "noise": "per_timestep", "num_train_timesteps": 4,
              "trunc_steps": 6, "adv_clip_max": 5.0, "old_decay_rate": 0.001, "old_decay_max": 0.3,
              "groups_per_unit": 1}),
    "crd": ({"optim.minibatches": 1, "optim.minibatch_split": "steps", "sampling.noise_level": 0.0,
             "advantage.std": "global"},
            {"crd_beta": 1.0, "loss_type": "mse", "use_old_for_loss": True, "adaptive_logp": True, "weight_temp": -1.0,
             "centering": "batch", "old_model_decay": "0-0.25-0.005-0.999", "sampling_model_decay": "75-0.0-0.0075-0.999",
             "sample_with_copy": True, "adv_clip_max": 5.0, "kl_beta": 0.1, "kl_cfg": 1.0, "reward_adaptive_kl": True,
             "timestep_fraction": 0.99, "timestep_range": 0.99, "batch_size": None}),
    "dpo": (OWN_MINIBATCHES, {"beta": 100.0, "pairs": "best_worst", "ties": "skip", "timestep_fraction": 0.99, "logit_mean": 0.0,
                 "logit_std": 1.0, "table_shift": 1.0, "ref_update_steps": None, "sample_with_reference": True,
                 "groups_per_unit": 1}),
}


@pytest.mark.parametrize("name", sorted(FORWARD_PRESETS))
def test_forward_process_presets_differ_from_flow_grpo_in_exactly_their_knobs(name):
    preset = REPO / f"configs/methods/{name}.yaml"
    assert yaml.safe_load(preset.read_text()).get("base") == "flow_grpo.yaml"
    config = to_dict(load_config(TrainConfig, preset, []))
    reference = to_dict(load_config(TrainConfig, REPO / "configs/methods/flow_grpo.yaml", []))
    sections, settings = FORWARD_PRESETS[name]
    assert config["loss"] == {} and config["objectives"] == {name: {"name": name, "weight": 1.0, **settings}}
    for key, value in sections.items():
        section, field = key.split(".")
        assert config[section][field] == value and reference[section][field] != value
    rest = {k: v for k, v in config.items() if k not in ("loss", "objectives")}
    differing = {line.split(":")[0] for line in diff_configs({k: reference[k] for k in rest}, rest)}
    assert differing == set(sections)


@pytest.mark.parametrize("preset", [p for p in METHODS if p.stem not in OBJECTIVE_ONLY and p.stem not in
                                    ROLLOUT_OBJECTIVES], ids=lambda p: p.stem)
def test_method_presets_differ_from_their_base_in_exactly_their_knobs(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # loading reads no file a preset names (register_grpo's registers are absent here)
    base, expected = PRESET_DIFFS[preset.stem]
    assert yaml.safe_load(preset.read_text()).get("base") == (None if base is None else f"{base}.yaml")
    config = to_dict(load_config(TrainConfig, preset, []))
    reference = to_dict(TrainConfig() if base is None else load_config(TrainConfig, preset.parent / f"{base}.yaml", []))
    differing = {line.split(":")[0] for line in diff_configs(reference, config)}
    assert differing == set(expected)
    for key, value in expected.items():
        node = config
        for part in key.split("."):
            node = node[part]
        if key == "reward.rewards":  # a spec written without frames reads back with frames: null
            value = [{"frames": None, **spec} for spec in value]
        assert node == value, key


def test_sd35_medium_preset_has_the_published_defaults_and_runs_on_a_tiny_sd3(tiny_paths, tmp_path):
    preset = load_config(TrainConfig, REPO / "configs/models/sd35_medium.yaml", [])
    assert (preset.sampling.num_steps, preset.sampling.noise_level, preset.model.lora_rank, preset.model.lora_alpha,
            preset.optim.lr, preset.data.group_size, preset.loss["grpo"].beta, preset.sampling.image_size) == \
        (10, 0.7, 32, 64, 3e-4, 24, 0.04, 512)
    assert (preset.loss["grpo"].kl_std, preset.optim.minibatches, preset.optim.minibatch_split) == ("std_t", 2, "samples")
    config = load_config(TrainConfig, REPO / "configs/models/sd35_medium.yaml", small_run(
        tiny_paths["sd3"], tmp_path, **{"sampling.guidance_scale": 4.5}))
    history = Trainer(config).train()
    assert history[-1]["nfe"] == 2 * 2 * 10 * 2  # CFG doubles the evaluations
    assert config.loss["grpo"].beta == 0.04
    assert_kl_follows_the_lora(config, history)


def test_flux_dev_preset_has_the_published_defaults_and_runs_on_a_tiny_flux(tiny_paths, tmp_path):
    preset = load_config(TrainConfig, REPO / "configs/models/flux_dev.yaml", [])
    assert (preset.sampling.num_steps, preset.sampling.noise_level, preset.loss["grpo"].beta, preset.model.family) == \
        (6, 0.9, 0.0, "flux")
    config = load_config(TrainConfig, REPO / "configs/models/flux_dev.yaml", small_run(
        tiny_paths["flux"], tmp_path, **{"model.gradient_checkpointing": "false"}))
    history = Trainer(config).train()
    assert history[-1]["nfe"] == 2 * 2 * 6  # the guidance embedding needs no second pass
    assert config.loss["grpo"].beta == 0.0
    assert_kl_follows_the_lora(config, history)


def test_flux2_dev_preset_has_flow_factorys_settings_and_runs_on_a_tiny_flux2(tmp_path):
    from model_families import tiny_pipeline

    preset = load_config(TrainConfig, REPO / "configs/models/flux2_dev.yaml", [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.noise_level, preset.sampling.window_size,
            preset.sampling.window_first, preset.sampling.window_last, preset.sampling.guidance_scale,
            preset.model.lora_rank, preset.model.lora_alpha, preset.optim.lr, preset.data.group_size,
            preset.loss["grpo"].beta, preset.sampling.image_size) == \
        ("flux2", 8, 1.0, 1, 1, 3, 4.0, 64, 128, 3e-4, 16, 0.0, 512)
    assert [(r.name, r.weight) for r in preset.reward.rewards] == [("clipscore", 1.0), ("pickscore", 0.5)]
    tiny_pipeline("flux2").save_pretrained(tmp_path / "flux2")
    config = load_config(TrainConfig, REPO / "configs/models/flux2_dev.yaml", small_run(tmp_path / "flux2", tmp_path))
    history = Trainer(config).train()
    assert history[-1]["nfe"] == 2 * 2 * 8  # the guidance embedding needs no second pass
    assert history[0]["first_ratio_max"] == 1.0
    assert_kl_follows_the_lora(config, history)


def test_flux_kontext_preset_has_flow_grpos_settings_and_trains_on_editing_prompts_on_a_tiny_kontext(tmp_path):
    from model_families import tiny_pipeline
    from test_editing import editing_prompts

    preset = load_config(TrainConfig, REPO / "configs/models/flux_kontext.yaml", [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.noise_level, preset.sampling.window_size,
            preset.sampling.guidance_scale, preset.model.lora_rank, preset.model.lora_alpha, preset.optim.lr,
            preset.optim.weight_decay, preset.data.group_size, preset.sampling.batch_size, preset.loss["grpo"].beta,
            preset.loss["grpo"].clip_range, preset.advantage.std, preset.advantage.clip, preset.sampling.image_size,
            preset.model.max_sequence_length, preset.optim.ema_decay) == \
        ("flux_kontext", 6, 0.9, None, 2.5, 64, 128, 3e-4, 1e-4, 21, 3, 0.0, 1e-4, "global", 5.0, 512, 128, 0.987)
    assert "proj_mlp" in preset.model.lora_targets and "ff_context.net.2" in preset.model.lora_targets
    tiny_pipeline("flux_kontext").save_pretrained(tmp_path / "kontext")
    config = load_config(TrainConfig, REPO / "configs/models/flux_kontext.yaml",
                         small_run(tmp_path / "kontext", tmp_path, **{"data.train_prompts": editing_prompts(tmp_path)}))
    history = Trainer(config).train()
    assert history[-1]["nfe"] == 2 * 2 * 6  # the guidance embedding needs no second pass
    assert history[0]["first_ratio_max"] == 1.0
    assert_kl_follows_the_lora(config, history)


def test_qwen_image_edit_plus_preset_has_flow_grpos_edit_settings_and_trains_on_editing_prompts(tmp_path):
    from model_families import edit_plus_areas, tiny_pipeline
    from test_editing import editing_prompts

    path = REPO / "configs/models/qwen_image_edit_plus.yaml"
    preset = load_config(TrainConfig, path, [])
    assert (preset.model.family, preset.sampling.num_steps, preset.sampling.noise_level, preset.sampling.window_size,
            preset.sampling.guidance_scale, preset.model.lora_rank, preset.model.lora_alpha, preset.optim.lr,
            preset.data.group_size, preset.sampling.batch_size, preset.loss["grpo"].beta, preset.advantage.std,
            preset.sampling.image_size, preset.optim.ema_decay, preset.model.gradient_checkpointing) == \
        ("qwen_image_edit_plus", 10, 1.0, None, 4.0, 64, 128, 3e-4, 16, 4, 0.0, "global", 512, 0.0, True)
    assert preset.sampling.stochastic_steps() == 9  # every step but the last: no SDE window
    tiny_pipeline("qwen_image_edit_plus").save_pretrained(tmp_path / "edit")
    config = load_config(TrainConfig, path, small_run(tmp_path / "edit", tmp_path,
                                                      **{"data.train_prompts": editing_prompts(tmp_path),
                                                         "model.gradient_checkpointing": "false"}))
    with edit_plus_areas():  # the tiny model's condition-image areas
        history = Trainer(config).train()
    assert history[-1]["nfe"] == 2 * 2 * 10 * 2  # true CFG: two passes a step
    assert history[0]["first_ratio_max"] == 1.0


def test_register_pass_policy_reads_the_rollout_and_matches_the_reference_pass_at_zero_lora(tiny_paths, tmp_path):
    """credit.register_pass = policy reads the registers off the rollout's own forwards: with the LoRA still
    zero (iteration 0) it gives the reference pass's step rewards, for 1 NFE per sample instead of T + 1."""
    from diffusers import SD3Transformer2DModel
    from flowalign.reward_models.latent_registers import LatentRegisters

    transformer = SD3Transformer2DModel.from_pretrained(tiny_paths["sd3"] / "transformer")
    checkpoint = LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(tmp_path / "r.pt")
    rewards, nfes = {}, {}
    for register_pass in ("reference", "policy"):
        config = load_config(TrainConfig, REPO / "configs/methods/register_grpo.yaml", small_run(
            tiny_paths["sd3"], tmp_path / register_pass, **{"credit.registers": str(checkpoint),
                                                            "credit.register_pass": register_pass,
                                                            "sampling.batch_size": 4}))
        trainer = Trainer(config)
        (chunk,) = trainer.rollout(0, trainer.prompts.prompts_for(0))
        assert ("register_scores" not in chunk.extras) == (register_pass == "reference")
        rewards[register_pass], nfes[register_pass] = trainer.parts.credit.register_rewards(
            chunk, trainer.credit_context(0, []))
    batch = 2 * 2
    assert nfes == {"reference": batch * 11, "policy": batch}
    assert rewards["policy"].shape == (batch, 11)
    assert torch.allclose(rewards["policy"], rewards["reference"], atol=1e-6, rtol=0)
    assert rewards["policy"].std() > 0


def test_a_cfg_reference_for_dgpo_and_crd(tiny_paths, tmp_path):
    """kl_cfg > 1: the base model's guided velocity is the reference (DGPO's DPO reference and KL, CRD's KL), made with
    the units. At iteration 0 the LoRA is zero, so the policy is the unguided base: dsm != dsm_ref, both KLs > 0.
    Both objectives on one iteration (the rollout samples with CRD's copy; DGPO's switch is off)."""
    extra = {"train.iterations": 1, "sampling.guidance_scale": 3.0, "objectives.dgpo.kl_cfg": 3.0,
             "objectives.dgpo.switch_ema_ref": "null", "objectives.dgpo.num_train_timesteps": 2,
             "objectives.crd.kl_cfg": 3.0, "objectives.crd.timestep_fraction": 0.2}
    config = load_config(TrainConfig, REPO / "configs/methods/dgpo.yaml", small_run(tiny_paths["sd3"], tmp_path, **extra))
    (first,) = Trainer(config).train()
    assert first["objectives/dgpo/dsm"] != first["objectives/dgpo/dsm_ref"]
    assert first["objectives/dgpo/kl_loss"] > 0 and first["objectives/crd/kl"] > 0
    assert first["objectives/crd/r_theta"] == 0.0  # v_old is the policy at iteration 0


def _run_state(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    files = ("trainable", "ema", "copies")
    return {name: load_file(str(checkpoint / f"{name}.safetensors")) for name in files
            if (checkpoint / f"{name}.safetensors").is_file()}


# Flow-DPPO with rollout correction's bypass rejection on: no copies, its mask and the rejection read only the batch.
# The small run moves the policy little (D about 1e-9, log-ratios about 1e-6), so both thresholds are tight enough to act.
DPPO_RESUME = {"loss.grpo.kl_mask_threshold": 1e-10, "loss.grpo.rollout_is": "sequence",
               "loss.grpo.rollout_rs": "token_k1,seq_max_k2",
               "loss.grpo.rollout_rs_threshold": "'0.999999_1.000001,5e-13'"}


@pytest.mark.parametrize("name, extra", [("diffusion_nft", {}), ("awm", {}), ("dpo", {}),
                                         ("dpo", {"objectives.dpo.ref_update_steps": 1}),
                                         ("pref_grpo", SMALL_RUN_SHAPE["pref_grpo"]), ("flow_dppo", DPPO_RESUME),
                                         ("dgpo", {"objectives.dgpo.switch_ema_ref": 0, "optim.minibatches": 2}),
                                         ("crd", {})],
                         ids=["diffusion_nft", "awm", "dpo", "online_dpo", "pref_grpo", "flow_dppo", "dgpo_switched",
                              "crd"])
def test_forward_process_presets_resume_bitwise(name, extra, tiny_paths, tmp_path):
    """A run resumed after iteration 1 of 2 writes the weights, EMA, policy copies and metrics of an uninterrupted
    one: the copies, the optimizer-step count their schedules read and the sampling policy all come back (and
    Flow-DPPO's run, which keeps no copy, likewise)."""
    import json

    preset = REPO / f"configs/methods/{name}.yaml"
    settings = {"train.checkpoint_every": 1, "train.keep_checkpoints": 3, **extra}
    runs = {}
    for run, iterations in (("full", 2), ("split", 1), ("split", 2)):
        resume = {"train.resume": "latest"} if (run, iterations) == ("split", 2) else {}
        config = load_config(TrainConfig, preset, small_run(tiny_paths["sd3"], tmp_path / run, **settings, **resume,
                                                            **{"train.iterations": iterations}))
        Trainer(config).train()
        runs[run] = tmp_path / run
    a, b = (_run_state(runs[r] / "checkpoint-000002") for r in ("full", "split"))
    assert set(a) == set(b) and ("copies" in a) == (name in ("diffusion_nft", "awm", "dgpo", "crd") or name == "dpo" and bool(extra))
    for part in a:
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    lines = [[{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
              for line in (runs[r] / "metrics.jsonl").read_text().splitlines()] for r in ("full", "split")]
    assert lines[0] == lines[1] and len(lines[0]) == 2
    if name == "flow_dppo":  # the mask and the rejection acted on the run that resumed
        assert any(line["clip_frac"] > 0 for line in lines[0]) and any(
            line["rollout_corr/rs_rejected"] > 0 for line in lines[0])
        assert all(0.99 < line["rollout_corr/is_mean"] < 1.01 for line in lines[0])  # bypass: IS weights logged only
    state = json.loads((runs["split"] / "checkpoint-000002" / "state.json").read_text())
    assert state["optimizer_steps"] == 2 * config.optim.minibatches
    if name == "dgpo":  # iteration 1 rolled out with the copy, which after 2 steps is no longer the weights
        assert [line["dgpo/sampled_with_old"] for line in lines[1]] == [0.0, 1.0]
