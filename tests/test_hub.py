"""Every export writes a model card (README.md) that says what the weights are; ``flowalign export --push-to-hub``
uploads the export through huggingface_hub, here to a real HTTP hub on 127.0.0.1 (``tests/hub_server.py``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flowalign.config import load_config
from flowalign.export import export_lora
from flowalign.model_card import training_method
from flowalign.training.config import TrainConfig
from hub_server import HubServer
from short_runs import REPO, finish_short_run, save_tiny_model

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model = save_tiny_model(root / "tiny-sd3")
    finish_short_run(model, root / "run")
    return {"model": model, "run": root / "run", "checkpoint": root / "run" / "checkpoint-000001"}


def front_matter_and_body(card: str) -> tuple[dict, str]:
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", card, re.DOTALL)
    assert match, card[:200]
    return yaml.safe_load(match.group(1)), match.group(2)


def code_block(body: str, language: str, after: str) -> str:
    return re.search(rf"{re.escape(after)}.*?```{language}\n(.*?)\n```", body, re.DOTALL).group(1)


def test_an_export_writes_a_model_card_that_says_what_the_weights_are(finished_run, tmp_path):
    checkpoint, model = finished_run["checkpoint"], str(finished_run["model"])
    out = export_lora(checkpoint, tmp_path / "export")
    front, body = front_matter_and_body((out / "README.md").read_text())
    # license fields (the tiny base model has no card: "other", and the card asks for the base model's license)
    assert front["license"] == "other" and front["library_name"] == "diffusers" and "lora" in front["tags"]
    assert "base_model" not in front  # a local directory is no hub id
    assert "set the `license` fields above" in body
    # the base model, the method and its paper, the rewards
    assert f"# Flow-GRPO fine-tune of {model}" in body and f"`{model}` (a local directory)" in body
    assert "[arXiv:2505.05470](https://arxiv.org/abs/2505.05470)" in body
    assert "[yifan123/flow_grpo](https://github.com/yifan123/flow_grpo)" in body
    assert "| `brightness` | 1.0 | - |" in body
    # the measured before/after: the run's own table, which read these (EMA) weights
    assert (finished_run["run"] / "eval" / "before_after.md").read_text().strip() in body
    assert "(ema weights)" in body
    # the training config, whole
    assert yaml.safe_load(code_block(body, "yaml", "## Training config")) == yaml.safe_load(
        (checkpoint / "config.yaml").read_text())
    # the loading snippet runs in plain diffusers and gives an image
    snippet = code_block(body, "python", "## Use with diffusers")
    assert f'pipe.load_lora_weights("{out}")' in snippet
    scope = {}
    quick = re.sub(r'pipe\((".*?")\)\.images', r'pipe(\1, num_inference_steps=2, height=32, width=32).images', snippet)
    exec(quick, scope)  # two steps at 32 px: the loading is the point
    assert scope["image"].size == (32, 32)
    assert any(name.startswith("transformer") for name in scope["pipe"].get_list_adapters())


def test_a_card_says_when_the_runs_evaluation_did_not_read_these_weights(finished_run, tmp_path):
    out = export_lora(finished_run["checkpoint"], tmp_path / "last", weights="last", license="apache-2.0")
    front, body = front_matter_and_body((out / "README.md").read_text())
    assert "Not measured for these weights" in body and "| tag | before |" not in body
    assert front["license"] == "apache-2.0" and "bound by its license: `apache-2.0`" in body


@pytest.mark.parametrize("preset, method, arxiv", [
    ("configs/default.yaml", "DiffusionNFT", "2509.16117"),
    ("configs/methods/flow_grpo_fast.yaml", "Flow-GRPO", "2505.05470"),
    ("configs/methods/branch_grpo.yaml", "BranchGRPO", "2509.06040"),
    ("configs/methods/tempflow_grpo.yaml", "TempFlow-GRPO", "2508.04324"),
    ("configs/methods/awm.yaml", "AWM (Advantage Weighted Matching)", "2509.25050"),
])
def test_the_card_names_the_method_of_the_preset(preset, method, arxiv):
    from flowalign.config import to_dict

    found = training_method(to_dict(load_config(TrainConfig, REPO / preset, [])))
    assert (found.name, found.arxiv) == (method, arxiv)


def test_export_pushes_the_folder_with_its_card_to_the_hub(finished_run, tmp_path):
    out = tmp_path / "export"
    env = {**os.environ, "HF_TOKEN": "hf_test_token", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
    with HubServer() as hub:
        env["HF_ENDPOINT"] = hub.url
        done = subprocess.run([str(BIN / "flowalign"), "export", str(finished_run["checkpoint"]), "--out", str(out),
                               "--push-to-hub", "me/toy-lora", "--private"], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    state = hub.state
    assert state.unexpected == []
    assert state.created == [{"name": "toy-lora", "organization": "me", "visibility": "private", "type": "model"}]
    assert state.tokens == {"Bearer hf_test_token"}
    written = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert set(written) == {"README.md", "flowalign_export.json", "pytorch_lora_weights.safetensors"}
    assert state.files == {"me/toy-lora": written}  # every file, byte for byte, in one commit
    assert len(state.commits) == 1 and state.lfs_paths == {"pytorch_lora_weights.safetensors"}  # the weights by LFS
    assert state.cards and set(state.cards) == {written["README.md"].decode()}  # validated before the upload
    assert 'pipe.load_lora_weights("me/toy-lora")' in written["README.md"].decode()  # the snippet reads the hub
    assert f"pushed {out} to {hub.url}/me/toy-lora/commit/" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--push-to-hub", "no repo id"], "is not a hub repository id: give OWNER/NAME"),
    (["--private"], "--private makes the repository of --push-to-hub private"),
])
def test_a_bad_hub_request_is_refused_before_the_model_loads(finished_run, tmp_path, capsys, argv, message):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["export", str(finished_run["checkpoint"]), "--out", str(tmp_path / "x"), *argv])
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
