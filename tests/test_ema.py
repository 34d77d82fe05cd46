"""The EMA of named parameters (flowalign.training.ema): hand-computed updates, its state, placement and the swap."""

import pytest
import torch

from flowalign.training.ema import EMA


def params(*values, dtype=torch.float32):
    return {f"w{i}": torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for i, v in enumerate(values)}


def test_two_updates_by_hand():
    named = params([1.0, 2.0], [-4.0])
    ema = EMA(named, decay=0.75)  # avg <- avg + 0.25 (param - avg), exact in binary
    assert all(torch.equal(ema.state_dict()[n], p) for n, p in named.items())  # starts as a copy
    with torch.no_grad():
        named["w0"].copy_(torch.tensor([3.0, 6.0]))
        named["w1"].copy_(torch.tensor([4.0]))
    ema.update()
    assert ema.state_dict()["w0"].tolist() == [1.5, 3.0] and ema.state_dict()["w1"].tolist() == [-2.0]
    with torch.no_grad():
        named["w0"].copy_(torch.tensor([5.0, -1.0]))
    ema.update()  # w1 did not move: its average keeps going toward 4
    assert ema.state_dict()["w0"].tolist() == [1.5 + 0.25 * 3.5, 3.0 + 0.25 * -4.0] == [2.375, 2.0]
    assert ema.state_dict()["w1"].tolist() == [-2.0 + 0.25 * 6.0] == [-0.5]
    assert named["w0"].tolist() == [5.0, -1.0]  # the parameters are only read


def test_an_update_is_lerp_with_weight_one_minus_decay_bitwise():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        live = torch.nn.Parameter(torch.randn(64, dtype=dtype))
        ema = EMA({"w": live}, decay=0.9)
        expected = live.detach().clone()
        for _ in range(3):
            with torch.no_grad():
                live.add_(torch.randn(64, dtype=dtype))
            ema.update()
            expected.lerp_(live.detach(), 1 - 0.9)  # the trainer's update before EMA was a module
        assert ema.state_dict()["w"].dtype == dtype
        assert torch.equal(ema.state_dict()["w"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_the_state_round_trips_and_is_copied_in():
    a = EMA(params([1.0, 2.0], [3.0]), decay=0.5)
    with torch.no_grad():
        a.params["w0"].fill_(5.0)
    a.update()
    state = {n: t.clone() for n, t in a.state_dict().items()}
    b = EMA(params([0.0, 0.0], [0.0]), decay=0.5)
    b.load_state_dict(state)
    assert b.state_dict()["w0"].tolist() == [3.0, 3.5] and b.state_dict()["w1"].tolist() == [3.0]
    state["w0"].zero_()  # loading copied: the source can change
    assert b.state_dict()["w0"].tolist() == [3.0, 3.5]
    assert all(b.state_dict()[n] is not b.params[n] for n in b.params)


def test_a_state_with_other_names_is_refused():
    ema = EMA(params([1.0], [2.0]), decay=0.5)
    with pytest.raises(ValueError, match=r"missing \['w1'\], unexpected \['x'\]"):
        ema.load_state_dict({"w0": torch.zeros(1), "x": torch.zeros(1)})
    assert ema.state_dict()["w0"].tolist() == [1.0]  # unchanged


def test_a_loaded_state_sits_on_each_parameters_device_and_dtype():
    named = params([1.0, 2.0], [3.0])
    ema = EMA(named, decay=0.5)
    named["w0"].data = named["w0"].data.double()  # a parameter cast after the EMA was made (CUDA runs: bf16)
    ema.load_state_dict({"w0": torch.tensor([0.5, 0.25]), "w1": torch.tensor([7.0])})  # an fp32 CPU file
    assert ema.state_dict()["w0"].dtype == torch.float64 and ema.state_dict()["w1"].dtype == torch.float32
    ema.update()  # lerp_ of mismatched dtypes would raise
    assert ema.state_dict()["w0"].tolist() == [0.75, 1.125] and ema.state_dict()["w1"].tolist() == [5.0]
    elsewhere = EMA({"w": torch.nn.Parameter(torch.empty(2, device="meta", dtype=torch.bfloat16))}, decay=0.5)
    elsewhere.load_state_dict({"w": torch.ones(2)})  # another device than the file's, as CUDA is
    assert elsewhere.state_dict()["w"].device.type == "meta" and elsewhere.state_dict()["w"].dtype == torch.bfloat16


def test_swap_in_and_back_restores_the_live_weights_bitwise():
    live = [0.1, -0.0, 1e-40, -3.25]  # a signed zero and a subnormal: their bits must come back too
    named = params(live, [2.0])
    ema = EMA(named, decay=0.5)
    with torch.no_grad():
        named["w0"].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    ema.update()
    bits = {n: p.detach().clone().view(torch.int32) for n, p in named.items()}
    with ema.swapped_in():
        assert all(torch.equal(p, ema.state_dict()[n]) for n, p in named.items())
    assert all(torch.equal(p.detach().view(torch.int32), bits[n]) for n, p in named.items())
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped_in():
            raise RuntimeError("inside")
    assert all(torch.equal(p.detach().view(torch.int32), bits[n]) for n, p in named.items())


def test_the_decay_must_be_in_zero_one():
    for decay in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"EMA decay must be in \[0, 1\)"):
            EMA(params([1.0]), decay=decay)
