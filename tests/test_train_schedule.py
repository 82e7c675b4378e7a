"""The warmup-stable-decay learning-rate multiplier (design §6) against its closed form."""

from __future__ import annotations

import math

import pytest

from looplm.train.schedule import wsd_multiplier

# ---------------------------------------------------------------------------------------------
# Warmup-stable-decay multiplier (design §6): T = 1000, W = 50, D = 100
# ---------------------------------------------------------------------------------------------
T, W, D = 1000, 50, 100


def closed_form(t: int) -> float:
    """The rate of update t of T: the cosine covers updates T - D .. T - 1, the last at the floor."""
    if t < W:
        return 1e-4 + (1 - 1e-4) * t / W
    if t < T - D:
        return 1.0
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1, (t + 1 - T + D) / D)))


@pytest.mark.parametrize(
    "t,expected",
    [
        (0, 1e-4),
        (25, 1e-4 + (1 - 1e-4) * 0.5),
        (W, 1.0),  # end of warmup
        (500, 1.0),  # mid
        (T - D - 1, 1.0),  # the last update at the peak
        (T - D, 0.1 + 0.45 * (1 + math.cos(math.pi / D))),  # the first decayed update
        (T - D // 2 - 1, 0.55),  # half way through the cosine
        (T - 1, 0.1),  # the last update trains at the floor
        (T, 0.1),
    ],
)
def test_wsd_closed_form_values(t, expected):
    assert wsd_multiplier(t, T) == pytest.approx(expected, abs=1e-12)


def test_wsd_matches_closed_form_everywhere_and_is_monotone():
    values = [wsd_multiplier(t, T) for t in range(T)]  # the T updates
    for t, v in enumerate(values):
        assert v == pytest.approx(closed_form(t), abs=1e-12)
    warm = values[: W + 1]
    assert all(b > a for a, b in zip(warm, warm[1:]))
    decay = values[T - D - 1 :]
    assert all(b < a for a, b in zip(decay, decay[1:])) and len(decay) == D + 1  # D decayed updates
    assert min(values) == pytest.approx(1e-4) and max(values) == 1.0 and values[-1] == pytest.approx(0.1)


def test_a_zero_fraction_means_no_warmup_or_no_decay():
    # warmup_frac 0 still warmed up for one step (step 0 at 1e-4 of the rate); decay_frac 0 decayed at the last
    assert [wsd_multiplier(t, 100, 0.0, 0.1) for t in (0, 1, 89)] == [1.0, 1.0, 1.0]
    assert [wsd_multiplier(t, 100, 0.05, 0.0) for t in (5, 99, 100)] == [1.0, 1.0, 1.0]
    assert wsd_multiplier(0, 10, 0.01, 0.01) == 1e-4  # a fraction above 0 takes at least one step


def test_fractions_round_to_the_nearest_step_and_decay_takes_at_least_one():
    # T = 18: 10 % is 1.8 steps, so W = D = 2 (not 1): warmup passes half way at update 1; the cosine
    # covers updates 16 (half way) and 17 (the floor)
    assert wsd_multiplier(1, 18, 0.1, 0.0) == pytest.approx(1e-4 + (1 - 1e-4) / 2, abs=1e-12)
    assert wsd_multiplier(15, 18, 0.0, 0.1) == 1.0
    assert wsd_multiplier(16, 18, 0.0, 0.1) == pytest.approx(0.55, abs=1e-12)
    assert wsd_multiplier(17, 18, 0.0, 0.1) == pytest.approx(0.1, abs=1e-12)
    # a decay fraction of 0.01 of 10 updates still decays one: the last (it trained at the peak)
    assert wsd_multiplier(8, 10, 0.0, 0.01) == 1.0
    assert wsd_multiplier(9, 10, 0.0, 0.01) == pytest.approx(0.1, abs=1e-12)


def test_past_the_schedule_the_multiplier_stays_at_its_floor():
    # the cosine does not climb back after T (a step past the schedule keeps the final rate)
    assert [wsd_multiplier(t, T) for t in (T + 1, T + D // 2, T + D)] == pytest.approx([0.1] * 3, abs=1e-12)
