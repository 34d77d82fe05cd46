"""The ``flow_matching`` objective and the image-caption dataset it reads, on the tiny real SD3 pipeline."""

import json
from dataclasses import dataclass

import pytest
import torch

from flowalign.config import ConfigError
from flowalign.data.images import ImageCaptionDataset, load_image, read_records, write_toy_dataset
from flowalign.errors import SetupError
from flowalign.models.base import Cond
from flowalign.models.sd3 import SD3Model
from flowalign.objectives import OBJECTIVES, DataUnit, ObjectiveContext
from flowalign.objectives.flow_matching import FlowMatching, FlowMatchingConfig, draw_sigmas
from flowalign.samplers.sde import predict_x0


@dataclass
class Policy:
    v: torch.Tensor
    v_ref: torch.Tensor | None = None


from test_presets import small_run, tiny_paths  # noqa: E402,F401 - the fixture


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_toy_dataset(tmp_path_factory.mktemp("toy_data"), 6, seed=0)


@pytest.fixture
def model(sd3_pipe):
    return SD3Model(sd3_pipe)


def context(model, iteration=0, process_index=0, num_processes=1, seed=7):
    return ObjectiveContext(model=model, config=None, seed=seed, iteration=iteration, process_index=process_index,
                            num_processes=num_processes)


def objective(data, **settings):
    return OBJECTIVES.build("flow_matching", data=str(data), **settings)


def assert_units_equal(a: DataUnit, b: DataUnit):
    assert torch.equal(a.x, b.x) and torch.equal(a.sigma, b.sigma)
    assert torch.equal(a.cond.embeds, b.cond.embeds) and torch.equal(a.cond.pooled, b.cond.pooled)
    assert a.data.keys() == b.data.keys() and all(torch.equal(a.data[k], b.data[k]) for k in a.data)


@pytest.mark.parametrize("sample_posterior", [False, True])
def test_units_are_the_same_for_one_process_and_two_processes_slices(model, toy_data, sample_posterior):
    settings = dict(batch_size=2, units_per_iteration=4, sample_posterior=sample_posterior)
    single = objective(toy_data, **settings).units(3, context(model, 3))
    # Fresh objects per process: nothing may depend on what another process computed.
    split = [u for p in range(2) for u in objective(toy_data, **settings).units(3, context(model, 3, p, 2))]
    assert len(single) == len(split) == 4
    for a, b in zip(single, split):
        assert_units_equal(a, b)
    # Units differ from one another and from one iteration to the next.
    assert not torch.equal(single[0].x, single[1].x)
    assert not torch.equal(objective(toy_data, **settings).units(4, context(model, 4))[0].x, single[0].x)


def test_unit_is_the_forward_process_with_the_rectified_flow_target(model, toy_data):
    obj = objective(toy_data, batch_size=3)
    unit = obj.units(0, context(model))[0]
    x0, noise, target = unit.data["x0"], unit.data["noise"], unit.data["target"]
    images, prompts = ImageCaptionDataset(toy_data, 32).batch(unit.data["rows"].tolist())
    with torch.no_grad():
        assert torch.equal(x0, model.encode_images(images, dtype=torch.float32))
        assert torch.equal(unit.cond.embeds, model.encode(prompts).embeds)
    assert x0.shape == noise.shape == unit.x.shape == model.latent_shape(3) and unit.sigma.shape == (3,)
    assert unit.x.dtype == torch.float32 and ((unit.sigma > 0) & (unit.sigma < 1)).all()
    s = unit.sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(unit.x, (1 - s) * x0 + s * noise, rtol=0, atol=0)
    assert torch.equal(target, noise - x0)
    # The sign convention of the samplers: the exact velocity recovers x0 (and the noise) from x.
    torch.testing.assert_close(predict_x0(unit.x, target, unit.sigma), x0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unit.x + (1 - s) * target, noise, rtol=1e-6, atol=1e-6)


def test_an_epoch_visits_every_pair_once(model, toy_data):
    obj = objective(toy_data, batch_size=2, units_per_iteration=1)
    rows = [r for i in range(3) for r in obj.indices(7, i, 0, 6)]
    assert sorted(rows) == list(range(6))
    second = [r for i in range(3, 6) for r in obj.indices(7, i, 0, 6)]
    assert sorted(second) == list(range(6)) and second != rows  # the next epoch: a fresh keyed order
    # Units straddle epochs: batch 4 over 6 pairs, iteration 1 takes the last 2 of epoch 0 and the first 2 of epoch 1.
    wide = objective(toy_data, batch_size=4)
    assert wide.indices(7, 1, 0, 6) == wide.permutation(7, 0, 6)[4:] + wide.permutation(7, 1, 6)[:2]


def test_loss_equals_a_hand_computation():
    obj = FlowMatching(FlowMatchingConfig(data="unused", weight=2.0))
    target = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    unit = DataUnit(x=torch.zeros(2, 2), sigma=torch.tensor([0.25, 0.75]), cond=None, data={"target": target})
    v = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    loss, stats = obj.loss(unit, Policy(v))
    # squared errors 1, 0, 0, 16: mean 17/4, times the weight 2
    assert loss.item() == 8.5 and stats == {"loss": 8.5, "mse": 4.25, "sigma_mean": 0.5}
    zero, stats = obj.loss(unit, Policy(target.clone()))
    assert zero.item() == 0.0 and stats["mse"] == 0.0
    with pytest.raises(ValueError, match="shape"):
        obj.loss(unit, Policy(v[:1]))


def test_loss_is_zero_at_the_target_of_a_real_unit(model, toy_data):
    unit = objective(toy_data).units(0, context(model))[0]
    loss, _ = objective(toy_data).loss(unit, Policy(unit.data["target"].clone()))
    assert loss.item() == 0.0


def test_gradients_reach_the_lora_parameters_through_the_velocity(model, toy_data):
    model.add_lora(rank=4)
    model.freeze_base()
    obj = objective(toy_data, batch_size=2)
    unit = obj.units(0, context(model))[0]
    v = model.velocity(unit.x, unit.sigma, unit.cond)
    loss, _ = obj.loss(unit, Policy(v))
    loss.backward()
    lora = {name: p for name, p in model.transformer.named_parameters() if "lora_" in name}
    assert lora and all(p.grad is not None for p in lora.values())
    # B starts at zero, so the first gradient is on the B matrices.
    assert any(p.grad.abs().sum() > 0 for name, p in lora.items() if "lora_B" in name)
    assert all(p.grad is None for name, p in model.transformer.named_parameters() if "lora_" not in name)


def test_sigma_densities():
    generator = torch.Generator().manual_seed(0)
    uniform = draw_sigmas(FlowMatchingConfig(sigma_sampling="uniform"), 20000, generator)
    logit = draw_sigmas(FlowMatchingConfig(sigma_sampling="logit_normal", logit_mean=1.0), 20000, generator)
    shifted = draw_sigmas(FlowMatchingConfig(sigma_sampling="uniform", shift=3.0), 20000,
                          torch.Generator().manual_seed(0))
    assert abs(uniform.mean() - 0.5) < 0.01 and abs(uniform.median() - 0.5) < 0.01
    assert abs(logit.logit().mean() - 1.0) < 0.03 and abs(logit.logit().std() - 1.0) < 0.03
    # shift s / (1 + 2 s) of the same uniform draws
    torch.testing.assert_close(shifted, 3 * uniform / (1 + 2 * uniform))


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"weight": 0.0}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"batch_size": 0}, "batch_size"),
        ({"units_per_iteration": 0}, "units_per_iteration"),
        ({"sigma_sampling": "cosine"}, "sigma_sampling"),
        ({"logit_std": 0.0}, "logit_std"),
        ({"shift": -1.0}, "shift"),
        ({"image_size": 0}, "image_size"),
        ({"data": ""}, "data"),
    ],
)
def test_bad_settings_name_their_key(settings, key):
    values = {"data": "pairs.jsonl", **settings}
    with pytest.raises(ConfigError, match=key) as error:
        OBJECTIVES.build("flow_matching", **values)
    assert error.value.key == key


def test_validation_reads_no_file_and_start_up_names_the_missing_dataset(tmp_path):
    missing = tmp_path / "nowhere" / "pairs.jsonl"
    obj = OBJECTIVES.build("flow_matching", data=str(missing))  # validation: no file read
    with pytest.raises(SetupError, match=f"data = {str(missing)!r}.*does not exist"):
        obj.start_up()
    with pytest.raises(SetupError, match="has no metadata.jsonl"):
        OBJECTIVES.build("flow_matching", data=str(tmp_path)).start_up()


def test_units_per_iteration_must_split_evenly(model, toy_data):
    with pytest.raises(ValueError, match="units_per_iteration = 3 must be a multiple of the number of processes"):
        objective(toy_data, units_per_iteration=3).units(0, context(model, 0, 0, 2))


# --- the dataset reader --------------------------------------------------------------------------------------------
def test_toy_dataset_round_trips_through_the_reader(toy_data):
    records = read_records(toy_data)
    assert len(records) == 6 and all(r.image.is_file() and r.prompt.startswith("a photo of") for r in records)
    index = toy_data / "metadata.jsonl"
    assert [r.prompt for r in read_records(index)] == [r.prompt for r in records]  # the file or its folder
    images, prompts = ImageCaptionDataset(toy_data, 32).batch([0, 5])
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert 0 <= images.min() and images.max() <= 1 and prompts == [records[0].prompt, records[5].prompt]
    # Toy renders are flat palette colours on the grey background, loaded pixel for pixel at their own size.
    assert torch.isclose(images, torch.tensor(128 / 255)).any()


def test_images_are_resized_to_cover_and_centre_cropped(toy_data):
    image = read_records(toy_data)[0].image
    assert load_image(image, (16, 24)).shape == (3, 16, 24)
    assert load_image(image, 48).shape == (3, 48, 48)
    assert torch.equal(load_image(image, 32), ImageCaptionDataset(toy_data, 32).image(0))


def write_index(tmp_path, lines):
    index = tmp_path / "pairs.jsonl"
    index.write_text("\n".join(lines) + "\n")
    return index


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a red circle"}', "missing key 'image'"),
        ('{"image": "images/00000.png"}', "missing key 'prompt'"),
        ('{"image": "images/00000.png", "prompt": 3}', "'prompt' must be a non-empty string"),
        ('{"image": "images/nope.png", "prompt": "a red circle"}', "image 'images/nope.png' not found"),
        ('{"image": "images/00000.png", "prompt": "a red circle"', "not valid JSON"),
        ('["images/00000.png", "a red circle"]', "expected an object"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(toy_data, line, message):
    good = json.dumps({"image": "images/00000.png", "prompt": "a photo of a circle"})
    index = write_index(toy_data, [good, "", line])
    try:
        with pytest.raises((ValueError, FileNotFoundError), match=f"{index}:3: {message}".replace("[", r"\[")):
            read_records(index)
        with pytest.raises(SetupError, match=f"{index}:3"):
            OBJECTIVES.build("flow_matching", data=str(index)).start_up()
    finally:
        index.unlink()


def test_unreadable_image_is_named(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    index = write_index(tmp_path, [json.dumps({"image": "broken.png", "prompt": "a red circle"})])
    with pytest.raises(ValueError, match=f"{index}:1: cannot read image .*broken.png"):
        ImageCaptionDataset(index, 32).image(0)


def test_empty_index_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="has no entries"):
        read_records(write_index(tmp_path, [""]))


def test_cond_rows_are_one_per_sample(model, toy_data):
    unit = objective(toy_data, batch_size=3).units(0, context(model))[0]
    assert isinstance(unit.cond, Cond) and len(unit.cond) == len(unit) == 3


def test_the_toy_dataset_is_the_exact_keyed_render_of_each_training_prompt():
    from flowalign.data.images import TOY_DATA_SEED, ToySceneDataset, check_image_dataset, open_image_dataset
    from flowalign.seeding import numpy_rng
    from flowalign.toy.prompts import split_prompts
    from flowalign.toy.scenes import render, scene_for

    train, _ = split_prompts()
    data = open_image_dataset("toy:2", 32)
    assert isinstance(data, ToySceneDataset) and len(data) == 2 * len(train)
    row = len(train) + 5  # the second render of prompt 5
    images, prompts = data.batch([5, row])
    assert prompts == [train[5]["prompt"]] * 2
    expected = render(scene_for(train[5], numpy_rng(TOY_DATA_SEED, row), 32), 32)
    assert torch.equal(images[1], torch.from_numpy(expected).permute(2, 0, 1).float() / 255)
    assert not torch.equal(images[0], images[1])  # another layout of the same prompt
    assert torch.equal(open_image_dataset("toy", 32).image(row), images[1])  # keyed by row, not by dataset size
    check_image_dataset("toy")  # no file to read
    for bad in ("toy:0", "toy:x"):
        with pytest.raises(ValueError, match="'toy' or 'toy:N'"):
            check_image_dataset(bad)
    with pytest.raises(ValueError, match="square"):
        ToySceneDataset((32, 48))


def test_flow_matching_trains_on_the_toy_scenes_without_a_file(model):
    obj = objective("toy")
    obj.start_up()
    unit = obj.units(0, context(model))[0]
    dataset = obj.dataset(context(model))
    rows = unit.data["rows"].tolist()
    images, _ = dataset.batch(rows)
    x0 = model.encode_images(images, dtype=torch.float32)
    torch.testing.assert_close(unit.data["x0"], x0, rtol=0, atol=0)


def test_an_objective_regresses_the_conditional_velocity_when_the_rollouts_use_cfg(tiny_paths, tmp_path):
    """GRPO with CFG'd rollouts (sampling.guidance_scale 3) plus flow_matching on data: the objective's loss is the
    MSE of the conditional velocity (its units carry no negative embeddings; a CFG'd velocity is not its target)."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    config = load_config(TrainConfig, None, small_run(
        tiny_paths["sd3"], tmp_path / "run", **{"sampling.guidance_scale": 3.0, "train.iterations": 1,
                                                "objectives.flow_matching.data": "toy",
                                                "objectives.flow_matching.batch_size": 2}))
    trainer = Trainer(config)
    unit = trainer.objective_units(0)["flow_matching"][0]
    with torch.no_grad():
        v = trainer.model.velocity(unit.x, unit.sigma, unit.cond, 1.0)
    _, stats = trainer.objective_loss("flow_matching", unit)
    expected = (v.float() - unit.data["target"].float()).pow(2).mean()
    assert stats["loss"] == pytest.approx(float(expected), rel=1e-5)
    objective = trainer.parts.objectives["flow_matching"]
    assert objective.guidance_scale == 1.0  # the objective declares the scale its units are evaluated at
    objective.guidance_scale = 3.0  # an objective declaring CFG is evaluated with it: its units hold no negatives
    with pytest.raises(ValueError, match=r"guidance_scale=3\.0 needs negative prompt embeddings"):
        trainer.objective_loss("flow_matching", unit)
