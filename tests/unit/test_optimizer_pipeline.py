"""Stage 1 for the daily pipeline and the stage 2/3 recommendations made from a finished run."""
from __future__ import annotations

import json

import pytest

from recforge.config import ResourceConfig
from recforge.elastic.optimizer.models.history import InMemoryHistory, JobRecord
from recforge.elastic.optimizer.models.memory_model import GiB
from recforge.elastic.optimizer.models.throughput_model import Allocation, ThroughputModel, load_profile
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, PodPlan
from recforge.elastic.optimizer.warm_start import history_points, local_default_model, warm_start
from recforge.pipelines.hooks.resource_planning import pipeline_plan, recommend_after_run

TABLES = [("C1", 1000), ("C2", 50_000)]
TRUE = ThroughputModel(("const", "b_per_cpu", "w"), (0.01, 2e-4, 0.003))


def _plan(**kw):
    args = dict(resources=ResourceConfig(workers=2, threads_per_worker=1, policy="dlrover"), dataset="criteo_kaggle",
                model_family="dlrm", batch_size=512, total_rows=100_000, tables=TABLES, embedding_dim=16, history=None,
                limits=JobLimits(cpu=2, memory=8 * GiB, max_cpu_per_worker=2))
    args.update(kw)
    return pipeline_plan(**args)


def test_committed_profile_loads_and_gives_a_default_model():
    samples, cond = load_profile()
    assert len(samples) >= 12 and cond["machine"]["logical_cpus"] >= 1
    assert {s.allocation.workers for s in samples} == {1, 2, 3}
    assert {s.allocation.cpu_per_worker for s in samples} == {1.0, 2.0}
    m = local_default_model()
    assert m is not None and all(c >= 0 for c in m.coef) and m.meta["source"] == "profile"


def test_cold_start_plan_is_the_request_with_the_default_models_hint():
    out = _plan()
    assert (out["workers"], out["threads_per_worker"]) == (2, 1)
    ev = out["events"][0]
    assert ev.action == "cold_start" and "default_model_suggests" in ev.prediction
    json.dumps(out["state"])  # the train task gets it through the stage's outputs.json


def test_second_day_warm_starts_from_the_first_days_model_and_points():
    day1 = _plan()
    events, model, ran = recommend_after_run(day1["state"], {"world_size": 2, "threads_per_worker": 1,
                                                            "batch_size": 512, "samples_per_s": 20_000.0,
                                                            "steps": 100, "wall_s": 30.0})
    assert model is not None and model.predict(Allocation(2, 1.0, 512, host_cores=day1["state"]["job"]["host_cores"])) \
        == pytest.approx(20_000.0, rel=1e-6)  # the prior rescaled to what was measured
    assert all("not executed" in e.reason for e in events)
    rec = JobRecord("criteo_kaggle", "dlrm", ran.to_dict(), samples_per_s=20_000.0, model=model,
                    extra={"points": [{"allocation": ran.allocation().to_dict(), "samples_per_s": 20_000.0}]})
    day2 = _plan(history=InMemoryHistory([rec]))
    assert day2["events"][0].action == "initial_plan"
    assert day2["state"]["prior"]["coef"] == pytest.approx(list(model.coef))


def test_stage1_refits_on_measured_points_of_past_runs():
    recs = []
    for w, c in ((1, 1.0), (2, 2.0), (3, 1.0), (4, 4.0)):
        a = Allocation(w, c, 512)
        recs.append(JobRecord("d", "m", PodPlan(w, c, GiB, 512).to_dict(), model=TRUE,
                              extra={"points": [{"allocation": a.to_dict(), "samples_per_s": TRUE.predict(a) * 1.5},
                                                {"allocation": {"bad": 1}, "samples_per_s": 3}]}))
    assert len(history_points(recs)) == 4  # the malformed point is skipped
    ws = warm_start(JobDescription("d", "m", PodPlan(1, 1.0, GiB, 512)), InMemoryHistory(recs),
                    JobLimits(cpu=64, memory=64 * GiB))
    assert "refitted on 4 measured points" in ws.events[0].reason
    assert ws.prior.predict(Allocation(2, 2.0, 512)) == pytest.approx(TRUE.predict(Allocation(2, 2.0, 512)) * 1.5,
                                                                      rel=0.1)


def test_a_straggling_worker_in_the_run_is_flagged_and_no_throughput_is_a_fallback():
    st = _plan(resources=ResourceConfig(workers=3, threads_per_worker=1, policy="dlrover"),
               limits=JobLimits(cpu=4, memory=8 * GiB, max_cpu_per_worker=2))["state"]
    events, _, _ = recommend_after_run(st, {"world_size": 3, "threads_per_worker": 1, "samples_per_s": 9_000.0},
                                       {"rank0": 40_000, "rank1": 41_000, "rank2": 12_000})
    assert any(e.action == "replace_straggler" for e in events)
    events, model, _ = recommend_after_run(st, {"world_size": 3, "samples_per_s": 0.0})
    assert model is None and any(e.action == "fallback" and "no throughput" in e.reason for e in events)
    events, _, _ = recommend_after_run({**st, "prior": {"terms": ["nope"], "coef": [1.0]}}, {"samples_per_s": 5.0})
    assert events  # a corrupt stage-1 state never raises


def test_stage1_takes_the_newest_fitted_memory_model_and_skips_priors_kept_for_lack_of_points():
    from recforge.elastic.optimizer.models.memory_model import DEFAULT_MEMORY_MODEL, MemoryModel, fit_or_prior

    fitted = MemoryModel(0.7 * GiB, 1.5, 0.0, source="fitted on 6 measured peaks of 2 run(s)", n_runs=2)
    kept = fit_or_prior([], DEFAULT_MEMORY_MODEL)
    recs = [JobRecord("criteo_kaggle", "dlrm", PodPlan(1, 1.0, GiB, 512).to_dict(), memory=m, finished_at=t,
                      run_id=f"r{t}") for t, m in ((1, fitted), (2, kept))]
    out = _plan(history=InMemoryHistory(recs))
    assert MemoryModel.from_dict(out["state"]["memory"]).base_bytes == 0.7 * GiB
    assert out["state"]["memory_source"].startswith("fitted memory model of run r1")
    cold = _plan()  # no history: the committed profile's fit, named as a prior
    assert cold["state"]["memory_source"].startswith("no similar run: prior (committed profile")
    assert json.dumps(cold["state"])


def test_a_cold_start_request_above_this_machine_gets_the_default_models_plan_within_it():
    out = _plan(resources=ResourceConfig(workers=4, threads_per_worker=2, policy="dlrover"))
    assert out["workers"] * out["threads_per_worker"] <= 2
    ev = out["events"][0]
    assert "exceeds the limits (2 cores): the default model's best plan" in ev.reason
    assert ev.plan_after["workers"] == ev.prediction["default_model_suggests"]["workers"]


def test_the_workers_peaks_become_memory_points_with_the_embedding_bytes_each_rank_held():
    from recforge.pipelines.hooks.resource_planning import memory_points
    from recforge.train.result import ResumedFrom, TableSharding, WorkerResult

    state = _plan()["state"]
    plan = {"C1": TableSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1]),
            "C2": TableSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[1])}
    worker = WorkerResult.model_construct(world_size=2, steps=120, sharding_plan=plan, peak_rss_bytes=[6e8, 7e8],
                                          resumed_from=ResumedFrom(path="x", step=20, source="disk"))
    pts = memory_points(state, worker, run="r1")
    assert [(p.embedding_bytes, p.step, p.rss_bytes, p.run) for p in pts] == [
        (1000 * 16 * 4, 100, 6e8, "r1"), ((1000 + 50_000) * 16 * 4, 100, 7e8, "r1")]
    assert memory_points(state, worker.model_copy(update={"peak_rss_bytes": None}), "r1") == []
