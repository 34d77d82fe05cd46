"""The Wan variants beyond the adapter contract (tests/test_video_families.py runs that on every row):

* each Wan config is claimed by its own family (Wan2.1 T2V / I2V, Wan2.2 A14B T2V / I2V, TI2V-5B T2V / I2V);
* Wan2.2 A14B: the rollout switches expert at the boundary as the pipeline does (with ``guidance_scale_2``), rows on
  either side of it run their own expert, a LoRA trains on either or both experts (``model.lora_experts``) and
  round-trips through diffusers' loader, training recomputes every transition's log-prob with the expert that
  produced it (the first ratio is exactly 1), full fine-tuning and export cover both experts, FSDP2 on two processes
  equals one;
* TI2V-5B I2V: the first latent frame is the condition, its velocity does not depend on the policy;
* bad input refused before any model loads: an expert that does not exist, an I2V run without condition images.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import ConfigError, load_config
from flowalign.errors import SetupError
from flowalign.models import (Wan22I2VModel, Wan22Model, WanI2VModel, WanModel, WanTI2VImageModel, WanTI2VModel,
                              load_flow_model, wrap_pipeline)
from flowalign.models.wan22 import LORA_WEIGHT_NAMES
from flowalign.samplers import rollout
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import small_run_values
from test_fsdp2 import launch, relative_difference, train_here
from video_families import (VIDEO_FAMILIES, wan_first_frame_image, fresh_video_pipeline, load_expert_lora_folder,
                            tiny_video_pipeline)

PROMPTS = ["a red circle moving to the left", "two blue squares moving up"]
HIGH_SIGMA, LOW_SIGMA = 0.95, 0.5  # t = 950 and 500 against the tiny Wan2.2's boundary 875
# 4 steps at shift 3 run t = 1000 (high), 857 and 600 (low) and 3: every step but the last trains
CROSSING_RUN = {"sampling.image_size": 16, "sampling.num_frames": 5, "sampling.num_steps": 4,
                "sampling.window_size": 3, "sampling.window_start": "fixed",
                "sampling.window_last": "null", "collapse.enabled": "false",
                "reward.rewards": "[{name: brightness, frames: {aggregate: mean}}]"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    paths = {}

    def path(name):
        if name not in paths:
            tiny_video_pipeline(name).save_pretrained(root / name)
            paths[name] = root / name
        return paths[name]

    return path


def wrap(name, pipe=None, **options):
    return wrap_pipeline(pipe if pipe is not None else tiny_video_pipeline(name), num_frames=5, **options)


def expert_calls(pipe) -> list[str]:
    """A list that records, in order, which expert each transformer forward runs (hooks on the pipeline's own)."""
    calls = []
    for name, module in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        module.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("name,adapter", [("wan", WanModel), ("wan_i2v", WanI2VModel), ("wan22", Wan22Model),
                                          ("wan22_i2v", Wan22I2VModel), ("wan22_ti2v", WanTI2VModel),
                                          ("wan22_ti2v_i2v", WanTI2VImageModel)])
def test_each_wan_config_is_claimed_by_its_own_family(name, adapter, saved):
    assert type(wrap(name)) is adapter
    assert type(load_flow_model(saved(name), adapter_options={"num_frames": 5})) is adapter
    others = {WanModel, Wan22Model, WanTI2VModel} if adapter.pipeline_class_name == "WanPipeline" else {
        WanI2VModel, Wan22I2VModel, WanTI2VImageModel}
    index = json.loads((saved(name) / "model_index.json").read_text())
    assert [other for other in others if other.claims(index) > 0] == [adapter]


def test_the_rollout_switches_expert_where_the_pipeline_does_with_guidance_scale_2():
    """3 steps at shift 3 (t = 1000, 750, 3) against the boundary 875: the high expert on the first, the low one on
    the others, CFG at 3 then at guidance_scale_2 = 1.5; latents bitwise the pipeline's."""
    pipe = fresh_video_pipeline("wan22")
    model = wrap("wan22", pipe, guidance_scale_2=1.5)
    calls = expert_calls(pipe)
    expected = pipe(prompt=PROMPTS, num_inference_steps=3, output_type="latent", height=16, width=32, num_frames=5,
                    guidance_scale=3.0, guidance_scale_2=1.5, max_sequence_length=model.max_sequence_length,
                    generator=torch.Generator().manual_seed(0)).frames
    pipeline_calls = list(calls)
    calls.clear()
    cond = model.encode(PROMPTS, negative_prompts=[""] * 2)
    x = model.prepare_noise(2, (16, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(model.velocity_fn(cond, 3.0), x, model.sigmas(3, (16, 32)), torch.zeros(3)).final
    assert pipeline_calls == ["high"] * 2 + ["low"] * 4 and calls == pipeline_calls
    assert torch.equal(ours, expected)
    with torch.no_grad():  # guidance_scale_2 changes the low expert's steps only
        same_scale = rollout(wrap("wan22", pipe).velocity_fn(cond, 3.0), x, model.sigmas(3, (16, 32)),
                             torch.zeros(3)).final
    assert not torch.equal(same_scale, ours)


def test_rows_on_either_side_of_the_boundary_run_their_own_expert():
    model = wrap("wan22")
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, (16, 16), generator=torch.Generator().manual_seed(0))
    calls = expert_calls(model.pipe)
    with torch.no_grad():
        mixed = model.velocity(x, torch.tensor([HIGH_SIGMA, LOW_SIGMA]), cond)
        assert calls == ["high", "low"]
        alone = [model.velocity(x[i:i + 1], sigma, cond.index([i])) for i, sigma in enumerate((HIGH_SIGMA, LOW_SIGMA))]
        timestep = model.timestep(torch.tensor([HIGH_SIGMA, LOW_SIGMA]), 2)
        routed = model.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond.embeds,
                                   return_dict=False)[0]  # the pair's own dispatch, as a reference copy runs it
    assert torch.equal(mixed, torch.cat(alone)) and torch.equal(routed, mixed)


def perturb(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("experts", [["high"], ["low"], ["high", "low"]])
def test_a_lora_on_either_or_both_experts_round_trips_through_diffusers(experts, tmp_path):
    model = wrap("wan22", fresh_video_pipeline("wan22"), lora_experts=experts)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, (16, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = {s: model.velocity(x, s, cond) for s in (HIGH_SIGMA, LOW_SIGMA)}
        model.add_lora(rank=4, alpha=8)
        perturb(model)
        adapted = {s: model.velocity(x, s, cond) for s in (HIGH_SIGMA, LOW_SIGMA)}
        with model.reference():
            assert all(torch.equal(model.velocity(x, s, cond), base[s]) for s in base)
    lora_experts = {n.split(".")[0] for n, _ in model.transformer.named_parameters() if "lora_" in n}
    assert lora_experts == set(experts)
    for sigma, expert in ((HIGH_SIGMA, "high"), (LOW_SIGMA, "low")):
        assert torch.equal(adapted[sigma], base[sigma]) == (expert not in experts)
    folder = model.save_lora(tmp_path / "lora")
    assert sorted(p.name for p in folder.glob("*.safetensors")) == sorted(LORA_WEIGHT_NAMES[e] for e in experts)
    fresh = fresh_video_pipeline("wan22")
    load_expert_lora_folder(fresh, folder)  # diffusers' load_lora_weights (load_into_transformer_2 for low)
    loaded = [wrap("wan22", fresh)]
    if "high" in experts:  # flowalign's own loader of LoRA folders (sample --lora): each file into its expert
        from flowalign.lora_loading import apply_lora, resolve_lora

        loaded.append(wrap("wan22", fresh_video_pipeline("wan22")))
        apply_lora(loaded[-1], resolve_lora(folder))
    with torch.no_grad():
        for other in loaded:
            for sigma in (HIGH_SIGMA, LOW_SIGMA):
                torch.testing.assert_close(other.velocity(x, sigma, cond), adapted[sigma], rtol=1e-5, atol=1e-6)


def run_config(model_path, out, **extra):
    values = {**small_run_values(model_path, out), **CROSSING_RUN, "train.checkpoint_every": 2, **extra}
    return load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])


@pytest.mark.parametrize("finetune,experts", [("lora", None), ("lora", "[high]"), ("lora", "[low]"), ("full", None)])
def test_training_recomputes_each_transition_with_its_expert_and_trains_the_named_experts(finetune, experts, saved,
                                                                                          tmp_path):
    """2 iterations, steps on both sides of the boundary trained: the first ratio is exactly 1 (every recomputed
    log-prob equals the rollout's, each from the expert that produced it); the trained experts, and only they,
    moved. The LoRA of both experts exports merged into both and as a folder."""
    extra = {"model.finetune": finetune, **({} if experts is None else {"model.lora_experts": experts}),
             "model.gradient_checkpointing": str(finetune == "full").lower()}  # through both experts
    history = Trainer(run_config(saved("wan22"), tmp_path / "run", **extra)).train()
    assert len(history) == 2 and all(h["first_ratio_max"] == 1.0 for h in history)
    checkpoint = tmp_path / "run" / "checkpoint-000002"
    trained = {"high", "low"} if experts is None else {experts.strip("[]")}
    if finetune == "full":
        from diffusers import WanTransformer3DModel

        for expert, component in (("high", "transformer"), ("low", "transformer_2")):
            after = WanTransformer3DModel.from_pretrained(checkpoint / component).state_dict()
            before = WanTransformer3DModel.from_pretrained(saved("wan22") / component).state_dict()
            assert any(not torch.equal(after[k], before[k]) for k in before), expert
        return
    weights = load_file(str(checkpoint / "trainable.safetensors"))
    moved = {name.split(".")[0] for name, value in weights.items() if "lora_B" in name and value.abs().sum() > 0}
    assert {name.split(".")[0] for name in weights} == moved == trained
    if experts is not None:
        return
    from flowalign.export import export_lora
    from flowalign.lora_loading import apply_lora, resolve_lora

    model = load_flow_model(saved("wan22"), adapter_options={"num_frames": 5})
    apply_lora(model, resolve_lora(checkpoint, "last"))
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, (16, 16), generator=torch.Generator().manual_seed(0))
    merged = export_lora(checkpoint, tmp_path / "merged", weights="last", merge=True)
    folder = export_lora(checkpoint, tmp_path / "lora", weights="last")
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(saved("wan22"))
    load_expert_lora_folder(plain, folder)
    for pipe in (WanPipeline.from_pretrained(merged), plain):
        other = wrap("wan22", pipe)
        with torch.no_grad():
            for sigma in (HIGH_SIGMA, LOW_SIGMA):
                torch.testing.assert_close(other.velocity(x, sigma, cond), model.velocity(x, sigma, cond),
                                           rtol=1e-5, atol=1e-6)


# FSDP2 on both experts (LoRA and full fine-tuning, each expert's weights sharded over 2 processes and trained as on
# one) is pinned with every other video family in one launch:
# tests/test_video_distributed.py::test_two_fsdp2_processes_train_every_video_family_as_one_process.


@pytest.mark.slow
def test_two_processes_match_one_under_ddp_with_a_lora_on_both_experts(saved, tmp_path):
    """DDP needs a gradient for every trainable parameter in every backward: a step through one expert gives the
    other's a zero one (ExpertPair.touch_other), so 2 processes train as one."""
    extra = {**CROSSING_RUN, "optim.minibatches": 1, "distributed.engine": "ddp"}
    train_here(saved("wan22"), tmp_path / "one", **extra)
    launch(saved("wan22"), tmp_path / "two", **extra)
    for file in LORA_WEIGHT_NAMES.values():
        one, two = (load_file(str(tmp_path / n / "checkpoint-000002" / "lora" / file)) for n in ("one", "two"))
        assert relative_difference(two, one) < 1e-3


def test_an_expert_that_does_not_exist_is_refused_before_the_model_loads(saved, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"model.lora_experts names \['hihg'\].*'high'.*'low'"):
        run_config(saved("wan22"), tmp_path / "a", **{"model.lora_experts": "[hihg]"})
    with pytest.raises(ConfigError, match="model.lora_experts.*finetune = 'full'"):
        run_config(saved("wan22"), tmp_path / "b", **{"model.lora_experts": "[high]", "model.finetune": "full"})
    import flowalign.training.builder as builder

    monkeypatch.setattr(builder, "load_flow_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SetupError, match=r"model.lora_experts = \['low'\].*'wan'.*one transformer: drop"):
        Trainer(run_config(saved("wan"), tmp_path / "c", **{"model.lora_experts": "[low]"}))


def test_an_image_to_video_family_without_condition_images_is_refused(saved, tmp_path, monkeypatch):
    model = wrap("wan_i2v")
    with pytest.raises(ValueError, match=r"'wan_i2v' is image-to-video: 2 of 2 prompts have no condition image.*"
                                         r"images=\[image"):
        model.encode(PROMPTS)
    import flowalign.training.builder as builder

    monkeypatch.setattr(builder, "load_flow_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SetupError, match=r"data.train_prompts = .*model family 'wan22_i2v' generates each video from "
                                         r"a condition image, but the prompt .* has none: give every entry one"):
        Trainer(run_config(saved("wan22_i2v"), tmp_path / "run"))


def test_ti2v_image_to_video_keeps_the_condition_as_a_first_frame_no_policy_moves():
    """The first latent frame's velocity is the flow's towards the condition whatever the weights (so it cancels
    from every ratio); the ODE lands on the condition; the other frames follow the transformer."""
    model = wrap("wan22_ti2v_i2v", fresh_video_pipeline("wan22_ti2v_i2v"))
    cond = model.encode(PROMPTS, images=[wan_first_frame_image()] * 2)
    condition = cond.extras["condition"]
    x = model.prepare_noise(2, (16, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model.velocity(x, 0.7, cond)
        model.add_lora(rank=4, alpha=8)
        perturb(model)
        adapted = model.velocity(x, 0.7, cond)
        final = rollout(model.velocity_fn(cond), x, model.sigmas(4, (16, 32)), torch.zeros(4)).final
    with torch.no_grad():  # rows at different sigmas: per-row token timesteps, as each row alone
        rows = model.velocity(x, torch.tensor([0.7, 0.3]), cond)
        alone = torch.cat([model.velocity(x[i:i + 1], s, cond.index([i])) for i, s in enumerate((0.7, 0.3))])
    torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-6)  # one batch of 2 against 2 of 1: rounding
    timesteps = model.token_timesteps(torch.tensor([0.7, 0.3]), x)
    assert torch.equal(timesteps, torch.cat([model.token_timesteps(s, x[:1]) for s in (0.7, 0.3)]))
    assert timesteps.shape == (2, 2 * 1 * 2) and (timesteps[:, :2] == 0).all()  # the condition frame's tokens: t=0
    assert torch.equal(base[:, :, :1], (x[:, :, :1] - condition) / 0.7)
    assert torch.equal(adapted[:, :, :1], base[:, :, :1]) and not torch.allclose(adapted[:, :, 1:], base[:, :, 1:])
    torch.testing.assert_close(final[:, :, :1], condition, rtol=0, atol=1e-5)


def test_released_unipc_schedules_pick_the_same_expert_from_sigma_as_from_the_schedulers_timesteps():
    """Wan2.2 A14B ships UniPC with flow sigmas, whose timesteps are integers: ``1000 sigma >= boundary`` (what the
    adapter tests) agrees with the pipeline's ``t >= boundary`` at every step, and ``sigmas`` is the scheduler's."""
    from diffusers import UniPCMultistepScheduler

    model = wrap("wan22")
    for shift, steps, boundary in ((12.0, 40, 875.0), (3.0, 40, 900.0), (5.0, 50, 875.0)):
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            flow_shift=shift, num_train_timesteps=1000)
        model.scheduler = scheduler
        sigmas = model.sigmas(steps, (16, 16))
        reference = UniPCMultistepScheduler.from_config(scheduler.config)
        reference.set_timesteps(steps)
        assert torch.equal(sigmas, reference.sigmas.float())
        ours = model.timestep(sigmas[:-1], steps) >= boundary
        assert torch.equal(ours, reference.timesteps >= boundary) and ours.any() and not ours.all()


PRESETS = {  # name: (family, steps, noise level, CFG, guidance_scale_2, frames, size, LoRA r/a, lr, group, lora_experts)
    "wan21_t2v": ("wan", 20, 0.7, 4.5, None, 33, 240, (32, 64), 1e-4, 4, None),
    "wan21_i2v": ("wan_i2v", 10, 0.9, 5.0, None, 5, 240, (8, 16.0), 1e-5, 16, None),
    "wan22_a14b": ("wan22", 10, 0.9, 4.0, 3.0, 5, 480, (64, 128), 1e-4, 16, ["high", "low"]),
    "wan22_ti2v_5b": ("wan22_ti2v", 10, 0.9, 5.0, None, 5, 480, (64, 128), 1e-4, 16, None),
}


@pytest.mark.parametrize("name", PRESETS)
def test_wan_presets_have_their_published_settings(name):
    from pathlib import Path

    preset = load_config(TrainConfig, Path(__file__).resolve().parents[1] / f"configs/models/{name}.yaml", [])
    s, m = preset.sampling, preset.model
    assert (m.family, s.num_steps, s.noise_level, s.guidance_scale, m.guidance_scale_2, s.num_frames, s.image_size,
            (m.lora_rank, m.lora_alpha), preset.optim.lr, preset.data.group_size, m.lora_experts) == PRESETS[name]


def test_the_wan22_a14b_preset_trains_both_experts_on_the_tiny_wan22(saved, tmp_path):
    from pathlib import Path

    values = {**small_run_values(saved("wan22"), tmp_path / "run"), "sampling.image_size": 16,
              "sampling.num_frames": 5, "data.group_size": 2, "sampling.batch_size": 2,
              "data.prompts_per_iteration": 2, "collapse.enabled": "false", "model.dtype": "fp32",
              "model.mixed_precision": "no", "reward.rewards": CROSSING_RUN["reward.rewards"]}
    config = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/models/wan22_a14b.yaml",
                         [f"{k}={v}" for k, v in values.items()])
    history = Trainer(config).train()
    assert history[0]["first_ratio_max"] == 1.0 and len(history) == 2


@pytest.mark.parametrize("name", ["wan_i2v", "wan22_i2v", "wan22_ti2v", "wan22_ti2v_i2v"])
def test_every_wan_variant_trains_with_the_first_ratio_exactly_one(name, saved, tmp_path):
    """2 iterations of the default method; the image-to-video families on prompts with a 32 px condition image each
    (tests/test_editing.py's), sampled at that size."""
    from test_editing import editing_prompts

    i2v = VIDEO_FAMILIES[name].condition_images is not None
    extra = {"sampling.image_size": 32, "data.train_prompts": editing_prompts(tmp_path)} if i2v else {}
    history = Trainer(run_config(saved(name), tmp_path / "run", **extra)).train()
    assert len(history) == 2 and all(h["first_ratio_max"] == 1.0 for h in history)
