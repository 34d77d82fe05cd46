"""Full fine-tuning (``model.finetune: full``): every transformer weight trains as an fp32 master weight beside a frozen
reference copy of the base (``FlowModel.make_full_finetune``); checkpoints write the transformer in diffusers' format,
resume bitwise, and every method preset trains with it."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import load_file

from flowalign.config import ConfigError, load_config
from flowalign.models import wrap_pipeline
from flowalign.models.tiny import tiny_sd3_pipeline
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import METHODS, SMALL_RUN_SHAPE, preset_path, small_run_values
from test_trainer import final_checkpoint, make_trainer, tiny_model  # noqa: F401 - the module's tiny SD3

FULL = {"model.finetune": "full"}


def test_make_full_finetune_trains_every_weight_and_keeps_a_frozen_bitwise_reference(words):
    model = wrap_pipeline(tiny_sd3_pipeline(words, seed=0))
    cond = model.encode(["a red circle", "two blue squares"])
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model.velocity(x, 0.6, cond)
    model.make_full_finetune()
    params = list(model.transformer.parameters())
    assert all(p.requires_grad and p.dtype == torch.float32 for p in params)
    assert not any(p.requires_grad for m in (model.pipe.vae, *model.text_encoders()) for p in m.parameters())
    assert not any(p.requires_grad for p in model.reference_transformer.parameters())
    with torch.no_grad():
        for p in params:  # train the policy away from the base
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        moved = model.velocity(x, 0.6, cond)
        with model.reference():
            assert model.active_transformer is model.reference_transformer
            reference = model.velocity(x, 0.6, cond)
        assert model.active_transformer is model.transformer
        after = model.velocity(x, 0.6, cond)
    assert torch.equal(reference, base) and torch.equal(after, moved) and not torch.allclose(moved, base)
    with pytest.raises(RuntimeError, match="LoRA adapter"):
        lora = wrap_pipeline(tiny_sd3_pipeline(words, seed=0))
        lora.add_lora(rank=2)
        lora.make_full_finetune()


def test_an_offloaded_reference_stays_on_the_cpu_between_passes(words):
    model = wrap_pipeline(tiny_sd3_pipeline(words, seed=0))
    model.make_full_finetune(offload=True)
    cond = model.encode(["a red circle"])
    x = model.prepare_noise(1, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.reference():
        model.velocity(x, 0.5, cond)
    assert model.reference_transformer.device.type == "cpu" and model.reference_offload


def test_a_full_fine_tune_trains_with_ratio_one_and_its_checkpoint_is_a_diffusers_transformer(tiny_model, tmp_path):
    history = make_trainer(tiny_model, tmp_path / "run", **FULL, **{"train.iterations": 2, "loss.grpo.beta": 0.04}).train()
    assert all(h["first_ratio_max"] == 1.0 for h in history)
    assert history[-1]["kl"] > 0  # the policy left its frozen reference
    checkpoint = final_checkpoint(tmp_path / "run")
    assert not (checkpoint / "lora").exists()
    trained = load_file(str(checkpoint / "trainable.safetensors"))
    base = SD3Transformer2DModel.from_pretrained(tiny_model / "transformer")
    assert set(trained) == {n for n, _ in base.named_parameters()}  # every weight trains
    loaded = SD3Transformer2DModel.from_pretrained(checkpoint / "transformer")
    state = dict(loaded.named_parameters())
    assert all(torch.equal(state[name], trained[name]) for name in trained)
    assert any(not torch.equal(p, trained[n]) for n, p in base.named_parameters())


def test_a_full_fine_tune_resumes_bitwise(tiny_model, tmp_path):
    extra = {**FULL, "train.iterations": 3, "train.checkpoint_every": 1, "optim.ema_decay": 0.5}
    make_trainer(tiny_model, tmp_path / "whole", **extra).train()
    make_trainer(tiny_model, tmp_path / "split", **{**extra, "train.iterations": 2}).train()
    make_trainer(tiny_model, tmp_path / "split", **{**extra, "train.resume": "latest"}).train()
    for name in ("trainable", "ema"):
        a = load_file(str(tmp_path / "whole" / "checkpoint-000003" / f"{name}.safetensors"))
        b = load_file(str(tmp_path / "split" / "checkpoint-000003" / f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_resuming_a_lora_checkpoint_as_a_full_fine_tune_is_refused_before_the_model_loads(tiny_model, tmp_path):
    make_trainer(tiny_model, tmp_path / "run", **{"train.iterations": 1, "train.checkpoint_every": 1}).train()
    with pytest.raises(Exception, match="model.finetune"):
        make_trainer(tmp_path / "no-model", tmp_path / "run", **FULL,
                     **{"train.iterations": 2, "train.resume": "latest"})


def test_bad_full_fine_tune_settings_name_the_key():
    with pytest.raises(ConfigError, match="model.reference_offload"):
        load_config(TrainConfig, None, ["model.reference_offload=true"])
    with pytest.raises(ConfigError, match="model.mixed_precision.*set model.mixed_precision: bf16"):
        load_config(TrainConfig, None, ["model.finetune=full", "model.dtype=bf16"])
    with pytest.raises(ConfigError, match="model.finetune"):
        load_config(TrainConfig, None, ["model.finetune=partial"])


@pytest.mark.parametrize("preset", [p.stem for p in METHODS])
def test_every_method_preset_trains_as_a_full_fine_tune(preset, tiny_model, tmp_path):
    values = {**small_run_values(tiny_model, tmp_path / "run"), "train.checkpoint_every": 0,
              **SMALL_RUN_SHAPE.get(preset, {}), **FULL}
    extra = preset_extra(preset, tiny_model, tmp_path)
    config = load_config(TrainConfig, preset_path(preset), [f"{k}={v}" for k, v in {**values, **extra}.items()])
    history = Trainer(config).train()
    assert len(history) == 2
    if "first_ratio_max" in history[0] and config.loss.get("grpo") is not None:
        assert history[0]["first_ratio_max"] == 1.0
    losses = [value for h in history for key, value in h.items() if key == "loss" or key.endswith("/loss")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))


def preset_extra(preset, model_path, tmp_path) -> dict:
    """What a preset's small run needs beyond the model: a register checkpoint, a discriminator or a manifold made
    for the tiny SD3 (as the golden runs build them)."""
    if preset == "register_grpo":
        from flowalign.reward_models.latent_registers import LatentRegisters

        torch.manual_seed(0)
        transformer = SD3Transformer2DModel.from_pretrained(model_path / "transformer")
        path = LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(tmp_path / "registers.pt")
        return {"credit.registers": str(path)}
    if preset in ("drl", "drl_adjoint"):
        from flowalign.reward_models.discriminator import untrained_discriminator

        path = untrained_discriminator(model_path, tmp_path / "discriminator.safetensors", image_size=32, width=16)
        if preset == "drl_adjoint":  # adjoint matching on its gradient, the full fine-tune's frozen copy the base
            return {"objectives.adjoint_matching.reward_kwargs": "{path: " + str(path) + "}"}
        return {"reward.rewards": "[{name: discriminator, kwargs: {path: " + str(path) + "}}]"}
    if preset in ("shell_lcc", "shell_lcc_objective"):
        from test_golden import shell_lcc_settings
        from test_shell_lcc import tiny_manifold

        return shell_lcc_settings(preset, tiny_manifold(model_path, tmp_path / "manifold.safetensors"))
    return {}


@pytest.mark.slow
def test_two_processes_match_one_process_for_a_full_fine_tune(tiny_model, tmp_path):
    """DDP over 2 processes (gloo on CPU) trains every weight as one process does, to the all-reduce's rounding."""
    import json

    from test_trainer import _one_vs_two_processes

    a, b = _one_vs_two_processes(tiny_model, tmp_path, **FULL)
    history = [json.loads((c / "state.json").read_text())["history"] for c in (a, b)]
    assert [m["reward"] for m in history[0]] == pytest.approx([m["reward"] for m in history[1]], abs=1e-6)
    base = dict(SD3Transformer2DModel.from_pretrained(tiny_model / "transformer").named_parameters())
    wa, wb = load_file(str(a / "trainable.safetensors")), load_file(str(b / "trainable.safetensors"))
    assert wa.keys() == wb.keys() == base.keys()
    update = sum((wa[k] - base[k].detach()).double().pow(2).sum() for k in wa).sqrt()
    difference = sum((wa[k] - wb[k]).double().pow(2).sum() for k in wa).sqrt()
    assert update > 1e-3 and difference < 1e-3 * update, (float(difference), float(update))
