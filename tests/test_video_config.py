"""A run's video settings are refused before any model loads, naming the key and the fix
(``flowalign.training.video_checks``): frames on an image model, a frame count the family's VAE cannot take, an
image-to-video family without condition images, objectives on image-caption pairs on a video model, and a layout
whose latents per micro-batch exceed ``sampling.max_latent_elements``.

The models here are pipeline directories holding only their config files (``model_index.json`` and each
component's ``config.json``), no weights: a check that ran after loading would fail on the missing weights instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flowalign.config import ConfigError, load_config
from flowalign.errors import SetupError
from flowalign.models import WanModel
from flowalign.models.base import MODEL_FAMILIES
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import small_run_values
from video_families import tiny_video_pipeline

REPO = Path(__file__).resolve().parents[1]


def configs_only(pipe, folder: Path) -> Path:
    """``pipe`` saved, then every weight file removed: a model directory whose weights cannot load."""
    pipe.save_pretrained(folder)
    for path in list(folder.rglob("*")):
        if path.is_file() and path.name != "model_index.json" and not path.name.endswith(".json"):
            path.unlink()
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from model_families import WORDS

    root = tmp_path_factory.mktemp("configs-only")
    return {"wan": configs_only(tiny_video_pipeline("wan"), root / "wan"),
            "sd3": configs_only(tiny_sd3_pipeline(WORDS, seed=0), root / "sd3")}


def refused(model: Path, tmp_path: Path, error_type: type = ConfigError, **extra) -> Exception:
    values = {**small_run_values(model, tmp_path / "run"), "reward.rewards": "[{name: video_brightness}]",
              "sampling.image_size": 16, **extra}
    config = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(error_type) as error:
        Trainer(config)
    return error.value


def test_the_models_here_cannot_load(models):
    from flowalign.models import load_flow_model

    assert not list(models["wan"].rglob("*.safetensors")) and (models["wan"] / "vae" / "config.json").is_file()
    with pytest.raises(Exception):
        load_flow_model(models["wan"])


@pytest.mark.parametrize("key,value", [("sampling.num_frames", 5), ("model.vae_batch", 2),
                                       ("model.vae_tiling", "true")])
def test_video_settings_on_an_image_model_are_refused(models, tmp_path, key, value):
    error = refused(models["sd3"], tmp_path, **{key: value, "sampling.image_size": 32})
    assert error.key == key
    assert f"{key} = " in str(error) and "is for video models" in str(error) and "SD3Model" in str(error)
    assert f"drop {key}" in str(error)


@pytest.mark.parametrize("frames,fix", [(6, "5 or 9"), (4, "1 or 5"), (12, "9 or 13")])
def test_a_frame_count_the_vae_cannot_take_is_refused_with_the_nearest_valid_counts(models, tmp_path, frames, fix):
    error = refused(models["wan"], tmp_path, **{"sampling.num_frames": frames})
    assert error.key == "sampling.num_frames"
    assert f"sampling.num_frames = {frames}" in str(error) and "4k+1" in str(error)
    assert f"set sampling.num_frames to {fix}" in str(error)


def test_an_image_to_video_family_without_condition_images_is_refused(models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red circle moving up"}) + "\n")
    error = refused(models["wan"], tmp_path, SetupError, **{"model.family": "wan_i2v", "sampling.num_frames": 5,
                                                 "data.train_prompts": str(prompts)})
    assert "model family 'wan_i2v' generates each video from a condition image" in str(error)
    assert "'a red circle moving up' has none" in str(error) and '"images": [path]' in str(error)


def test_a_text_to_video_family_requires_no_condition_images():
    assert WanModel.requires_condition_images is False
    assert not any(MODEL_FAMILIES.get(n).requires_condition_images for n in MODEL_FAMILIES
                   if not MODEL_FAMILIES.get(n).takes_condition_images)


@pytest.mark.parametrize("preset,key", [("sft", "objectives.flow_matching.data"), ("soar", "objectives.soar.data")])
def test_objectives_on_image_caption_pairs_are_refused_on_a_video_model(models, tmp_path, preset, key):
    values = {**small_run_values(models["wan"], tmp_path / "run"), "reward.rewards": "[{name: video_brightness}]",
              "sampling.image_size": 16}
    config = load_config(TrainConfig, REPO / f"configs/methods/{preset}.yaml",
                         [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(ConfigError) as error:
        Trainer(config)
    assert error.value.key == key
    assert "no video data source yet" in str(error.value) and f"drop {key.rsplit('.', 1)[0]}" in str(error.value)


# The tiny Wan: 4 latent channels, 5 frames -> 2 latent frames, 16 px / 4 -> 4 x 4: 128 latent elements per video;
# a micro-batch of sampling.batch_size = 2 videos holds 256.
@pytest.mark.parametrize("budget,frames,size,message", [
    (255, 5, 16, "a micro-batch of 2 videos (sampling.batch_size) of sampling.num_frames = 5 frames at "
                 "sampling.image_size = 16 holds 2 x 128 = 256 latent elements (4 channels x 2 latent frames x 4 x 4): "
                 "lower sampling.batch_size to at most 1"),
    (256, 9, 16, "holds 2 x 192 = 384 latent elements (4 channels x 3 latent frames x 4 x 4)"),
    (600, 5, 32, "holds 2 x 512 = 1024 latent elements (4 channels x 2 latent frames x 8 x 8)"),
    (100, 5, 16, "one video of sampling.num_frames = 5 frames at sampling.image_size = 16 holds 128 latent elements, "
                 "over the budget"),
])
def test_a_layout_over_the_latent_budget_is_refused_naming_the_keys(models, tmp_path, budget, frames, size, message):
    error = refused(models["wan"], tmp_path, **{"sampling.max_latent_elements": budget, "sampling.num_frames": frames,
                                                 "sampling.image_size": size})
    assert error.key == "sampling.max_latent_elements"
    assert f"sampling.max_latent_elements = {budget}" in str(error) and message in str(error)


def test_a_layout_at_the_budget_gets_past_the_checks_to_the_model(models, tmp_path):
    """256 elements fit a budget of 256: the run goes on to load the model, whose weights are missing here."""
    values = {**small_run_values(models["wan"], tmp_path / "run"), "reward.rewards": "[{name: video_brightness}]",
              "sampling.image_size": 16, "sampling.num_frames": 5, "sampling.max_latent_elements": 256}
    config = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(Exception) as error:
        Trainer(config)
    assert not isinstance(error.value, ConfigError), error.value


def test_an_objectives_own_batch_counts_against_the_budget(models, tmp_path):
    error = refused(models["wan"], tmp_path, **{"sampling.max_latent_elements": 300, "sampling.num_frames": 5,
                                                 "objectives.awm.batch_size": 4})
    assert "a micro-batch of 4 videos (objectives.awm.batch_size)" in str(error)
    assert "lower objectives.awm.batch_size to at most 2" in str(error)


def test_the_budget_is_a_positive_integer():
    with pytest.raises(ConfigError, match="sampling.max_latent_elements"):
        load_config(TrainConfig, None, ["sampling.max_latent_elements=0"])
    with pytest.raises(ConfigError, match="model.vae_batch"):
        load_config(TrainConfig, None, ["model.vae_batch=0"])


@pytest.mark.parametrize("method", ["default", "flow_grpo_fast"])
def test_the_video_benchmarks_train_command_resolves_to_the_main_job_with_the_methods_preset(method, tmp_path):
    """bench/video_runs.py's command line of one run resolves (``--print-config``, nothing loads) to the video main
    job's settings with the run's seed, iterations and folder, and the method's own objective or loss."""
    import subprocess
    import sys

    import yaml

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import video_runs
    finally:
        sys.path.remove(str(REPO / "bench"))
    command = video_runs.train_command(method, 2, 7, tmp_path)
    result = subprocess.run([*command, "--print-config"], cwd=REPO, capture_output=True, text=True, check=True)
    config = yaml.safe_load(result.stdout)
    main_job = yaml.safe_load((REPO / "configs/video/default.yaml").read_text())
    assert config["train"]["seed"] == 2 and config["train"]["iterations"] == 7
    assert config["train"]["out_dir"] == str(tmp_path / f"{method}-seed2") and config["train"]["tracker"] == "none"
    assert config["reward"]["rewards"][0]["kwargs"] == main_job["reward"]["rewards"][0]["kwargs"]
    assert config["data"]["group_size"] == main_job["data"]["group_size"]
    assert config["optim"]["lr"] == main_job["optim"]["lr"]
    if method == "default":
        assert config["objectives"]["diffusion_nft"]["kl_beta"] == main_job["objectives"]["diffusion_nft"]["kl_beta"]
    else:
        assert config["sampling"]["window_size"] == 2 and not config.get("objectives")
