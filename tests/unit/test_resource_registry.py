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
