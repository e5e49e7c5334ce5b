"""Fitted resource models in MLflow: the pyfunc predicts like the model, history reads them back, bad artifacts
fall back."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from recforge.elastic.optimizer import JobDescription, JobLimits, PodPlan, warm_start
from recforge.elastic.optimizer.models.history import History
from recforge.elastic.optimizer.models.memory_model import GiB, MemoryModel
from recforge.elastic.optimizer.models.throughput_model import Allocation, Sample, ThroughputModel

MODEL = ThroughputModel(("const", "b_per_cpu", "w"), (0.01, 2e-4, 0.003), fit_mape=0.05, n_points=12)
MEM = MemoryModel(0.5 * GiB, 2.0, 10.0)
PLAN = PodPlan(3, 2.0, 4 * GiB, 512)


@pytest.fixture
def store(recforge_home):
    from recforge.tracking import TrackingStore

    return TrackingStore()


def _logged_run(store, dataset="criteo_kaggle", family="dlrm"):
    from recforge.elastic.optimizer.models.resource_store import log_resource_model

    run_id = store.stage_run("test_exp", "k1", f"train-{dataset}-{family}")
    pts = [Sample(Allocation(w, 1.0, 512), MODEL.predict(Allocation(w, 1.0, 512)) * 1.03) for w in (1, 2, 3)]
    uri = log_resource_model(store, run_id, model=MODEL, dataset=dataset, model_family=family,
                             final_plan=PLAN.to_dict(), memory=MEM, samples_per_s=1234.0, peak_memory_bytes=2 * GiB,
                             points=pts, held_out=pts[:1], metrics={"held_out_mape": 0.1})
    store.finish(run_id)
    return run_id, uri


def test_logged_pyfunc_answers_what_would_8_workers_give(store):
    from recforge.tracking.resource_models import load_resource_model

    run_id, uri = _logged_run(store)
    pyfunc = load_resource_model(uri, store.tracking_uri)
    out = pyfunc.predict(pd.DataFrame({"workers": [8, 1], "cpu_per_worker": [2, 1], "batch_size": [512, 256],
                                       "embedding_bytes": [1e8, 0], "step": [100, 0]}))
    assert out["samples_per_s"].tolist() == pytest.approx([MODEL.predict(Allocation(8, 2.0, 512)),
                                                          MODEL.predict(Allocation(1, 1.0, 256))])
    assert out["memory_bytes"].tolist() == pytest.approx([MEM.predict(1e8, 100), MEM.predict(0, 0)])
    with pytest.raises(Exception, match="lacks columns"):
        pyfunc.predict(pd.DataFrame({"workers": [1]}))
    run = store.client.get_run(run_id)
    assert run.data.metrics["resource_model.coef.w"] == pytest.approx(0.003)
    assert run.data.metrics["resource_model.held_out_mape"] == pytest.approx(0.1)
    arts = {a.path for a in store.client.list_artifacts(run_id, "resource_model")}
    assert {"resource_model/record.json", "resource_model/predicted_vs_measured.png"} <= arts


def test_history_reads_models_back_and_stage1_uses_them(store):
    from recforge.elastic.optimizer.models.resource_store import MlflowHistory

    _logged_run(store)
    _logged_run(store, dataset="wide400")
    hist = MlflowHistory(store)
    assert isinstance(hist, History)
    recs = hist.similar("criteo_kaggle", "dlrm")
    assert len(recs) == 1 and recs[0].model.coef == MODEL.coef and recs[0].memory.emb_factor == 2.0
    assert recs[0].final_plan == PLAN.to_dict() and not hist.problems
    assert hist.similar("criteo_kaggle", "dlrm_dcn") == []
    job = JobDescription("criteo_kaggle", "dlrm", PodPlan(1, 1.0, 2 * GiB, 512), total_samples=1e6, host_cores=None)
    ws = warm_start(job, hist, JobLimits(cpu=16, memory=64 * GiB))
    assert ws.events[0].action == "initial_plan" and ws.prior.coef == MODEL.coef


def test_corrupt_or_missing_model_artifact_keeps_the_plan_and_reports_it(store, tmp_path):
    from recforge.elastic.optimizer.models.resource_store import MlflowHistory
    from recforge.tracking.resource_models import RECORD_FILE

    run_id, _ = _logged_run(store)
    bad = tmp_path / "record.json"
    bad.write_text("{not json")
    store.client.log_artifact(run_id, str(bad), "resource_model")  # overwrite the record with garbage
    hist = MlflowHistory(store)
    recs = hist.similar("criteo_kaggle", "dlrm")
    assert recs[0].model is None and recs[0].final_plan == PLAN.to_dict()
    assert RECORD_FILE in hist.problems[0] and "corrupt" in hist.problems[0]
    job = JobDescription("criteo_kaggle", "dlrm", PodPlan(1, 1.0, 2 * GiB, 512))
    ws = warm_start(job, hist, JobLimits(cpu=16, memory=64 * GiB))
    assert ws.plan.workers == PLAN.workers and "no usable fitted model" in ws.events[0].reason

    # a run tagged as a resource model whose record was never written: plan from its tag, problem listed
    from recforge.tracking.resource_models import DATASET_TAG, FAMILY_TAG, MODEL_TAG, PLAN_TAG

    other = store.stage_run("test_exp", "k2", "train")
    store.set_tags(other, {MODEL_TAG: "1", DATASET_TAG: "x", FAMILY_TAG: "y", PLAN_TAG: json.dumps(PLAN.to_dict())})
    hist = MlflowHistory(store)
    recs = hist.similar("x", "y")
    assert recs[0].model is None and recs[0].final_plan["workers"] == 3 and "missing or corrupt" in hist.problems[0]


def test_events_are_logged_as_jsonl_with_counts(store):
    from recforge.elastic.optimizer.events import Event
    from recforge.tracking.resource_models import log_events

    run_id = store.stage_run("test_exp", "k3", "plan")
    log_events(store, run_id, [Event("warm_start", "cold_start", "no history"), Event("runtime", "hold", "profiling")])
    path = store.client.download_artifacts(run_id, "resource_model/events.jsonl")
    lines = open(path).read().splitlines()
    assert [json.loads(x)["action"] for x in lines] == ["cold_start", "hold"]
    assert store.client.get_run(run_id).data.metrics["dlrover.events.warm_start"] == 1
