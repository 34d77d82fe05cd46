"""``import flowalign``: cheap (lazy exports, PEP 562) and exporting the names a user needs."""

import json
import subprocess
import sys

import pytest

import flowalign

EXPORTS = {
    "TrainConfig": ("flowalign.training.config", "TrainConfig"),
    "load_config": ("flowalign.config", "load_config"),
    "Trainer": ("flowalign.training.trainer", "Trainer"),
    "load_flow_model": ("flowalign.models", "load_flow_model"),
    "FlowModel": ("flowalign.models", "FlowModel"),
    "Reward": ("flowalign.rewards", "Reward"),
    "register_reward": ("flowalign.rewards", "register_reward"),
    "Registry": ("flowalign.registry", "Registry"),
    "register_credit": ("flowalign.credit", "register_credit"),
    "register_loss": ("flowalign.losses", "register_loss"),
    "register_objective": ("flowalign.objectives", "register_objective"),
    "register_shape": ("flowalign.rollout", "register_shape"),
    "register_sampler": ("flowalign.inference", "register_sampler"),
    "GuidedSampler": ("flowalign.inference", "GuidedSampler"),
}

# A fresh interpreter times the import itself, then reports what it loaded.
PROBE = """
import json, sys, time
start = time.perf_counter()
import flowalign
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "heavy": sorted(m for m in ("torch", "diffusers", "transformers", "numpy",
                                                                  "flowalign.training.trainer") if m in sys.modules),
                  "dir": dir(flowalign), "all": flowalign.__all__}))
"""


def probe() -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_import_flowalign_is_cheap_and_loads_no_torch():
    runs = [probe() for _ in range(3)]  # the best of three: a loaded machine slows one run, not the import
    assert all(run["heavy"] == [] for run in runs), runs[0]["heavy"]
    assert min(run["seconds"] for run in runs) < 0.3, [run["seconds"] for run in runs]
    assert set(EXPORTS) <= set(runs[0]["dir"]) and sorted(runs[0]["all"]) == sorted(EXPORTS)


def test_every_export_resolves_to_its_defining_object():
    import importlib

    assert sorted(flowalign.__all__) == sorted(EXPORTS)
    for name, (module, attribute) in EXPORTS.items():
        assert getattr(flowalign, name) is getattr(importlib.import_module(module), attribute), name
    from flowalign import Trainer, Registry, register_reward  # noqa: F401 - ``from`` imports work too

    assert set(EXPORTS) <= set(dir(flowalign)) and "__version__" in dir(flowalign)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'flowalign' has no attribute 'register_credits'"):
        flowalign.register_credits  # noqa: B018
    assert not hasattr(flowalign, "nope")


def test_grpo_trainer_is_a_deprecated_alias_of_trainer():
    """Issue #42 renamed the class (it trains every method); the old name warns for one release."""
    import flowalign.training.trainer as trainer_module

    with pytest.warns(DeprecationWarning, match=r"flowalign\.GRPOTrainer is now flowalign\.Trainer"):
        assert flowalign.GRPOTrainer is flowalign.Trainer
    with pytest.warns(DeprecationWarning, match=r"GRPOTrainer is now Trainer"):
        assert trainer_module.GRPOTrainer is trainer_module.Trainer
    with pytest.warns(DeprecationWarning):
        from flowalign import GRPOTrainer  # noqa: F401
    assert "GRPOTrainer" not in flowalign.__all__


def test_the_old_setup_module_warns_and_re_exports_the_builder():
    """``flowalign.training.setup`` is ``flowalign.training.builder`` now (issue #42)."""
    import importlib

    import flowalign.training.builder as builder

    with pytest.warns(DeprecationWarning, match=r"flowalign\.training\.setup is now flowalign\.training\.builder"):
        import flowalign.training.setup as setup

        setup = importlib.reload(setup)
    for name in setup.__all__:
        assert getattr(setup, name) is getattr(builder, name), name
