"""The moves and renames of 0.2 (docs/reference/moved.md): every old module path still imports for one release, warns
with a DeprecationWarning naming the new path and re-exports the new module's names; every old command name still
runs the same command and prints one line on stderr naming the new one."""

from __future__ import annotations

import importlib
import sys

import pytest

from flowalign.cli import build_parser, main

# old module -> (new module, names the old one must re-export as the same objects)
MOVED_MODULES = {
    "flowalign.normalization": ("flowalign.advantages", ["group_advantages", "group_normalize", "STD_MODES"]),
    "flowalign.training.checkpoint": ("flowalign.training.checkpoint_files",
                                      ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "holds_ema"]),
    "flowalign.training.engine": ("flowalign.training.parallel_engines",
                                  ["Engine", "DDPEngine", "FSDP2Engine", "ENGINES", "build_engine"]),
    "flowalign.training.distributed": ("flowalign.training.collectives",
                                       ["agreed", "summed", "together", "check_ranks_agree"]),
    "flowalign.credit.registers": ("flowalign.credit.register_grpo", ["RegisterCredit", "RegisterCreditConfig",
                                                                      "RegisterReader"]),
    "flowalign.reward_models.registers": ("flowalign.reward_models.latent_registers",
                                          ["LatentRegisters", "load_registers", "thurstone_loss"]),
    "flowalign.training.registers": ("flowalign.prep.train_registers", ["RegisterTrainConfig", "train_registers"]),
    "flowalign.training.calibrate": ("flowalign.prep.calibrate", ["calibrate", "write_calibrated_config"]),
    "flowalign.training.manifold": ("flowalign.prep.fit_manifold", ["FitManifoldConfig", "fit_model_manifold"]),
    "flowalign.training.discriminator": ("flowalign.prep.train_discriminator",
                                         ["DiscriminatorTrainConfig", "train_discriminator"]),
    "flowalign.cli.manifold": ("flowalign.cli.prep", ["add_fit_manifold"]),
    "flowalign.cli.discriminator": ("flowalign.cli.prep", ["add_train_discriminator"]),
}
# module -> names that moved out of it (the module itself stays): (new module, names)
MOVED_NAMES = {
    "flowalign.export": ("flowalign.lora_loading", ["LORA_FILE", "LoraSource", "apply_lora", "base_model_path",
                                                    "load_model", "resolve_lora"]),
    "flowalign.cli.train": ("flowalign.cli.prep", ["CalibrateOptions", "add_calibrate"]),
    "flowalign.cli.tools": ("flowalign.cli.prep", ["add_registers_train"]),
    "flowalign.evaluation.toy_eval": ("flowalign.lora_loading", ["resolve_model_path"]),
    "flowalign.serialization": ("flowalign.sharded_reading", ["read_sharded"]),
}


def import_fresh(name: str):
    """Import ``name`` anew, so its import-time warning fires again even when an earlier test imported it (the shim
    tests of tests/test_moved_components.py and tests/test_moved_guided.py use it too)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize("old", list(MOVED_MODULES))
def test_an_old_module_path_warns_and_re_exports_the_new_module(old):
    new, names = MOVED_MODULES[old]
    with pytest.warns(DeprecationWarning, match=rf"{old.replace('.', '[.]')} is deprecated: import {new}"):
        module = import_fresh(old)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(target, name), name


@pytest.mark.parametrize("module", list(MOVED_NAMES))
def test_a_moved_name_warns_and_is_the_new_homes(module):
    new, names = MOVED_NAMES[module]
    old, target = importlib.import_module(module), importlib.import_module(new)
    for name in names:
        with pytest.warns(DeprecationWarning, match=rf"{module}[.]{name} moved to {new}[.]{name}"):
            value = getattr(old, name)
        assert value is getattr(target, name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(old, "no_such_name")


def test_export_keeps_what_exports_without_a_warning(recwarn):
    from flowalign import export

    assert callable(export.export_lora) and export.EXPORT_RECORD == "flowalign_export.json"
    assert export.WEIGHTS == ("ema", "last")
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


# old command -> the prep command it is now, and a bad value both refuse before anything loads
ALIASES = {
    ("calibrate",): (("prep", "calibrate"), ["--rounds", "0", "--out", "x.yaml"], "rounds must be >= 1"),
    ("reward", "fit-manifold"): (("prep", "fit-manifold"), ["--num-bases", "0"], "num_bases"),
    ("reward", "train-discriminator"): (("prep", "train-discriminator"), ["--max-steps", "0"], "max_steps"),
    ("registers", "train"): (("prep", "registers"), ["--samples-per-prompt", "1"], "samples_per_prompt must be >= 2"),
}


@pytest.mark.parametrize("old", list(ALIASES), ids=" ".join)
def test_an_old_command_name_is_the_same_command_and_names_the_new_one(old, tmp_path, capsys, monkeypatch):
    """The alias builds the same command (one ``ConfigCommand``: the same settings, the same code), and prints the
    deprecation line before its work; a bad value gets the new command's error. Real runs of each alias, bitwise equal
    to the new command's, are in tests/test_drl.py, test_shell_lcc.py and test_trainer.py."""
    new, bad, message = ALIASES[old]
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    assert parser.parse_args([*old]).command_spec is parser.parse_args([*new]).command_spec
    errors = {}
    for name in (old, new):
        with pytest.raises(SystemExit) as exit_info:
            main([*name, *bad])
        errors[name] = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in errors[name], errors[name]
    line = f"flowalign: warning: `flowalign {' '.join(old)}` is deprecated: use `flowalign {' '.join(new)}`"
    assert errors[old].startswith(line) and errors[old].split("\n", 1)[1] == errors[new]
    assert "deprecated" not in errors[new]
    assert list(tmp_path.iterdir()) == []  # nothing written
