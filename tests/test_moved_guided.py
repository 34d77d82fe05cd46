"""The old paths of the guided samplers' modules (docs/reference/moved.md) still work for one release:
each warns with a DeprecationWarning and hands back the very objects of the new home."""

from __future__ import annotations


import pytest
from test_moved import import_fresh



def test_inference_guided_is_a_shim_over_the_one_module_per_sampler_package():
    import flowalign.inference as inference

    with pytest.warns(DeprecationWarning, match="flowalign.inference.guided is deprecated"):
        guided = import_fresh("flowalign.inference.guided")
    for name in guided.__all__:
        assert getattr(guided, name) is getattr(inference, name), name


def test_the_inference_package_imports_each_sampler_from_its_own_module():
    import flowalign.inference as inference

    homes = {"none": "best_of_n", "bon": "best_of_n", "fk": "fk", "dts": "dts", "rgs": "rgs", "euphonium": "euphonium",
             "satisdive": "satisdive"}
    assert set(homes) <= set(inference.SAMPLERS.names())
    for name, module in homes.items():
        assert inference.SAMPLERS.get(name).__module__ == f"flowalign.inference.{module}", name


def test_euphonium_guidance_moved_to_euphoniums_sampler_module_and_the_old_path_warns():
    import flowalign.samplers as samplers
    import flowalign.samplers.euphonium as euphonium
    import flowalign.samplers.sde as sde

    assert samplers.euphonium_guidance is euphonium.euphonium_guidance
    for name in ("euphonium_guidance", "GUIDANCE_NORMS"):
        with pytest.warns(DeprecationWarning, match=f"moved to flowalign.samplers.euphonium.{name}"):
            assert getattr(sde, name) is getattr(euphonium, name)
    with pytest.warns(DeprecationWarning):
        from flowalign.samplers.sde import euphonium_guidance  # noqa: F401  (the old ``from`` import works too)


def test_the_old_name_of_fks_resampling_schemes_warns():
    import flowalign.samplers.fk as fk

    with pytest.warns(DeprecationWarning, match="SEMANTICS moved to flowalign.samplers.fk.RESAMPLING"):
        assert fk.SEMANTICS is fk.RESAMPLING == ("reference", "flowalign")
