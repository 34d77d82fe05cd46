"""The moves of 0.2 in the components (docs/reference/moved.md, "Component protocols and objectives' math"):
each old import path still works for one release, warns where the name moved, and gives the new home's objects."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_moved import import_fresh

import flowalign.objectives.adjoint_matching_math as adjoint_math
import flowalign.objectives.soar_math as soar_math
import flowalign.samplers.memoryless as memoryless



def test_the_old_soar_module_warns_and_re_exports_the_math():
    with pytest.warns(DeprecationWarning, match="flowalign.losses.soar moved to flowalign.objectives.soar_math"):
        old = import_fresh("flowalign.losses.soar")
    assert set(old.__all__) == set(soar_math.__all__)
    assert all(getattr(old, name) is getattr(soar_math, name) for name in old.__all__)


def test_the_old_soar_names_of_the_losses_package_warn_and_re_export():
    import flowalign.losses as losses

    for name in ("soar_aux_points", "soar_loss"):
        with pytest.warns(DeprecationWarning, match=f"flowalign.losses.{name} moved to flowalign.objectives.soar_math"):
            assert getattr(losses, name) is getattr(soar_math, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        losses.nothing


def test_the_old_adjoint_matching_module_warns_and_re_exports_both_new_homes():
    with pytest.warns(DeprecationWarning, match="flowalign.losses.adjoint_matching moved"):
        old = import_fresh("flowalign.losses.adjoint_matching")
    homes = (adjoint_math, memoryless)
    for name in old.__all__:
        assert any(getattr(home, name, None) is getattr(old, name) for home in homes), name
    assert {"sample_memoryless", "memoryless_step", "adjoint_matching_loss", "lean_adjoints"} <= set(old.__all__)


def test_the_protocols_import_from_their_packages_without_a_warning_and_the_step_rewards_shim_is_gone():
    code = ("import warnings\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    from flowalign.credit import (CREDIT, BatchScores, Credit, CreditContext, CreditEstimator, "
            "register_credit, trained_mask, diversity_advantages, euphonium_advantages, value_anchored_advantages)\n"
            "    from flowalign.losses import LOSSES, LossTerm, MicroBatch, PolicyOutput, register_loss\n"
            "    from flowalign.objectives import (OBJECTIVES, DataUnit, Objective, ObjectiveContext, RolloutSamples, "
            "process_slice, register_objective, unit_keys)\n"
            "    from flowalign.rollout import (SHAPES, Batch, RolloutContext, RolloutGuidance, RolloutHook, "
            "RolloutShape, per_row_velocity, register_shape)\n"
            "assert not [w for w in caught if issubclass(w.category, DeprecationWarning) "
            "and 'flowalign' in str(w.message)], [str(w.message) for w in caught]\n"
            "import flowalign.credit.base as c, flowalign.losses.base as l, flowalign.objectives.base as o, "
            "flowalign.rollout.base as r\n"
            "assert CREDIT is c.CREDIT and LossTerm is l.LossTerm and Objective is o.Objective and SHAPES is r.SHAPES\n"
            "assert PolicyOutput is o.PolicyOutput\n"
            "try:\n    import flowalign.step_rewards\nexcept ModuleNotFoundError:\n    print('gone')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gone"
