"""Warm start from the champion (recforge.pipelines.hooks.warm_start): which runs want it, a matching champion is
used, an incompatible one is refused with the reason (trains from scratch), against a real MLflow store and a real
DCP checkpoint in the trainer's final-checkpoint format."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recforge.pipelines.context import RunContext
from recforge.pipelines.hooks import warm_start
from recforge.pipelines.outputs import PlanOutputs
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.model import build_dlrm
from recforge.train.recovery.layout import META_FILE, fingerprint, write_checksums

CONF = {"table_cap": 40, "model": {"embedding_dim": 4, "dense_arch": [8, 4], "over_arch": [8, 1]},
        "train": {"warm_start": "champion"}}


def _ctx(home, key, run_type="manual", **over):
    conf = json.loads(json.dumps(CONF))
    for k, v in over.items():
        conf[k] = {**conf[k], **v} if isinstance(v, dict) else v
    return RunContext.create(key, conf, home=home, run_type=run_type)


def _plan(ctx, path) -> PlanOutputs:
    plan = criteo_plan(ctx.config.dataset(), ctx.config.table_cap)
    plan.save(path)
    return PlanOutputs(plan_path=str(path), workers=1, threads_per_worker=1, tables=plan.tables(),
                       num_dense=len(plan.dense_features()), preprocess_executor="fused")


def _final_checkpoint(ctx, plan_out: PlanOutputs, path):
    """A final checkpoint as the trainer writes it: DCP model state, meta with the fingerprint, CHECKSUMS.json."""
    model = build_dlrm(ctx.config.model, plan_out.tables, plan_out.num_dense, "cpu")
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    from recforge.preprocess.planning.plan import Plan

    fp = fingerprint(ctx.config.model.model_dump(mode="json"), plan_out.tables, plan_out.num_dense,
                     Plan.load(plan_out.plan_path).model_dump(mode="json"))
    (path / META_FILE).write_text(json.dumps({"world_size": 2, "fingerprint": fp}))
    write_checksums(path)
    return path


def test_the_run_type_comes_from_airflow():
    from types import SimpleNamespace

    from airflow.utils.types import DagRunType

    from recforge.pipelines.dag_tasks import run_type_of

    assert run_type_of({"dag_run": SimpleNamespace(run_type=DagRunType.SCHEDULED)}) == "scheduled"
    assert run_type_of({"dag_run": SimpleNamespace(run_type=DagRunType.MANUAL)}) == "manual"
    assert run_type_of({"dag_run": SimpleNamespace()}) == "manual"


def test_which_runs_want_the_champion(tmp_path):
    assert warm_start.wanted(_ctx(tmp_path, "a", train={"warm_start": "scratch"}, run_type="scheduled"))[0] is False
    auto_manual = warm_start.wanted(_ctx(tmp_path, "a", train={"warm_start": "auto"}))
    assert auto_manual[0] is False and "a manual run trains from scratch" in auto_manual[1]
    assert warm_start.wanted(_ctx(tmp_path, "a", train={"warm_start": "auto"}, run_type="scheduled"))[0] is True
    assert warm_start.wanted(_ctx(tmp_path, "a", train={"warm_start": "auto"}, run_type="backfill"))[0] is False
    assert warm_start.wanted(_ctx(tmp_path, "a"))[0] is True  # 'champion' asked for explicitly, any run type


def test_a_matching_champion_is_used_an_incompatible_one_refused_with_the_reason(recforge_home, tmp_path):
    from recforge.tracking import ModelRegistry, TrackingStore

    day1 = _ctx(recforge_home, "day1")
    plan1 = _plan(day1, tmp_path / "plan1.json")
    ckpt = _final_checkpoint(day1, plan1, tmp_path / "day1" / "checkpoint")
    tags = warm_start.registration_tags(day1, plan1, ckpt)

    store = TrackingStore()
    registry = ModelRegistry(store, warm_start.REGISTERED_MODEL)
    day2 = _ctx(recforge_home, "day2")
    plan2 = _plan(day2, tmp_path / "plan2.json")
    record, init = warm_start.decide(day2, store, plan2)
    assert not record.used and init is None and "no champion yet" in record.reason

    run1 = store.stage_run("recforge_daily", "day1", "publish")
    v1 = registry.log_and_register(run1, torch.nn.Linear(2, 1), auc=0.7, tags=tags)
    registry.promote(v1, auc=0.7, rows=5000, champion_version=None, champion_auc=None, margin=0.0, min_auc=0.5,
                     min_rows=1)
    record, init = warm_start.decide(day2, store, plan2)  # same schema, plan, model, optimizer
    assert record.used and init == ckpt and record.champion_version == v1 and "matches" in record.reason

    # the retried train task keeps the first attempt's decision (kept in its work dir) and logs it
    run2 = store.stage_run("recforge_daily", "day2", "train")
    work = tmp_path / "work"
    work.mkdir()
    first, _ = warm_start.choose(day2, store, run2, plan2, work)
    again, init_again = warm_start.choose(day2, store, run2, plan2, work)
    assert first.used and again.used and init_again == ckpt and "earlier attempt" in again.reason
    logged = store.client.get_run(run2).data
    assert logged.tags["warm_start.used"] == "True" and logged.tags["warm_start.champion_version"] == v1
    assert logged.metrics["warm_start_used"] == 1.0

    # another model config: refused, from scratch, the difference named (the registry path end to end)
    wider = _ctx(recforge_home, "day2b", model={"embedding_dim": 8, "dense_arch": [8, 8]})
    record, init = warm_start.decide(wider, store, _plan(wider, tmp_path / "plan2b.json"))
    assert not record.used and init is None and record.champion_version == v1
    assert record.reason.startswith(f"from scratch: champion v{v1} refused") and "model.embedding_dim" in record.reason


@pytest.mark.parametrize("change, expected", [
    (dict(table_cap=30), "table 'C1': checkpoint 40 rows, this run 30"),
    (dict(train={"embedding_lr": 0.5}), "optimizer settings differ"),
    (dict(train={"dense_optimizer": "sgd"}), "optimizer settings differ"),
    (dict(dataset_schema="rap_plan2"), "dataset schema (features) differs"),
])
def test_incompatible_champions_are_refused_with_the_reason(tmp_path, change, expected):
    day1 = _ctx(tmp_path, "day1")
    plan1 = _plan(day1, tmp_path / "plan1.json")
    ckpt = _final_checkpoint(day1, plan1, tmp_path / "ckpt")
    tags = warm_start.registration_tags(day1, plan1, ckpt)
    assert warm_start.problems(day1.__class__.create("day2", day1.config, home=tmp_path), plan1, "1", tags) == []
    day2 = _ctx(tmp_path, "day2", **change)
    found = warm_start.problems(day2, _plan(day2, tmp_path / "plan2.json"), "1", tags)
    assert any(expected in p for p in found), found


def test_a_corrupt_missing_or_own_checkpoint_is_refused(tmp_path):
    day1 = _ctx(tmp_path, "day1")
    plan1 = _plan(day1, tmp_path / "plan1.json")
    ckpt = _final_checkpoint(day1, plan1, tmp_path / "ckpt")
    tags = warm_start.registration_tags(day1, plan1, ckpt)
    day2 = _ctx(tmp_path, "day2")
    assert "this run's own model" in warm_start.problems(day1, plan1, "1", tags)[0]
    data = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[:64] = bytes(b ^ 0xFF for b in raw[:64])  # bytes overwritten in place: same size, other content
    data.write_bytes(bytes(raw))
    (found,) = warm_start.problems(day2, plan1, "1", tags)
    assert "sha256 mismatch" in found and data.name in found
    assert "records no checkpoint" in warm_start.problems(day2, plan1, "1", {})[0]
    gone = {**tags, "checkpoint_dir": str(tmp_path / "nowhere")}
    assert "is gone" in warm_start.problems(day2, plan1, "1", gone)[0]
