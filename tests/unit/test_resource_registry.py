"""Resource models in the MLflow registry (browse by name, load a version) and bad history entries."""
from __future__ import annotations

import pandas as pd
import pytest

from recforge.elastic.optimizer import JobDescription, JobLimits, PodPlan, warm_start
from recforge.elastic.optimizer.models.memory_model import GiB
from recforge.elastic.optimizer.models.throughput_model import Allocation, ThroughputModel

MODEL = ThroughputModel(("const", "b_per_cpu", "w"), (0.01, 2e-4, 0.003), fit_mape=0.05, n_points=12)
PLAN = PodPlan(3, 2.0, 4 * GiB, 512)


@pytest.fixture
def store(recforge_home):
    from recforge.tracking import TrackingStore

    return TrackingStore()


def test_a_registered_resource_model_loads_by_name_and_version_and_a_bad_plan_tag_is_reported(store):
    from mlflow.exceptions import MlflowException

    from recforge.elastic.optimizer.models.resource_store import log_resource_model
    from recforge.tracking.resource_models import load_resource_model, registered_name

    name = registered_name("criteo_kaggle", "dlrm")
    runs = []
    for key in ("day1", "day2"):
        run_id = store.stage_run("exp", key, "train")
        log_resource_model(store, run_id, model=MODEL, dataset="criteo_kaggle", model_family="dlrm",
                           final_plan=PLAN.to_dict(), register=True)
        runs.append(run_id)
    log_resource_model(store, runs[1], model=MODEL, dataset="criteo_kaggle", model_family="dlrm",
                       final_plan=PLAN.to_dict(), register=True)  # a retried task: no third version
    versions = store.client.search_model_versions(f"name = '{name}'")
    assert sorted((str(v.version), v.run_id) for v in versions) == [("1", runs[0]), ("2", runs[1])]
    grid = pd.DataFrame({"workers": [8, 1], "cpu_per_worker": [2, 1], "batch_size": [512, 512]})
    want = [MODEL.predict(Allocation(8, 2.0, 512)), MODEL.predict(Allocation(1, 1.0, 512))]
    for version in (1, "2", None):
        m = load_resource_model(name=name, version=version, tracking_uri=store.tracking_uri)
        assert m.predict(grid)["samples_per_s"].tolist() == pytest.approx(want)
    with pytest.raises(ValueError, match="either model_uri or name"):
        load_resource_model()
    with pytest.raises(MlflowException, match="resource model 'models:/nope/latest' cannot be loaded"):
        load_resource_model(name="nope", tracking_uri=store.tracking_uri)

    _a_run_whose_plan_tag_is_not_json_still_gives_its_record_and_is_reported(store)  # one MLflow store: it is slow


def _a_run_whose_plan_tag_is_not_json_still_gives_its_record_and_is_reported(store):
    from recforge.elastic.optimizer.models.resource_store import MlflowHistory, log_resource_model
    from recforge.tracking.resource_models import PLAN_TAG

    run_id = store.stage_run("exp", "k", "train")
    log_resource_model(store, run_id, model=MODEL, dataset="d", model_family="m", final_plan=PLAN.to_dict())
    store.set_tags(run_id, {PLAN_TAG: "{not json"})
    hist = MlflowHistory(store)
    (rec,) = hist.similar("d", "m")
    assert rec.final_plan == PLAN.to_dict() and rec.model.coef == MODEL.coef  # the record.json still has both
    assert hist.problems == [f"run {run_id}: tag {PLAN_TAG} is not JSON"]
    ws = warm_start(JobDescription("d", "m", PodPlan(1, 1.0, GiB, 512)), hist, JobLimits(cpu=16, memory=64 * GiB))
    assert ws.events[0].action == "initial_plan" and ws.events[0].inputs["history_problems"] == hist.problems


def test_stage1_loads_the_fitted_memory_model_from_the_registry_and_carries_the_measured_points(store):
    from recforge.config import ResourceConfig
    from recforge.elastic.optimizer.models.memory_model import MemoryModel, MemorySample
    from recforge.elastic.optimizer.models.resource_store import MlflowHistory, log_resource_model
    from recforge.pipelines.hooks.resource_planning import pipeline_plan

    pts = [MemorySample(e, s, 0.4 * GiB + 2 * e + 10 * s, "day1") for e, s in ((1e7, 10), (5e7, 100), (2e8, 50))]
    fitted = MemoryModel.fit(pts)
    run_id = store.stage_run("exp", "day1", "train")
    log_resource_model(store, run_id, model=MODEL, dataset="criteo_kaggle", model_family="dlrm",
                       final_plan=PLAN.to_dict(), memory=fitted, register=True,
                       extra={"memory_points": [p.to_dict() for p in pts]})
    out = pipeline_plan(ResourceConfig(workers=1, policy="dlrover"), dataset="criteo_kaggle", model_family="dlrm",
                        batch_size=512, total_rows=10_000, tables=[("C1", 1000)], embedding_dim=8,
                        history=MlflowHistory(store), limits=JobLimits(cpu=2, memory=8 * GiB, max_cpu_per_worker=2))
    state = out["state"]
    assert MemoryModel.from_dict(state["memory"]).to_dict() == pytest.approx(fitted.to_dict(), nan_ok=True)
    assert f"run {run_id}, registered recforge-resource-model-criteo_kaggle-dlrm v1" in state["memory_source"]
    assert [MemorySample(**p) for p in state["memory_points"]] == [
        MemorySample(p.embedding_bytes, p.step, p.rss_bytes, run_id) for p in pts]
    assert out["events"][0].prediction["peak_memory_bytes_per_worker"] > 0.4 * GiB


def test_a_short_train_run_records_predicted_vs_measured_and_stores_its_fitted_memory_model(store):
    """No profiler window completed (a short job): the workers' own throughput and peaks are the measurements."""
    from recforge.config import ResourceConfig
    from recforge.elastic.master.dlrover_scaler import scaler_from_stage1
    from recforge.pipelines.hooks.resource_planning import log_dlrover_run, pipeline_plan
    from recforge.tracking.resource_models import latest_registered_record
    from recforge.train.result import TableSharding, WorkerResult

    out = pipeline_plan(ResourceConfig(workers=2, policy="dlrover"), dataset="criteo_kaggle", model_family="dlrm",
                        batch_size=512, total_rows=10_000, tables=[("C1", 1000), ("C2", 5000)], embedding_dim=8,
                        history=None, limits=JobLimits(cpu=2, memory=8 * GiB, max_cpu_per_worker=2))
    scaler = scaler_from_stage1(out["state"])
    worker = WorkerResult.model_construct(
        world_size=2, steps=10, threads_per_worker=1, samples_per_s=9000.0, resumed_from=None,
        peak_rss_bytes=[5.5e8, 5.7e8],
        sharding_plan={t: TableSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[r])
                       for t, r in (("C1", 0), ("C2", 1))})
    run_id = store.stage_run("exp", "day1", "train")
    summary = log_dlrover_run(store, run_id, scaler, [], worker)
    (plan,) = summary["plans"]
    assert plan["measured_samples_per_s"] == 9000.0 and plan["source"] == "worker result"
    assert plan["predicted_samples_per_s"] == out["events"][0].prediction["samples_per_s"]
    mem = summary["memory"]
    assert mem["measured_peak_bytes"] == [5.5e8, 5.7e8] and mem["predicted_peak_bytes"] > 0
    assert mem["fitted"]["source"].startswith("fitted on 2 measured peaks of 1 run(s)")
    metrics = store.client.get_run(run_id).data.metrics
    assert metrics["dlrover.measured_peak_memory_bytes"] == 5.7e8
    assert metrics["dlrover.predicted_samples_per_s.w2t1"] == plan["predicted_samples_per_s"]
    stored = latest_registered_record(store, "criteo_kaggle", "dlrm")
    assert stored is not None and stored.run_id == run_id
    assert stored.record["memory_model"]["source"] == mem["fitted"]["source"]
    assert [p["rss_bytes"] for p in stored.record["extra"]["memory_points"]] == [5.5e8, 5.7e8]
