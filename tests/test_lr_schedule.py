import math

import pytest

from flowalign.lr_schedule import learning_rate_scale


def test_warmup_then_constant():
    assert [learning_rate_scale(s, 100, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert learning_rate_scale(99, 100) == 1.0


def test_cosine_falls_from_one_to_the_floor():
    assert learning_rate_scale(0, 100, warmup=10, schedule="cosine") == 0.1
    assert learning_rate_scale(10, 100, warmup=10, schedule="cosine") == 1.0
    assert learning_rate_scale(55, 100, warmup=10, schedule="cosine") == pytest.approx(0.5)
    assert abs(learning_rate_scale(100, 100, warmup=10, schedule="cosine")) < 1e-12
    floor = 0.2
    assert learning_rate_scale(100, 100, schedule="cosine", floor=floor) == pytest.approx(floor)
    assert learning_rate_scale(25, 100, schedule="cosine", floor=floor) == pytest.approx(
        floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / 4)))


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="'linear'"):
        learning_rate_scale(0, 10, schedule="linear")
