"""The stages' outputs contract (recforge.pipelines.outputs): each stage commits its model and a later stage reads
the same model back; a file that does not hold it is an error naming the stage, the file and the field."""
import json
import math

import pytest

from recforge.elastic.job import JobResult
from recforge.elastic.policy import ResourcePlan
from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.outputs import (
    STAGE_OUTPUTS,
    CompileOutputs,
    CorunPlan,
    DLRoverRun,
    EvaluateOutputs,
    GenerateOutputs,
    IngestOutputs,
    JobRecord,
    OutputsError,
    PlanOutputs,
    PublishOutputs,
    SplitOutputs,
    StageOutputs,
    TrainOutputs,
)
from recforge.pipelines.runner import STAGES


def _examples(tmp: str) -> list[StageOutputs]:
    split = SplitOutputs(manifest_dir=f"{tmp}/train", rows=90, quarantined=1, shards=2)
    job = {"exit_code": 0, "plan": {"workers": 2, "threads_per_worker": 1}, "finished": True, "tasks_done": 3,
           "samples": 90, "per_worker": {"rank0": {"samples": 45}}, "poisoned": [], "master_state": {"epoch": 1},
           "spec_path": f"{tmp}/master/worker_spec.json", "attempts": [{"outcome": "finished"}]}
    return [
        GenerateOutputs(files=[f"{tmp}/raw/day_0.tsv", f"{tmp}/raw/day_1.tsv"], synthetic=True,
                        bayes_auc=[0.79, 0.78], positive_rate=[0.25, 0.26]),
        IngestOutputs(train=split, holdout=split, rows_ingested=180, rows_quarantined=2),
        PlanOutputs(plan_path=f"{tmp}/preprocess_plan.json", workers=2, threads_per_worker=1,
                    tables=[("C1", 5000), ("C2", 12)], num_dense=13, preprocess_executor="fused",
                    dlrover={"plan": {"workers": 2}},
                    corun=CorunPlan(schedule_path=f"{tmp}/schedule.json", threads=1, predicted_iteration_ms=3.5)),
        TrainOutputs(checkpoint_dir=f"{tmp}/checkpoint", samples_per_s=1e3, steps=4, wall_s=2.5, world_size=2,
                     samples_trained=[90], job=job,
                     dlrover=DLRoverRun(throughput_by_plan=[{"workers": 2, "samples_per_s": 1e3}], final_plan={},
                                        events=2, executed=[{"stage": "runtime", "action": "add_worker",
                                                             "reason": "slow"}])),
        EvaluateOutputs(auc=0.7, logloss=0.5, ne=float("nan"), rows=90, auc_ceiling=0.78),
        CompileOutputs(artifact=f"{tmp}/inference.pt2", report={
            "backend": "inductor", "max_abs_diff": 1e-7, "atol": 1e-5, "within_tolerance": True,
            "latency": {"batch_size": 64, "threads": 1, "eager": {"median_ms": 1.0}, "compiled": {"median_ms": 0.5}},
            "speedup": 2.0, "a_later_field": [1, 2]}),
        PublishOutputs(model_name="recforge-dlrm", version="3", promoted=False, reason="worse", pipeline_run_id="p"),
    ]


def test_one_model_per_stage_in_pipeline_order():
    assert list(STAGE_OUTPUTS) == STAGES
    assert [type(m).stage for m in _examples("/x")] == STAGES


@pytest.mark.parametrize("index", range(len(STAGES)))
def test_a_committed_stage_reads_back_as_its_model(tmp_path, index):
    ctx = RunContext.create("roundtrip", {}, home=tmp_path)
    writer = StageWriter(ctx, STAGES[index])
    outputs = _examples(str(writer.tmp))[index].model_copy(update={"mlflow_run_id": "run-1"})
    committed = writer.commit(outputs)
    back = ctx.read(type(outputs))
    assert type(back) is type(outputs) and back.model_dump_json() == committed.model_dump_json()  # NaN != NaN
    text = (ctx.stage_dir(STAGES[index]) / "outputs.json").read_text()
    assert str(writer.tmp) not in text  # paths refer to the committed stage directory
    assert json.loads(text)["mlflow_run_id"] == "run-1"
    if isinstance(back, EvaluateOutputs):
        assert math.isnan(back.ne) and '"ne": NaN' in text  # written as json.dumps writes it, and read back
    if isinstance(back, TrainOutputs):
        assert back.job.plan.workers == 2 and back.dlrover.executed[0].action == "add_worker"
        assert str(back.job.spec_path).startswith(str(ctx.stage_dir("train")))
    if isinstance(back, CompileOutputs):
        assert back.report.extras == {"a_later_field": [1, 2]} and back.report.latency.threads == 1
    if isinstance(back, PlanOutputs):
        assert back.tables == [("C1", 5000), ("C2", 12)] and back.corun.threads == 1


def test_a_bad_file_is_an_error_naming_the_stage_file_and_field(tmp_path):
    ctx = RunContext.create("bad", {}, home=tmp_path)
    good = _examples(str(tmp_path))[1].model_dump(mode="json")
    ctx.stage_dir("ingest").mkdir(parents=True)
    path = ctx.stage_dir("ingest") / "outputs.json"
    path.write_text(json.dumps({**good, "train": {**good["train"], "rows": "many"}}))
    with pytest.raises(OutputsError, match=r"stage 'ingest' of run bad .*outputs\.json.* does not hold IngestOutputs: "
                                           r"train\.rows: Input should be a valid integer"):
        ctx.read(IngestOutputs)
    path.write_text(json.dumps({**good, "rows_ingested": None, "extra_key": 1}))
    with pytest.raises(OutputsError, match=r"rows_ingested: Input should be a valid integer.*; "
                                           r"extra_key: Extra inputs are not permitted"):
        ctx.read(IngestOutputs)
    path.write_text("{not json")
    with pytest.raises(OutputsError, match="IngestOutputs: .*Invalid JSON"):
        ctx.read(IngestOutputs)
    with pytest.raises(FileNotFoundError, match="stage 'generate' of run bad has no recorded outputs"):
        ctx.read(GenerateOutputs)


def test_a_stage_commits_only_its_own_model(tmp_path):
    ctx = RunContext.create("wrong", {}, home=tmp_path)
    writer = StageWriter(ctx, "generate")
    with pytest.raises(TypeError, match="stage 'generate' cannot commit IngestOutputs"):
        writer.commit(_examples(str(writer.tmp))[1])
    writer.abort()
    assert not ctx.stage_dir("generate").exists()


def test_the_job_record_reads_the_job_runners_result():
    result = JobResult(exit_code=0, plan=ResourcePlan(3, 2), finished=True, tasks_done=5, samples=100,
                       per_worker={}, poisoned=[], master_state={"epoch": 1}, restarts=1)
    record = JobRecord.model_validate(result)
    assert record.plan.workers == 3 and record.plan.threads_per_worker == 2 and record.restarts == 1
    assert json.loads(record.model_dump_json())["plan"] == {"workers": 3, "threads_per_worker": 2}
