"""Continuous training: start the day's training from the champion's final checkpoint (weights and optimizer state)
when its schema, plan and model match this run's, else from scratch with the reason. Design: docs/champion_gate.md.

Publish tags each registered version with what this needs (`registration_tags`); the train stage asks `choose`
which checkpoint, if any, its workers load (WorkerSpec.init_checkpoint, recforge.worker.init_checkpoint)."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from recforge.config import DatasetConfig, PipelineConfig
from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import PlanOutputs, WarmStartRecord
from recforge.preprocess.planning.plan import Plan
from recforge.train.recovery.layout import DISK, checkpoint_problem, fingerprint, plan_sha256
from recforge.train.recovery.private_dir import private_dir_problem

log = logging.getLogger("recforge.pipelines")

REGISTERED_MODEL = "recforge-dlrm"  # the model the pipeline publishes and warm-starts from
MARKER = "warm_start.json"  # rank 0 writes it into the worker output dir once it loaded the init checkpoint
DECISION = "warm_start.json"  # in the train stage's work dir: the first attempt's decision, kept for its retries

# version tags publish sets (registration_tags); `problems` reads them
TAG_EXPERIMENT, TAG_RUN_KEY, TAG_CHECKPOINT = "experiment", "run_key", "checkpoint_dir"
TAG_SCHEMA, TAG_PLAN, TAG_MODEL, TAG_OPTIMIZER = "schema_hash", "plan_hash", "model_config", "optimizer"


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def schema_fingerprint(dataset: DatasetConfig) -> str:
    """The dataset's features (label, dense and sparse column names, in order), not its generator settings."""
    return _digest({"label": dataset.label, "dense": dataset.dense_names, "sparse": dataset.sparse_names})


def plan_fingerprint(plan_path: str | Path) -> str:
    """The preprocessing plan's hash as checkpoints record it (layout.plan_sha256: its features, not its name)."""
    return plan_sha256(Plan.load(plan_path).model_dump(mode="json"))


def optimizer_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """What the saved optimizer state depends on: the optimizers, their learning rates and the embedding kernel."""
    t = cfg.train
    settings: dict[str, Any] = {"embedding_lr": t.embedding_lr, "dense_lr": t.dense_lr,
                                "fused_embeddings": t.fused_embeddings}
    if (t.embedding_optimizer, t.dense_optimizer) != ("rowwise_adagrad", "adam"):  # champions tagged before the
        settings |= {"embedding_optimizer": t.embedding_optimizer,  # optimizers were configuration used these
                     "dense_optimizer": t.dense_optimizer}
    return settings


def registration_tags(ctx: RunContext, plan: PlanOutputs, checkpoint_dir: str | Path) -> dict[str, str]:
    """Tags of a registered version: where its final checkpoint lies (TrainOutputs.checkpoint_dir) and what it
    was trained on."""
    cfg = ctx.config
    return {TAG_EXPERIMENT: ctx.experiment, TAG_RUN_KEY: ctx.run_key, TAG_CHECKPOINT: str(checkpoint_dir),
            TAG_SCHEMA: schema_fingerprint(cfg.dataset()), TAG_PLAN: plan_fingerprint(plan.plan_path),
            TAG_MODEL: json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True),
            TAG_OPTIMIZER: json.dumps(optimizer_settings(cfg), sort_keys=True)}


def wanted(ctx: RunContext) -> tuple[bool, str]:
    """Does this run want the champion (train.warm_start, 'auto' by the run type)? And why."""
    requested = ctx.config.train.warm_start
    if requested == "scratch":
        return False, "train.warm_start is 'scratch'"
    if requested == "auto" and ctx.run_type != "scheduled":
        return False, f"train.warm_start 'auto': a {ctx.run_type} run trains from scratch (auto warm-starts " \
                      f"scheduled runs)"
    return True, f"train.warm_start {requested!r}" + (" (scheduled run)" if requested == "auto" else "")


def problems(ctx: RunContext, plan: PlanOutputs, version: str, tags: dict[str, str]) -> list[str]:
    """Why the champion (`version`, its registry tags) cannot seed this run; empty when it can. Its checkpoint must
    pass the checkpoint's own check (checksums, and its fingerprint: model config, tables, dense features, plan hash;
    recforge.train.recovery.layout), and its dataset schema and optimizer settings must be this run's."""
    ckpt = tags.get(TAG_CHECKPOINT)
    if not ckpt:
        return [f"v{version} records no checkpoint (tag {TAG_CHECKPOINT!r}; registered before warm start existed)"]
    if tags.get(TAG_RUN_KEY) == ctx.run_key and tags.get(TAG_EXPERIMENT) == ctx.experiment:
        return [f"v{version} is this run's own model (a rerun): training from it would train the day twice"]
    path = Path(ckpt)
    if not (path / ".metadata").exists():
        return [f"its checkpoint {path} is gone (no DCP .metadata)"]
    unsafe = private_dir_problem(path)
    if unsafe is not None:  # DCP unpickles its .metadata: only a directory of this user (docs/security.md)
        return [f"its checkpoint {path} is refused: {unsafe}"]
    found: list[str] = []
    cfg = ctx.config
    ours_schema, theirs_schema = schema_fingerprint(cfg.dataset()), tags.get(TAG_SCHEMA)
    if theirs_schema != ours_schema:
        found.append(f"dataset schema (features) differs (hash {theirs_schema} vs this run's {ours_schema})"
                     if theirs_schema else f"v{version} records no dataset schema (tag {TAG_SCHEMA!r})")
    ours_opt = optimizer_settings(cfg)
    theirs_opt = tags.get(TAG_OPTIMIZER)
    if theirs_opt is None or json.loads(theirs_opt) != ours_opt:
        found.append(f"optimizer settings differ ({theirs_opt} vs this run's {json.dumps(ours_opt, sort_keys=True)})")
    current = fingerprint(cfg.model.model_dump(mode="json"), plan.tables, plan.num_dense,
                          Plan.load(plan.plan_path).model_dump(mode="json"))
    problem = checkpoint_problem(path, DISK, current=current)  # sha256 of every file, then the fingerprint
    if problem is not None:
        found.append(f"its checkpoint {path}: {problem}")
    return found


def choose(ctx: RunContext, store: Any, run_id: str, plan: PlanOutputs,
           work: Path | None = None) -> tuple[WarmStartRecord, Path | None]:
    """The warm-start decision of the train stage: its record (also logged to the stage's MLflow run) and the
    checkpoint the workers load (None: from scratch). With a `work` dir (the job's state that a retried task
    resumes), the first attempt's decision is kept there and reused: its step checkpoints descend from it."""
    kept = Path(work) / DECISION if work is not None else None
    if kept is not None and kept.exists():
        record = WarmStartRecord.model_validate_json(kept.read_text())
        record = record.model_copy(update={"reason": record.reason + " (decided by an earlier attempt of the task)"})
        init = Path(record.checkpoint) if record.used and record.checkpoint else None
    else:
        record, init = decide(ctx, store, plan)
        if kept is not None:
            kept.write_text(record.model_dump_json(indent=1))
    (log.warning if ctx.config.train.warm_start == "champion" and not record.used else log.info)(
        "warm start: %s", record.reason)
    log_record(store, run_id, record)
    return record, init


def decide(ctx: RunContext, store: Any, plan: PlanOutputs) -> tuple[WarmStartRecord, Path | None]:
    """Warm start from the current champion? By train.warm_start, the run type and `problems`."""
    requested = ctx.config.train.warm_start
    want, why = wanted(ctx)
    if not want:
        return WarmStartRecord(requested=requested, used=False, reason=f"from scratch: {why}"), None
    from recforge.tracking.registry import ModelRegistry  # lazy: mlflow off the DAG-parse path

    champion = ModelRegistry(store, REGISTERED_MODEL).champion_ref()
    if champion is None:
        return WarmStartRecord(requested=requested, used=False, reason=f"from scratch: {why}, no champion yet"), None
    found = problems(ctx, plan, champion.version, champion.tags)
    if found:
        return WarmStartRecord(requested=requested, used=False, champion_version=champion.version,
                               reason=f"from scratch: champion v{champion.version} refused: " + "; ".join(found)), None
    init = Path(champion.tags[TAG_CHECKPOINT])
    return WarmStartRecord(
        requested=requested, used=True, champion_version=champion.version, checkpoint=str(init),
        reason=f"{why}: champion v{champion.version} (run {champion.tags.get(TAG_RUN_KEY)}) matches schema, plan, "
               f"model and optimizer: starting from its checkpoint {init}"), init


def confirm(record: WarmStartRecord, worker_output_dir: Path, resumed: bool) -> WarmStartRecord:
    """The record as the workers carried it out: rank 0 leaves MARKER once it loaded the init checkpoint."""
    if not record.used:
        return record
    marker = Path(worker_output_dir) / MARKER
    if marker.exists():
        info = json.loads(marker.read_text())
        note = (f"; loaded by the workers in {info['load_s']:.2f}s (saved at world size {info['saved_world_size']}, "
                f"loaded at {info['world_size']})")
    elif resumed:
        note = "; this attempt resumed the run's own step checkpoint, which descends from it"
    else:
        note = "; the workers did not report loading it"
    return record.model_copy(update={"reason": record.reason + note})


def log_record(store: Any, run_id: str, record: WarmStartRecord) -> None:
    """Tags and a metric, not params: a retry may decide differently (the champion moved) and params are immutable."""
    store.set_tags(run_id, {"warm_start.requested": record.requested, "warm_start.used": record.used,
                            "warm_start.champion_version": record.champion_version or "",
                            "warm_start.reason": record.reason[:5000]})
    store.log_metrics(run_id, {"warm_start_used": float(record.used)})
