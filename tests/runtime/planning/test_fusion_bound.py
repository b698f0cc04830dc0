"""``fusion: auto`` spends on measuring at most a share of the training it decides for."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from sweepmaster.runtime import ShardExecutor
from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.planning.fusion_degree import (
    MEASURE_STEPS_PER_K,
    FusionDegrees,
    FusionMeasurement,
    bounded_degrees,
)
from sweepmaster.runtime.planning.partition import plan_job
from tests.kit.fused import spec


def test_bounded_degrees_from_recorded_step_times() -> None:
    # recorded: 0.05 s per step of one trial; 10% of 8 trials' training
    assert bounded_degrees([1, 2, 4, 8], 0.05, 1000) == ([1, 2, 4, 8], None)
    # 100 steps: 4 s of budget; K = 1 and 2 cost 17 * 3 * 0.05 = 2.55 s, K = 4 would add 3.4 s
    kept, why = bounded_degrees([1, 2, 4, 8], 0.05, 100)
    assert kept == [1, 2]
    assert why is not None and why.startswith("K = 4, 8 not measured: measuring K = 4 too")
    assert "5.95 s, more than 10% of the 40 s 8 trials of 100 steps" in why
    # 20 steps: 0.8 s of budget, less than K = 1 and 2 cost: nothing measured
    kept, why = bounded_degrees([1, 2, 4, 8], 0.05, 20)
    assert kept == [] and why is not None
    assert why.startswith("not measured: measuring K = 1 and 2 would take about 2.55 s")
    # only K = 1 fits the budget: nothing to compare it with, so nothing is measured
    assert bounded_degrees([1, 2, 4], 0.05, 25)[0] == []
    assert bounded_degrees([1, 2], 0.05, 20, share=None) == ([1, 2], None)
    assert MEASURE_STEPS_PER_K * 3 * 0.05 == pytest.approx(2.55)


def _recorded(k: int, rate: float) -> FusionMeasurement:
    return FusionMeasurement(k, rate, 1000 * k, True, k * 48 / rate)


def test_auto_measures_only_what_the_job_can_pay_for(caplog: pytest.LogCaptureFixture) -> None:
    device = VirtualDevice("cpu:0", budget_bytes=1 << 30)
    calls: list[list[int]] = []

    def measure(spec_, ks, budget_bytes):  # recorded measurements: K = 2 is faster
        calls.append(list(ks))
        return [_recorded(k, 100.0 * k ** 0.5) for k in ks]

    short = spec(0, batch_size=2, max_steps=5)
    plan = plan_job(short, device, whole=True)
    with caplog.at_level(logging.INFO, logger="sweepmaster.fusion"):
        choice = FusionDegrees("auto").choose(short, plan, device, False, measure)
    assert calls == []  # 5 steps cannot pay for measuring K = 1 and 2 (17 steps each)
    assert (choice.k, choice.source) == (1, "unmeasured")
    assert "not measured: measuring K = 1 and 2 would take" in choice.note
    assert any("fusion of trial-0: K = 1 (not measured" in r.getMessage()
               for r in caplog.records)

    # a long job: per-step cost the same, a budget 2000x larger: every degree is measured
    long = dataclasses.replace(short, max_steps=10_000)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sweepmaster.fusion"):
        choice = FusionDegrees("auto").choose(long, plan, device, False, measure)
    assert calls == [[1, 2, 4, 8]]
    assert (choice.k, choice.source) == (8, "measured")
    assert any("fusion of trial-0: K = 8 (measured" in r.getMessage() for r in caplog.records)

    # in between: the degrees whose measurement fits, and the note says which were left out
    steps = round(17 * 3 / (0.1 * 8)) + 1  # K = 1 and 2 fit, K = 4 does not
    middle = dataclasses.replace(short, max_steps=steps)
    choice = FusionDegrees("auto").choose(middle, plan, device, False, measure)
    assert calls[-1] == [1, 2] and choice.k == 2
    assert "K = 4, 8 not measured" in choice.note


def test_an_executor_does_not_measure_a_short_job() -> None:
    short = spec(0, batch_size=2, max_steps=4)
    with ShardExecutor("cpu:1x256MiB", fusion="auto") as executor:
        choice = executor.fusion_choice(short)
        assert executor.fusion_degree(short) == 1
    assert choice.source == "unmeasured" and choice.measurements == ()
