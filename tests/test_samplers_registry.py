"""Guided samplers are registered components: a sampler defined in this file (returning a set of 2 images per prompt)
runs through ``flowalign sample`` on the toy model, the built-in ones are listed with their settings and needs, and
the pre-component ``SampleConfig`` keywords still build the same sampler settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import flowalign
from flowalign.components import ComponentConfig
from flowalign.inference import SAMPLERS, GuidedProblem, GuidedSampler, register_sampler
from flowalign.settings import at_least, option

TOY = Path(__file__).resolve().parents[1] / "assets" / "toy-sd3"


@dataclass
class PairSettings(ComponentConfig):
    copies: int = option(2, "ODE samples kept per prompt")

    def validate(self) -> None:
        at_least("copies", self.copies, 1)


class KeepAll(GuidedSampler):
    """``copies`` ODE samples per prompt, all of them returned (a set per prompt)."""

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.guided import GuidedResult, initial_noise
        from flowalign.samplers.sde import ode_step

        k, prompts = self.config.copies, len(problem.generators)
        rows = torch.arange(prompts, device=problem.device).repeat_interleave(k)
        x = initial_noise(problem.shape, problem.generators, rows, problem.device)
        sigmas = problem.sigmas
        with torch.no_grad():
            for i in range(sigmas.numel() - 1):
                x = ode_step(x, problem.velocity(x, sigmas[i], rows), sigmas[i], sigmas[i + 1])
            scores = problem.reward(x, rows).double().cpu()
        nfe = k * (sigmas.numel() - 1) * problem.evals_per_sample
        return GuidedResult(final=x.reshape(prompts, k, *problem.shape), reward=scores.reshape(prompts, k),
                            nfe=torch.full((prompts,), nfe, dtype=torch.long))


class NeedsDepth(GuidedSampler):
    needs = frozenset({"reward", "depth_map"})


class NeedsEmbedding(GuidedSampler):
    """Keeps two copies, after checking that flowalign sample handed it the --diversity embedding."""

    needs = frozenset({"reward", "image_embedding"})

    def sample(self, problem):
        vectors = problem.embedding.embed(torch.rand(2, 3, 16, 16))
        assert vectors.shape[0] == 2 and torch.allclose(vectors.norm(dim=1), torch.ones(2))
        return KeepAll(PairSettings(name="keep_all", copies=2)).sample(problem)


@pytest.fixture
def registered():
    flowalign.register_sampler("keep_all", KeepAll, config=PairSettings)
    register_sampler("needs_depth", NeedsDepth, config=ComponentConfig)
    register_sampler("needs_embedding", NeedsEmbedding, config=ComponentConfig)
    yield
    SAMPLERS.unregister("keep_all")
    SAMPLERS.unregister("needs_depth")
    SAMPLERS.unregister("needs_embedding")


def test_a_sampler_registered_outside_the_package_runs_through_flowalign_sample(registered, tmp_path, capsys):
    from flowalign.cli import main

    out = tmp_path / "pairs"
    assert main(["sample", "--guidance", "keep_all", "--copies", "2", "--steps", "2", "--budget", "4",
                 "--max-prompts", "1", "--model", str(TOY), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["sampler"] == {"name": "keep_all", "copies": 2}
    assert results["prompts"] == 1 and results["images_per_prompt"] == 2
    rows = results["results"]
    assert [(r["prompt_id"], r["image_index"], r["nfe"]) for r in rows] == [(0, 0, 4), (0, 1, 4)]
    assert all(0 <= r["reward"] <= 1 and "correct" in r for r in rows)
    first, second = (out / "images" / "0000_00.png"), (out / "images" / "0000_01.png")
    assert first.read_bytes() != second.read_bytes() and (out / "grid.png").is_file()
    assert "2 images per prompt" in (out / "summary.md").read_text()
    assert "1 prompts" in capsys.readouterr().out


def test_a_registered_samplers_settings_are_options_with_help(registered, capsys):
    from flowalign.cli import main

    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--copies COPIES ODE samples kept per prompt (default: 2; with --guidance keep_all; = sampler.copies)" in \
        shown


def test_what_a_sampler_needs_and_flowalign_sample_lacks_is_refused_before_loading(registered, tmp_path, capsys):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--guidance", "needs_depth", "--model", str(tmp_path / "absent"), "--out",
              str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "needs depth_map, which flowalign sample does not provide" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_sampler_that_needs_an_image_embedding_gets_the_diversity_one(registered, tmp_path):
    from flowalign.cli import main

    out = tmp_path / "o"
    assert main(["sample", "--guidance", "needs_embedding", "--diversity", "pixels", "--steps", "2", "--budget", "4",
                 "--max-prompts", "1", "--model", str(TOY), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["diversity_embedding"] == "pixels" and results["sets"][0]["diversity"] > 0


def test_the_built_in_samplers_are_listed_with_their_settings_and_needs():
    from flowalign.inference.sample import SampleConfig

    assert {"none", "bon", "fk", "dts", "rgs"} <= set(SAMPLERS.names())
    fields = {name: set(vars(SAMPLERS.make_config(name, _valid(name)))) for name in ("none", "bon", "fk", "dts", "rgs")}
    assert fields["none"] == fields["bon"] == {"name"}
    assert {"lam", "potential", "resample_start", "noise_level", "reward", "gradient", "bands"} <= fields["fk"]
    assert {"lam", "max_children", "soft", "noise_level"} <= fields["dts"]
    assert {"registers", "reward", "reward_kwargs", "gradient", "bands"} <= fields["rgs"]
    needs = {name: SampleConfig(guidance=name, **_valid(name)).build_sampler().requirements()
             for name in ("none", "bon", "fk", "dts", "rgs")}
    assert needs["bon"] == needs["dts"] == needs["fk"] == {"reward"}
    assert needs["rgs"] == {"reward", "registers"}
    assert SampleConfig(guidance="rgs", rgs_reward="hps").build_sampler().requirements() == {
        "reward", "differentiable_reward"}
    assert SampleConfig(guidance="fk", rgs_reward="hps", rgs_gradient="x0").build_sampler().requirements() == {
        "reward", "differentiable_reward"}


def _valid(name):
    return {"registers": "r.pt"} if name == "rgs" else {}  # RGS needs a gradient source


def test_the_pre_component_keywords_build_the_samplers_settings():
    from flowalign.inference.sample import SampleConfig

    config = SampleConfig(guidance="fk", budget=6, steps=3, lam=5.0, fk_resample_start=1, rgs_bands=[(0.5, 0.2)],
                          max_children=7, registers="ignored.pt")  # settings fk lacks are dropped
    assert config.guidance == "fk" and config.budget == 6
    assert (config.sampler.lam, config.sampler.resample_start, config.sampler.bands) == (5.0, 1, [[0.5, 0.2]])
    assert not hasattr(config.sampler, "max_children") and not hasattr(config.sampler, "registers")
    config.validate()
    dts = SampleConfig(guidance="dts", dts_soft=True, max_children=4)
    assert dts.sampler.soft is True and dts.sampler.max_children == 4
    assert SampleConfig().sampler.name == "bon"
    with pytest.raises(TypeError, match="unexpected keyword argument 'lamb'"):
        SampleConfig(lamb=3)
