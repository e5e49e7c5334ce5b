"""Typed configuration of a pipeline run: model, training, resources, RAP co-run, and the whole PipelineConfig."""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from recforge.config.base import StrictModel
from recforge.config.datasets import HASH_HEADROOM, DatasetConfig, load_dataset


class ModelConfig(StrictModel):
    arch: Literal["dlrm", "dlrm_dcn"] = Field(
        "dlrm", description="dlrm: dot-product interaction; dlrm_dcn: DCN-v2 cross layers over the embeddings")
    embedding_dim: int = Field(16, ge=1)
    dense_arch: list[int] = Field(default_factory=lambda: [64, 16], min_length=1)
    over_arch: list[int] = Field(default_factory=lambda: [64, 32, 1], min_length=1)
    dcn_num_layers: int = Field(2, ge=1)
    dcn_low_rank_dim: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch: last layer ({self.dense_arch[-1]}) must equal embedding_dim ({self.embedding_dim})"
            )
        if self.over_arch[-1] != 1:
            raise ValueError(f"over_arch: last layer must be 1 (one logit), got {self.over_arch[-1]}")
        return self


class TrainConfig(StrictModel):
    epochs: int = Field(1, ge=1, description="passes over the training days")
    batch_size: int = Field(512, ge=1, description="per-worker batch size")
    embedding_optimizer: Literal["rowwise_adagrad", "adagrad", "sgd"] = Field(
        "rowwise_adagrad", description="optimizer of the embedding tables (FBGEMM's fused one where the table is "
        "sharded table_wise / column_wise)")
    embedding_lr: float = Field(0.05, gt=0, description="learning rate of the embedding optimizer")
    dense_optimizer: Literal["adam", "sgd"] = Field("adam", description="optimizer of the dense (MLP) parameters")
    dense_lr: float = Field(0.002, gt=0, description="learning rate of the dense optimizer")
    batches_per_task: int = Field(8, ge=1, description="data-shard task size handed out by the job master")
    prefetch_steps: int = Field(
        4, ge=0, description="steps each rank prepares ahead on a thread (lease, read, preprocess); 0 = synchronous "
        "loop; unused with preprocessing corun (RAP's source reads ahead itself). 4: the training thread waited "
        "for its next step ~40% less than at 2 on the 2-core benchmark (docs/performance.md)")
    sparse_dist_pipeline: bool = Field(
        False, description="overlap each step's sparse input all-to-all with the previous step (TorchRec's "
        "TrainPipelineSparseDist); applies with prefetch_steps >= 1, one micro-batch per step and no RAP co-run. Off: "
        "on the 2-core CPU benchmark its own CPU per step outweighed the wait it hides (docs/performance.md)")
    prefetch_sched: Literal["idle", "normal"] = Field(
        "idle", description="scheduling of each rank's prefetch thread: idle (SCHED_IDLE: it takes a core only when "
        "nothing else of the rank wants it, so it does not delay the step and with it the other ranks' collectives) "
        "or normal; env RECFORGE_PREFETCH_SCHED in the workers' environment overrides it (the local backend passes the "
        "launching process's: benchmarks)")
    fused_interaction: bool = Field(
        True, description="train DLRM's dot interaction with recforge's C++ kernel (forward and backward) and the "
        "pooled embeddings as a view where their key order allows, in place of torchrec's batched matmul + gather + "
        "concatenation: the same values, ~4x faster forward + backward at 512 rows on the 2-core "
        "benchmark (docs/performance.md); off: torchrec's DLRM modules as they ship")
    rowwise_adagrad_kernel: bool = Field(
        True, description="apply row-wise Adagrad to the fused embedding tables in backward with recforge's C++ "
        "kernel (each table's distinct rows by hashing, the update in place on FBGEMM's own weights and momentum) "
        "in place of FBGEMM's CPU backward: the same update to float rounding, ~5x faster at 13 tables x 1,024 "
        "lookups on the 2-core benchmark (docs/performance.md); CPU tables with embedding_optimizer rowwise_adagrad "
        "only, others keep FBGEMM's. Off: FBGEMM's backward everywhere")
    dense_grad_exchange: bool = Field(
        True, description="average the dense gradients across ranks with one all_to_all exchange (each rank sends "
        "its gradient bucket to every other and sums the copies in rank order) instead of DDP's allreduce, for gloo "
        "groups of 2-4 ranks and buckets up to 262,144 values: 0.73 against 1.7 ms for 32k floats on the 2-core "
        "benchmark (docs/performance.md); "
        "other groups keep the allreduce. Off: DDP's allreduce everywhere")
    log_every: int = Field(20, ge=1)
    sharding: Literal["auto", "table_wise", "column_wise", "data_parallel"] = "auto"
    fused_embeddings: bool = Field(True, description="FBGEMM TBE with the optimizer applied in backward")
    lease_timeout_s: float = Field(120.0, gt=0)
    warm_start: Literal["auto", "champion", "scratch"] = Field(
        "auto", description="continuous training: 'champion' starts from the current champion's weights and "
        "optimizer state when its schema and plan match this run's (else from scratch, the reason logged); 'auto' "
        "is 'champion' for scheduled runs and 'scratch' for manual ones; 'scratch' never warm-starts")


# the training job's default time limit (resources.job_timeout_s); the Airflow train task's execution_timeout
# (recforge.pipelines.dag_tasks.stage_timeouts) is this plus a margin for what the task does around the job
JOB_TIMEOUT_S = 4 * 3600.0


class DLRoverConfig(StrictModel):
    """DLRover-RM stages 2/3 while a job trains (resources.policy == "dlrover"); defaults are DLRover's."""

    profile_interval_s: float = Field(5.0, gt=0, description="seconds between throughput samples of the running job")
    profile_samples: int = Field(3, ge=1, description="samples at a plan before stage 2 acts on it")
    change_interval_s: float = Field(300.0, ge=0, description="pacing: at least this long between executed changes")
    min_gain_ratio: float = Field(0.2, gt=0, description="stop growing below this marginal gain ratio")
    pending_timeout_s: float = Field(600.0, gt=0, description="pods pending this long are relaunched smaller")
    max_cpu: float | None = Field(None, gt=0, description="the job's total cores (default: this machine's)")
    max_workers: int | None = Field(None, ge=1, description="the most workers (default: 60, DLRover's cap)")
    worker_memory_gib: float | None = Field(None, gt=0, description="memory per worker the plan starts from "
                                            "(default 4 GiB; the pods' request on Kubernetes)")


class ResourceConfig(StrictModel):
    workers: int = Field(2, ge=1, description="training worker processes (policy dlrover: the request its stage 1 "
                         "plans from)")
    threads_per_worker: int = Field(1, ge=1, description="intra-op threads of each training worker")
    backend: Literal["local", "kubernetes"] = "local"
    allocator: Literal["kept", "system"] = Field(
        "kept", description="memory allocators of the worker processes: kept (glibc's mmap/trim thresholds fixed "
        "high and Arrow on the system allocator, so freed pages stay with the rank instead of faulting in anew each "
        "step) or system (every allocator as it is); env RECFORGE_ALLOCATOR in the launching process overrides it for "
        "a local job (benchmarks)")
    policy: Literal["static", "dlrover"] = Field(
        "dlrover", description="dlrover: DLRover-RM plans the job (stage 1 from MLflow history) and adjusts it while "
        "it trains (stages 2/3); static: exactly `workers` x `threads_per_worker`")
    max_restarts: int = Field(3, ge=0, description="worker-group relaunches the job may spend before it fails")
    job_timeout_s: float = Field(
        JOB_TIMEOUT_S, gt=0, description="the training job is stopped and fails after this many seconds (all its "
        "relaunches included); the DAG's train task allows this plus a margin (its execution_timeout)")
    dlrover: DLRoverConfig = Field(default_factory=DLRoverConfig)


class CorunConfig(StrictModel):
    """RAP co-running in the training workers (preprocessing: corun; recforge.rap)."""

    threads: int = Field(1, ge=1, description="intra-op threads of each worker's co-run thread (<= threads_per_worker)")
    stage: Literal["emb_fwd", "mlp_fwd", "mlp_bwd", "emb_bwd", "allreduce"] = Field(
        "mlp_bwd", description="without a stored stage profile: the training stage every fused kernel starts in")
    profile_dir: str | None = Field(None, description="stored RAP stage profiles (default $RECFORGE_HOME/rap/profiles)")
    mapping: bool = Field(True, description="RAP's mapping (2+ workers): tables placed by the mapping MILP, each "
                          "table's ids preprocessed on its owner over the global batch, no input all-to-all "
                          "(recforge.rap.mapping.mapped_input)")


class CheckpointConfig(StrictModel):
    """Resumable checkpoints of the training job (recforge.train.recovery): what retries and relaunches resume from."""

    every_steps: int = Field(
        100, ge=0, description="periodic DCP checkpoint every this many optimizer steps; 0: only the final one (a "
        "retry or relaunch then trains from scratch)")
    flash: bool = Field(True, description="flash checkpoints: save to shared memory, persisted to disk by the agent")
    keep: int = Field(2, ge=1, description="step checkpoints kept on disk")


class PipelineConfig(StrictModel):
    """One daily pipeline run; the DAG's Params map onto these fields."""

    dataset_schema: str = Field(
        "criteo_kaggle", description="schema of the raw days: a shipped schema (criteo_kaggle, criteo_terabyte) or a "
        "dataset schema file (.yaml, see docs/data.md)")
    source_uri: str | None = Field(
        None, description="the day's landing file(s): a local path or fsspec URL with {ds} (the day, YYYY-MM-DD) or "
        "{ds_nodash}, a glob allowed, e.g. /data/landing/day_{ds}.tsv.gz or s3://bucket/clicks/dt={ds}/part-*.parquet; "
        "the DAG's wait_for_data task waits for every day the run needs; empty: synthetic days (the demo's source)")
    ready_marker: str | None = Field(
        None, description="optional marker file a producer writes once a day is complete, with {ds} or {ds_nodash}, "
        "e.g. s3://bucket/clicks/dt={ds}/_SUCCESS: the sensor waits for it (instead of for the day's files to stop "
        "changing for sensor_poke_s)")
    holdout: Literal["next_day", "split"] = Field(
        "next_day", description="the held-out rows: next_day, the day after the run's day (the run waits for it); "
        "split, the last holdout_fraction of the run day's rows (no wait for the next day)")
    holdout_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="holdout split: share of the run day's rows, its last ones, held out")
    sensor_timeout_s: float = Field(
        30 * 3600.0, gt=0, le=7 * 86400.0, description="wait_for_data fails after waiting this many seconds for the "
        "landing files, naming the missing path(s) and day (default 30 h: with holdout next_day a scheduled run "
        "waits for the following day's file, which lands about a day after its own)")
    sensor_poke_s: float = Field(
        60.0, gt=0, le=3600.0, description="seconds between looks at the landing zone; a file counts as landed once "
        "it has not changed for this long")
    rows_per_day: int = Field(200_000, ge=100, description="synthetic rows per day (source_uri empty)")
    train_days: int = Field(
        1, ge=1, description="days trained on, ending with the run's day (its logical date)")
    seed: int = Field(0, description="seed of the synthetic data, model initialisation and data order")
    table_cap: int = Field(
        100_000, ge=1, description="embedding rows per table at most: the schema plan's sigrid_hash modulus is "
        "min(cardinality x hash_headroom, table_cap)")
    hash_headroom: int = Field(
        HASH_HEADROOM, ge=1, le=1_000_000, description="the schema plan hashes a column of n known values into "
        "n x this many rows (capped by table_cap): 1 makes ~63% of the values share a row with another, 64 ~1.5%")
    rows_per_shard: int = Field(50_000, ge=1)
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    champion_margin: float = Field(
        0.005, ge=0.0, description="AUC a new model may lose against the champion and still be promoted")
    champion_min_auc: float = Field(
        0.55, ge=0.0, le=1.0, description="absolute floor: a model below this held-out AUC is never promoted")
    champion_min_rows: int = Field(
        1000, ge=1, description="a model is promoted only when evaluated on at least this many held-out rows")
    preprocess_executor: Literal["eager", "fused", "dali"] = Field(
        "fused",
        description="preprocessing executor of the training workers (recforge.preprocess.executor.make_executor)")
    preprocess_plan: str = Field(
        "schema", description="preprocessing plan: 'schema' (derived from the dataset's column roles: fill_null, "
        "clip and log1p for dense plus a missing indicator per dense column, sigrid_hash to table sizes for "
        "categorical, firstx(max_length) for multi_hot; docs/data.md), 'criteo' (RAP plan 0 over the dataset), "
        "a RAP preset 'plan0'..'plan3', or a plan file path (.json/.yaml); tables capped by table_cap")
    preprocessing: Literal["auto", "inline", "corun", "offline"] = Field(
        "auto", description="auto: plan_resources profiles the job and picks corun when RAP's predicted iteration "
        "time beats inline, else inline (recording both predictions and why); "
        "inline: each worker preprocesses a batch right before its step; corun: RAP, batch "
        "i+1's fused kernels run inside step i's stages (recforge.rap); offline: the train task preprocesses the "
        "whole training data first, then trains from it")
    compile_backend: Literal["auto", "export", "inductor", "aoti"] = Field(
        "auto", description="RECom's backend for the compiled model's dense net (recforge.recom.compile): auto, "
        "AOTInductor (a C++ build, ~1-4 min on 2 cores; the fastest at serving) falling back to the exported graph "
        "where it cannot build; export, the exported graph run as captured (no build); inductor, torch.compile; "
        "aoti, AOTInductor or fail. The embedding columns are fused by RECom under every backend")
    corun: CorunConfig = Field(default_factory=CorunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    resources: ResourceConfig = Field(default_factory=ResourceConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @field_validator("dataset_schema")
    @classmethod
    def _known_schema(cls, v: str) -> str:
        load_dataset(v)  # a shipped name or a schema file that validates; the error names the field and column
        return v

    @field_validator("source_uri", "ready_marker")
    @classmethod
    def _day_template(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None  # empty: not set
        day_template_fields(v)
        return v

    def dataset(self) -> DatasetConfig:
        return load_dataset(self.dataset_schema)


DAY_PLACEHOLDERS = ("ds", "ds_nodash")  # what a source_uri / ready_marker may contain: the day, as Airflow names it


def day_template_fields(template: str) -> set[str]:
    """The placeholders of a landing path template; ValueError unless it has {ds} or {ds_nodash} and nothing else."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{template!r} is not a valid path template ({e}); "
                         "write a literal brace as {{ or }}") from e
    names = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in DAY_PLACEHOLDERS or spec or conversion:
            raise ValueError(f"{template!r}: unknown placeholder {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}}; use {{ds}} (YYYY-MM-DD) or {{ds_nodash}} (YYYYMMDD)")
        names.add(name)
    if not names:
        raise ValueError(f"{template!r} names no day: put {{ds}} (YYYY-MM-DD) or {{ds_nodash}} (YYYYMMDD) in it, "
                         "e.g. /data/landing/day_{ds}.tsv.gz")
    return names


def load_config(path: str | Path, model: type[BaseModel] = PipelineConfig) -> BaseModel:
    """Load YAML or JSON into `model`; pydantic's error names the offending field."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if data is None:
        raise ValueError(f"config file is empty: {path}")
    return model.model_validate(data)
