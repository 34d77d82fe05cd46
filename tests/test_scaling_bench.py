"""bench/scaling.py: the power-law fit on hand-computed points, its table, and one real measured point."""

import json
import math
from pathlib import Path

import pytest

from conftest import module_from_file

REPO = Path(__file__).resolve().parents[1]
scaling = module_from_file("bench_scaling", REPO / "bench" / "scaling.py")


def test_the_exponent_is_the_slope_of_a_power_law_on_log_log_axes():
    assert scaling.exponent([(1, 3.0), (2, 12.0), (4, 48.0)]) == pytest.approx(2.0, abs=1e-12)  # 3 x^2
    assert scaling.exponent([(10, 5.0), (1000, 0.05)]) == pytest.approx(-1.0, abs=1e-12)  # 50 / x
    # a fixed part: cost = 1 + x; by hand, the slope between x = 2 and 4 is log(5/3) / log(2)
    with_fixed = [(1, 2.0), (2, 3.0), (4, 5.0)]
    assert scaling.exponent(with_fixed[-2:]) == pytest.approx(math.log(5 / 3) / math.log(2), abs=1e-12)
    assert 0 < scaling.exponent(with_fixed) < scaling.exponent(with_fixed[-2:]) < 1
    assert scaling.exponent([(1, 2.0)]) is None and scaling.exponent([(3, 1.0), (3, 2.0)]) is None


def row(axis, point, work, seconds, memory, phases=(0.5, 0.1, 0.4)):
    return {"axis": axis, "point": point, "work": work, "seconds": seconds, "iteration_memory": memory, "flops": 4e9 * work,
            "peak_rss": [m + 900 * 2**20 for m in memory], "rss_before": [900 * 2**20] * len(memory),
            "phases": dict(zip(("time/rollout", "time/reward", "time/train"), phases))}


def test_the_cpu_attention_kernels_are_counted_as_their_matrix_products():
    """Forward ``QK^T`` and ``PV``: 2 x 2 B H S^2 D; backward: the scores again and four products, 5 x 2 B H S^2 D."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    b, h, s, d = 2, 3, 40, 8
    query, key, value = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False, custom_mapping=scaling.attention_formulas()) as counter:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
        forward = counter.get_total_flops()
        out.sum().backward()
    assert forward == 4 * b * h * s * s * d
    assert counter.get_total_flops() == forward + 10 * b * h * s * s * d
    with FlopCounterMode(display=False) as plain:  # what torch's counter alone sees on the CPU: nothing
        torch.nn.functional.scaled_dot_product_attention(query, key, value).sum().backward()
    assert plain.get_total_flops() == 0


def test_fits_and_the_table_per_axis():
    rows = [row("steps", 8, 8, 1.0, [2**20]), row("steps", 16, 16, 2.0, [2**20], (1.0, 0.1, 0.4)),
            row("steps", 32, 32, 4.0, [2**20], (2.0, 0.1, 0.4)),
            row("processes", 1, 1, 2.0, [4 * 2**20]), row("processes", 2, 2, 1.0, [2**21, 2**21]),
            {"axis": "width", "point": 4, "error": "width=4 failed (exit 1):"}]
    fits = scaling.fits(rows)
    assert set(fits) == {"steps", "processes"}  # width's one failed point fits nothing
    assert fits["steps"]["time"] == pytest.approx(1.0) and fits["steps"]["rollout"] == pytest.approx(1.0)
    assert fits["steps"]["train"] == pytest.approx(0.0) and fits["steps"]["memory"] == pytest.approx(0.0)
    assert fits["processes"]["time"] == pytest.approx(-1.0)  # half the time on two processes: perfect
    assert fits["processes"]["memory"] == pytest.approx(0.0)  # the processes' memory summed
    for counted in rows[:3]:  # the steps were measured with attention in the count, the processes before it was
        counted["attention_counted"] = True
    text = scaling.table(rows, fits)
    assert fits["steps"]["flops"] == pytest.approx(1.0)
    assert "| processes | 2 | 2 | 1.00 | 0.50 / 0.10 / 0.40 | 8.0 † | 8.0 | 902 + 902 | 2 + 2 |" in text
    assert "| steps | 8 | 8 | 1.00 | 0.50 / 0.10 / 0.40 | 32.0 | 32.0 | 901 | 1 |" in text
    assert "| width | 4 | failed: width=4 failed (exit 1): |" in text
    assert "| steps | sampling steps | 1.00 | 1.00 | 1.00 | 0.00 | 0.00 | 1.00 | 0.00 | 0.00 |" in text
    assert "| processes | processes (same global work) | -1.00 | -1.00 | 0.00 | 0.00 | 0.00 | 1.00 † |" in text
    assert text.endswith("† without attention: measured before `bench/scaling.py` counted the CPU attention kernels.")
    assert "†" not in scaling.table(rows[:3], scaling.fits(rows[:3]))


def test_merging_keeps_the_axes_not_measured_again_in_the_axes_order():
    earlier = [row("group_size", 4, 4, 1.0, [1]), row("steps", 5, 5, 1.0, [1]), row("steps", 10, 10, 2.0, [1]),
               row("width", 4, 4, 1.0, [1])]
    again = [row("steps", 5, 5, 3.0, [1]), row("steps", 10, 10, 6.0, [1])]
    rows = scaling.merged(earlier, again)
    assert [(r["axis"], r["point"], r["seconds"]) for r in rows] == [
        ("group_size", 4, 1.0), ("steps", 5, 3.0), ("steps", 10, 6.0), ("width", 4, 1.0)]


def test_a_wider_toy_transformer_keeps_the_toys_config_but_the_changed_keys(tmp_path):
    from diffusers import SD3Transformer2DModel

    toy = json.loads((REPO / "assets/toy-sd3/transformer/config.json").read_text())
    scaling.toy_variant(tmp_path / "wide", num_attention_heads=6, num_layers=5)
    wide = SD3Transformer2DModel.from_pretrained(tmp_path / "wide", subfolder="transformer")
    assert (wide.config.num_attention_heads, wide.config.num_layers, wide.config.caption_projection_dim) == (6, 5, 192)
    unchanged = {k: v for k, v in toy.items() if not k.startswith("_") and k not in
                 ("num_attention_heads", "num_layers", "caption_projection_dim")}
    assert {k: wide.config[k] for k in unchanged} == {k: (list(v) if isinstance(v, tuple) else v)
                                                      for k, v in unchanged.items()}


def test_one_point_runs_real_iterations_in_a_process_of_its_own(tmp_path):
    measured = scaling.measure("group_size", 2, 2, tmp_path)
    assert len(measured["all_seconds"]) == 2 and measured["seconds"] == measured["all_seconds"][1] > 0
    assert measured["phases"]["time/rollout"] > 0 and measured["phases"]["time/train"] > 0  # it trained
    assert measured["work"] == 2 and measured["transformer_parameters"] > 10**6
    assert 1e9 < measured["flops"] < 1e12  # counted: the transformer's forwards and backward, the VAE, the reward
    before, peak = measured["rss_before"][0], measured["peak_rss"][0]
    assert peak >= before > 100 * 2**20 and measured["iteration_memory"] == [peak - before]
