"""Checkpoint files: an exact round trip of optimizer and RNG states, and no code runs from a crafted pickle."""

import random
import re

import numpy as np
import pytest
import torch

from flowalign.serialization import safe_load
from flowalign.training.checkpoint_files import (load_checkpoint, rng_state, save_checkpoint, save_process_rng,
                                                 set_rng_state)
from flowalign.reward_models.latent_registers import LatentRegisters, load_registers


class CodePayload:
    """Unpickling this runs code: it writes ``marker``. A safe loader must refuse it before that happens."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the payload ran')",)


def trained_linear(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(2):
        layer(torch.randn(4, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return layer, optimizer


def save(tmp_path, layer, optimizer):
    trainable = dict(layer.named_parameters())
    return save_checkpoint(tmp_path / "run", 1, trainable=trainable, optimizer=optimizer, state={}, config_yaml="")


def draws():
    """The next value of every RNG a run uses."""
    return random.random(), float(np.random.random_sample()), float(np.random.standard_normal()), torch.rand(3)


def assert_same_optimizer_state(a: dict, b: dict):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert a["state"][key].keys() == b["state"][key].keys()
        for name, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


def test_save_then_load_restores_weights_optimizer_and_every_rng_exactly(tmp_path):
    layer, optimizer = trained_linear()
    expected_optimizer = optimizer.state_dict()
    expected_weights = {k: v.detach().clone() for k, v in layer.named_parameters()}
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # numpy caches the second gaussian of a pair: that is part of its state too
    checkpoint = save(tmp_path, layer, optimizer)
    expected_draws = draws()

    fresh, fresh_optimizer = trained_linear(seed=1)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_checkpoint(checkpoint, trainable=dict(fresh.named_parameters()), optimizer=fresh_optimizer)
    assert all(torch.equal(p, expected_weights[k]) for k, p in fresh.named_parameters())
    assert_same_optimizer_state(fresh_optimizer.state_dict(), expected_optimizer)
    again = draws()
    assert again[:3] == expected_draws[:3] and torch.equal(again[3], expected_draws[3])


def test_rng_state_round_trips_through_a_file_exactly(tmp_path):
    np.random.seed(11), np.random.standard_normal()
    state = rng_state()
    (tmp_path / "checkpoint-000001").mkdir()
    save_process_rng(tmp_path / "checkpoint-000001", rank=1)
    loaded = safe_load(tmp_path / "checkpoint-000001" / "rng-1.pt", "RNG states")
    assert loaded["python"] == state["python"] and torch.equal(loaded["torch"], state["torch"])
    assert loaded["numpy"]["keys"].dtype == torch.int64 and torch.equal(loaded["numpy"]["keys"], state["numpy"]["keys"])
    before = np.random.get_state()
    np.random.seed(0)
    set_rng_state(loaded)
    after = np.random.get_state()
    assert after[0] == before[0] and np.array_equal(after[1], before[1]) and after[2:] == before[2:]


def test_an_rng_file_of_the_earlier_format_still_loads(tmp_path):
    """Checkpoints written before numpy's state was stored as a tensor hold numpy's own (ndarray) tuple."""
    layer, optimizer = trained_linear()
    checkpoint = save(tmp_path, layer, optimizer)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               checkpoint / "rng-0.pt")
    expected = draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_checkpoint(checkpoint, trainable=dict(layer.named_parameters()), optimizer=optimizer)
    again = draws()
    assert again[:3] == expected[:3] and torch.equal(again[3], expected[3])


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy-pickle"])
@pytest.mark.parametrize("target", ["optimizer.pt", "rng-0.pt"])
def test_a_checkpoint_file_carrying_code_is_refused_and_the_code_never_runs(tmp_path, target, zipfile):
    layer, optimizer = trained_linear()
    checkpoint = save(tmp_path, layer, optimizer)
    marker = tmp_path / "payload-ran"
    crafted = {"state": {}, "param_groups": [CodePayload(marker)]} if target == "optimizer.pt" else \
        {"python": CodePayload(marker), "numpy": None, "torch": torch.get_rng_state()}
    torch.save(crafted, checkpoint / target, _use_new_zipfile_serialization=zipfile)
    refused = rf"refusing to load '{re.escape(str(checkpoint / target))}'.*could run code"
    with pytest.raises(ValueError, match=refused) as info:
        load_checkpoint(checkpoint, trainable=dict(layer.named_parameters()), optimizer=optimizer)
    assert "exec" in str(info.value)  # the reason names what the file asked for
    assert not marker.exists()


def test_a_register_checkpoint_carrying_code_is_refused_and_the_code_never_runs(tmp_path, sd3_pipe):
    registers = LatentRegisters.for_transformer(sd3_pipe.transformer, num_registers=4, width=32)
    path = registers.save(tmp_path / "registers.pt", extra={"history": [{"iteration": 0, "loss": 0.5}]})
    assert load_registers(path).settings == registers.settings  # a real one loads
    marker = tmp_path / "payload-ran"
    blob = torch.load(path, weights_only=True)
    blob["extra"] = {"history": CodePayload(marker)}
    torch.save(blob, path)
    with pytest.raises(ValueError, match=rf"refusing to load '{re.escape(str(path))}'.*as a register checkpoint does"):
        load_registers(path)
    assert not marker.exists()
