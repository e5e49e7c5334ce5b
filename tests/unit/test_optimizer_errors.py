"""The optimizer catches only the errors it expects (optimizer/errors.py): each falls back with a "fallback" event
naming the cause; any other exception is a bug and propagates out of the stage, the scaler and stage 1."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from recforge.config import ResourceConfig
from recforge.elastic.master.dlrover_scaler import DLRoverScaler
from recforge.elastic.optimizer import (
    DLRoverPolicy,
    InMemoryHistory,
    JobDescription,
    JobLimits,
    JobRecord,
    ModelFitError,
    Observation,
    OptimizerConfig,
    PodPlan,
    RuntimeStage,
    warm_start,
)
from recforge.elastic.optimizer import runtime_stage as runtime_module
from recforge.elastic.optimizer.models.memory_model import GiB
from recforge.elastic.optimizer.models.throughput_model import PS_TERMS, ThroughputModel, solve_nnls
from recforge.elastic.policy import JobInfo, ResourcePlan

warm_module = importlib.import_module("recforge.elastic.optimizer.warm_start")  # the package exports the function
MODEL = ThroughputModel(PS_TERMS, (0.02, 4e-4, 5e-5, 0.002, 0.001, 0.0005))
LIMITS = JobLimits(cpu=200, memory=800 * GiB)
REQ = PodPlan(workers=4, cpu_per_worker=8, memory_per_worker=8 * GiB, batch_size=512, servers=1, cpu_per_server=4,
              memory_per_server=16 * GiB)
JOB = JobDescription("criteo_kaggle", "dlrm", REQ, total_samples=1e9, parameter_server=True)


class _Store:
    """A history store whose lookup raises `error`; `unavailable` names what it raises when it is down."""

    def __init__(self, error: Exception) -> None:
        self.error, self.problems, self.unavailable = error, [], (OSError,)

    def similar(self, *a, **k):
        raise self.error


def _record(t=1.0):
    return JobRecord("criteo_kaggle", "dlrm", REQ.to_dict(), samples_per_s=1e5, model=MODEL,
                     peak_memory_bytes=3 * GiB, finished_at=t, extra={"peak_server_memory": 10 * GiB})


def _fallbacks(events):
    return [e for e in events if e.action == "fallback"]


# ---- stage 1 -----------------------------------------------------------------------------
def test_a_history_store_that_is_down_is_a_fallback_event_naming_it():
    ws = warm_start(JOB, _Store(OSError("connection refused by mlflow:5000")), LIMITS)
    (fb,) = _fallbacks(ws.events)
    assert ws.plan == REQ and fb.stage == "warm_start"
    assert "history store unavailable (OSError: connection refused by mlflow:5000)" in fb.reason
    assert ws.events[-1].action == "cold_start"  # then planned as a cold start, which says so too


def test_an_unexpected_error_of_the_history_store_propagates():
    with pytest.raises(AttributeError, match="a bug in the store"):
        warm_start(JOB, _Store(AttributeError("a bug in the store")), LIMITS)


def test_a_degenerate_model_in_stage_1_falls_back_and_a_bug_propagates(monkeypatch):
    hist = InMemoryHistory([_record(1), _record(2)])
    assert not _fallbacks(warm_start(JOB, hist, LIMITS).events)  # the happy path: no fallback

    def singular(*a, **k):
        raise np.linalg.LinAlgError("Singular matrix")

    monkeypatch.setattr(warm_module, "search", singular)
    ws = warm_start(JOB, hist, LIMITS)
    (fb,) = _fallbacks(ws.events)
    assert ws.plan == REQ and "warm start from history failed (LinAlgError: Singular matrix)" in fb.reason

    def bug(*a, **k):
        raise AttributeError("'NoneType' object has no attribute 'workers'")

    monkeypatch.setattr(warm_module, "search", bug)
    with pytest.raises(AttributeError, match="no attribute 'workers'"):
        warm_start(JOB, hist, LIMITS)


def test_a_stage1_state_of_the_wrong_shape_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"stage 1 state unreadable \(KeyError: 'job'\)"):
        DLRoverPolicy.from_stage1({"plan": REQ.to_dict()})


# ---- stage 2 -----------------------------------------------------------------------------
def test_a_refit_that_cannot_determine_the_model_is_a_fallback_event():
    """Three configurations, six terms, no prior: the fit is degenerate (ModelFitError), the stage says so once."""
    rt = RuntimeStage(JOB, LIMITS, OptimizerConfig(profile_samples=1, interval_s=0), None, terms=PS_TERMS)
    events = []
    for t, workers in enumerate((4, 5, 6, 6, 6)):
        plan = PodPlan(workers, 8, 8 * GiB, 512, servers=1, cpu_per_server=4, memory_per_server=16 * GiB)
        events += rt.observe(Observation(time_s=float(t), plan=plan, samples_per_s=1e5 + 1e4 * workers))
    refits = [e for e in _fallbacks(events) if e.reason.startswith("refit")]
    assert len(refits) == 1, [e.reason for e in events]
    assert "refit on 3 samples failed (ModelFitError: fit: 3 points cannot determine 6 coefficients" \
        in refits[0].reason
    assert rt.model.model is None and events[-1].action == "fallback" and "no model yet" in events[-1].reason


def test_the_runtime_stage_and_the_scaler_fall_back_on_a_degenerate_search_and_let_a_bug_through(monkeypatch):
    policy = DLRoverPolicy(InMemoryHistory(), JobLimits(cpu=4, memory=16 * GiB, max_cpu_per_worker=4),
                           config=OptimizerConfig(profile_samples=1, interval_s=0), default_model=MODEL)
    policy.plan(JobInfo(shard_rows=[100_000], epochs=1, rows_per_task=512,
                        resources=ResourceConfig(workers=2, threads_per_worker=1),
                        extra={"batch_size": 512, "host_cores": 4.0}))
    clock = iter(float(t) for t in range(0, 1000, 10))
    scaler = DLRoverScaler(policy, min_interval_s=0.0, clock=lambda: next(clock))

    def poll(rows: int):
        return scaler({"rows_done_total": rows, "workers": {}, "launch": {}}, ResourcePlan(2, 1))

    def singular(*a, **k):
        raise np.linalg.LinAlgError("Singular matrix")

    monkeypatch.setattr(runtime_module, "search", singular)
    for i in range(5):  # three windows with throughput, then stage 2 searches
        assert poll(10_000 * i) is None
    (fb,) = _fallbacks(scaler.events)
    assert fb.stage == "runtime" and "search failed (LinAlgError: Singular matrix): keeping the plan" in fb.reason

    def bug(*a, **k):
        raise KeyError("cpu_per_wroker")

    monkeypatch.setattr(runtime_module, "search", bug)
    with pytest.raises(KeyError, match="cpu_per_wroker"):
        for i in range(5, 20):
            poll(10_000 * i)


# ---- the fits ----------------------------------------------------------------------------
def test_nnls_that_does_not_converge_or_gets_nan_is_a_model_fit_error():
    rng = np.random.default_rng(0)
    a, b = rng.random((20, 6)), rng.random(20)
    with pytest.raises(ModelFitError, match="the test fit: NNLS did not converge"):
        solve_nnls(a, b, "the test fit", maxiter=1)
    b[3] = np.nan
    with pytest.raises(ModelFitError, match="the test fit: NNLS refused the points"):
        solve_nnls(a, b, "the test fit")
