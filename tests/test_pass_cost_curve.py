"""The pass-cost curve is measured once per model and kind of engine in a process, and shared."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from specdec.engine import engine as engine_mod
from specdec.engine.engine import SHARED_SIZES, StaticEngine, measured_curves, pass_cost_curve
from specdec.models.loader import LoadedModel, load_model


class Timer:
    """Stands in for pass_times: measurement m times a pass over n tokens as m + n seconds."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, engine: Any, ids: list[int], sizes: list[int], reps: int = 5) -> dict[int, float]:
        self.calls.append(list(sizes))
        m = len(self.calls)
        return {n: float(m + n) for n in sizes}


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch) -> Timer:
    t = Timer()
    monkeypatch.setattr(engine_mod, "pass_times", t)
    monkeypatch.setattr(engine_mod, "_CURVES", type(engine_mod._CURVES)())  # no curve from earlier tests
    return t


def test_strategies_on_one_model_share_one_measurement(tiny_target: LoadedModel, timer: Timer) -> None:
    a, b = StaticEngine(tiny_target.model, 128), StaticEngine(tiny_target.model, 96)
    first = pass_cost_curve(a, [2, 3, 4])
    second = pass_cost_curve(b, list(range(2, 10)))
    assert len(timer.calls) == 1 and timer.calls[0] == list(range(1, SHARED_SIZES + 1))
    assert first == {n: (1 + n) / 2 for n in (2, 3, 4)}  # relative to the one-token pass of the same measurement
    assert all(second[n] == first[n] for n in first)


def test_a_longer_request_measures_the_whole_curve_again(tiny_target: LoadedModel, timer: Timer) -> None:
    engine = StaticEngine(tiny_target.model, 128)
    pass_cost_curve(engine, [2, 3])
    long = pass_cost_curve(engine, [2, SHARED_SIZES + 4])
    assert len(timer.calls) == 2 and timer.calls[1] == list(range(1, SHARED_SIZES + 5))
    assert long[2] == (2 + 2) / (2 + 1)  # the second measurement's, not a mix of the two
    assert pass_cost_curve(engine, [3])[3] == (2 + 3) / (2 + 1) and len(timer.calls) == 2


def test_fresh_measures_every_time_and_other_models_measure_their_own(tiny_target: LoadedModel,
                                                                    timer: Timer) -> None:
    engine = StaticEngine(tiny_target.model, 128)
    pass_cost_curve(engine, [2])
    pass_cost_curve(engine, [2], fresh=True)
    pass_cost_curve(engine, [2], fresh=True)
    assert len(timer.calls) == 3
    other = load_model("tiny-other", "builtin:tiny-llama", matmul="torch", tiny={"seed": 5})
    pass_cost_curve(StaticEngine(other.model, 128), [2])
    assert len(timer.calls) == 4
    del other
    gc.collect()  # a model that is gone takes its curve along: ids cannot alias a later model
    assert tiny_target.model in engine_mod._CURVES and len(engine_mod._CURVES) == 1


def test_the_cpu_kernels_and_torch_matmuls_keep_separate_curves(tiny_target: LoadedModel, timer: Timer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = StaticEngine(tiny_target.model, 128)
    pass_cost_curve(engine, [2])
    monkeypatch.setattr(tiny_target.model, "fused", object())  # as heads' generation switches the same model
    pass_cost_curve(engine, [2])
    assert len(timer.calls) == 2


def test_the_run_records_the_curves_it_measured(tiny_target: LoadedModel, timer: Timer) -> None:
    engine = StaticEngine(tiny_target.model, 128)
    assert measured_curves(tiny_target.model) == {}  # nothing measured yet: nothing recorded
    pass_cost_curve(engine, [2])
    (key, curve), = measured_curves(tiny_target.model).items()
    assert key == "StaticEngine, eager, 128 cached"
    assert list(curve) == [str(n) for n in range(1, SHARED_SIZES + 1)]
    assert curve["2"] == 1.5 and curve["16"] == 8.5  # the timer's (1 + n) / (1 + 1)
