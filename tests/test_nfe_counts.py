"""The logged NFEs are the transformer's real work: counted at the transformer, with CFG, for every method preset."""

import pytest

from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from test_presets import METHODS, SMALL_RUN_SHAPE, small_run, tiny_paths  # noqa: F401 - the fixture


def count_rows(transformer):
    """Rows the transformer evaluates outside training mode (rollouts and completions; the loss runs in train mode).
    One row is one NFE: with CFG the conditional and unconditional rows of a sample are two."""
    seen = {"rows": 0}

    def hook(module, args, kwargs):
        if not module.training:
            seen["rows"] += int(kwargs["hidden_states"].shape[0])

    return seen, transformer.register_forward_pre_hook(hook, with_kwargs=True)


# soar, sft and drl_adjoint run no rollout (objectives alone): their NFEs are the objectives' forwards, checked in
# test_presets
ROLLOUT_PRESETS = [p for p in METHODS if p.stem not in ("soar", "sft", "drl_adjoint")]


@pytest.mark.parametrize("preset", ROLLOUT_PRESETS, ids=lambda p: p.stem)
def test_logged_nfes_equal_the_transformers_rows_with_cfg(preset, tiny_paths, tmp_path):
    extra = {**SMALL_RUN_SHAPE.get(preset.stem, {}), "sampling.guidance_scale": 3.0, "train.iterations": 1}
    if preset.stem == "register_grpo":  # registers for the tiny transformer the run trains
        from diffusers import SD3Transformer2DModel
        from flowalign.reward_models.latent_registers import LatentRegisters

        transformer = SD3Transformer2DModel.from_pretrained(tiny_paths["sd3"] / "transformer")
        extra["credit.registers"] = str(
            LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(tmp_path / "r.pt"))
    if preset.stem == "shell_lcc_objective":  # a manifold recorded as fitted for the tiny model's VAE
        from test_shell_lcc import tiny_manifold

        extra["objectives.shell_lcc.path"] = str(tiny_manifold(tiny_paths["sd3"], tmp_path / "manifold.safetensors"))
        extra["objectives.shell_lcc.batch_size"] = 2
    trainer = Trainer(load_config(TrainConfig, preset, small_run(tiny_paths["sd3"], tmp_path / "run", **extra)))
    seen, handle = count_rows(trainer.model.transformer)
    try:
        metrics = trainer.step()
    finally:
        handle.remove()
    # the rollout and completions sample (eval mode); an objective's forwards are training passes, counted apart
    assert metrics["nfe/rollout"] + metrics["nfe/completion"] == seen["rows"]
    assert metrics["nfe"] == seen["rows"] + metrics.get("nfe/objectives", 0)
    if preset.stem in ("dense_grpo", "tp_grpo"):  # ODE completions are CFG'd too: twice the rows of one pass
        assert metrics["nfe/completion"] > 0 and metrics["nfe/completion"] % 2 == 0
