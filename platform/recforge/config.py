"""Typed configuration for every stage, validated at the edge.

All models forbid unknown fields, so a typo in a config file is an error that names the field
instead of a silently ignored setting.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities, C1..C26.
CRITEO_KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# Share of missing values per column measured on Criteo Kaggle's day files (rounded).
CRITEO_DENSE_MISSING = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
CRITEO_SPARSE_MISSING = [
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.03, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44,
]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class DenseFeature(StrictModel):
    name: str = Field(min_length=1)
    missing_rate: float = Field(0.0, ge=0.0, lt=1.0)


class SparseFeature(StrictModel):
    name: str = Field(min_length=1)
    cardinality: int = Field(ge=1, description="distinct raw values in the source data")
    missing_rate: float = Field(0.0, ge=0.0, lt=1.0)


class DatasetConfig(StrictModel):
    """Schema of a raw day file: label, then dense integer columns, then sparse hex columns."""

    name: str = Field(min_length=1)
    label: str = "label"
    dense: list[DenseFeature]
    sparse: list[SparseFeature] = Field(min_length=1)
    positive_rate: float = Field(0.25, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _unique_names(self) -> "DatasetConfig":
        names = [self.label] + [f.name for f in self.dense] + [f.name for f in self.sparse]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"column names must be unique, repeated: {dupes}")
        return self

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.dense]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def num_fields(self) -> int:
        return 1 + len(self.dense) + len(self.sparse)


def criteo_kaggle_dataset() -> DatasetConfig:
    return DatasetConfig(
        name="criteo_kaggle",
        dense=[DenseFeature(name=f"I{i + 1}", missing_rate=m) for i, m in enumerate(CRITEO_DENSE_MISSING)],
        sparse=[
            SparseFeature(name=f"C{i + 1}", cardinality=c, missing_rate=m)
            for i, (c, m) in enumerate(zip(CRITEO_KAGGLE_CARDINALITIES, CRITEO_SPARSE_MISSING))
        ],
    )


def wide_dataset(num_sparse: int = 400, num_dense: int = 13) -> DatasetConfig:
    """Hundreds of sparse columns, cycling through Criteo's cardinalities and missing rates."""
    n = len(CRITEO_KAGGLE_CARDINALITIES)
    return DatasetConfig(
        name=f"wide{num_sparse}",
        dense=[DenseFeature(name=f"I{i + 1}", missing_rate=CRITEO_DENSE_MISSING[i % 13]) for i in range(num_dense)],
        sparse=[
            SparseFeature(
                name=f"C{i + 1}",
                cardinality=CRITEO_KAGGLE_CARDINALITIES[i % n],
                missing_rate=CRITEO_SPARSE_MISSING[i % n],
            )
            for i in range(num_sparse)
        ],
    )


def _plan_dataset(plan: str):
    """The schema RAP's plan preset `plan` reads (recforge.preprocess.presets; imported when asked for)."""

    def build() -> DatasetConfig:
        from recforge.preprocess.presets import preset_dataset

        return preset_dataset(plan)

    return build


DATASET_PRESETS = {"criteo_kaggle": criteo_kaggle_dataset, "wide400": wide_dataset,
                   "criteo_terabyte": _plan_dataset("plan1"), "rap_plan2": _plan_dataset("plan2"),
                   "rap_plan3": _plan_dataset("plan3")}


def dataset_preset(name: str) -> DatasetConfig:
    if name not in DATASET_PRESETS:
        raise ValueError(f"dataset_preset: unknown preset {name!r}; choose one of {sorted(DATASET_PRESETS)}")
    return DATASET_PRESETS[name]()


class ModelConfig(StrictModel):
    arch: Literal["dlrm", "dlrm_dcn"] = "dlrm"
    embedding_dim: int = Field(16, ge=1)
    dense_arch: list[int] = Field(default_factory=lambda: [64, 16], min_length=1)
    over_arch: list[int] = Field(default_factory=lambda: [64, 32, 1], min_length=1)
    dcn_num_layers: int = Field(2, ge=1)
    dcn_low_rank_dim: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch: last layer ({self.dense_arch[-1]}) must equal embedding_dim ({self.embedding_dim})"
            )
        if self.over_arch[-1] != 1:
            raise ValueError(f"over_arch: last layer must be 1 (one logit), got {self.over_arch[-1]}")
        return self


class TrainConfig(StrictModel):
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(512, ge=1, description="per-worker batch size")
    embedding_lr: float = Field(0.05, gt=0)
    dense_lr: float = Field(0.002, gt=0)
    batches_per_task: int = Field(8, ge=1, description="data-shard task size handed out by the job master")
    log_every: int = Field(20, ge=1)
    sharding: Literal["auto", "table_wise", "column_wise", "data_parallel"] = "auto"
    fused_embeddings: bool = Field(True, description="FBGEMM TBE with the optimizer applied in backward")
    lease_timeout_s: float = Field(120.0, gt=0)


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
    workers: int = Field(2, ge=1)
    threads_per_worker: int = Field(1, ge=1)
    backend: Literal["local", "kubernetes"] = "local"
    policy: Literal["static", "dlrover"] = "static"
    max_restarts: int = Field(3, ge=0)
    dlrover: DLRoverConfig = Field(default_factory=DLRoverConfig)


class CorunConfig(StrictModel):
    """RAP co-running in the training workers (preprocessing: corun; recforge.rap)."""

    threads: int = Field(1, ge=1, description="intra-op threads of each worker's co-run thread (<= threads_per_worker)")
    stage: Literal["emb_fwd", "mlp_fwd", "mlp_bwd", "emb_bwd", "allreduce"] = Field(
        "mlp_bwd", description="without a stored stage profile: the training stage every fused kernel starts in")
    profile_dir: str | None = Field(None, description="stored RAP stage profiles (default $RECFORGE_HOME/rap/profiles)")
    mapping: bool = Field(True, description="RAP's mapping (2+ workers): tables placed by the mapping MILP, each table's ids "
                          "preprocessed on its owner over the global batch, no input all-to-all (recforge.rap.mapped_input)")


class PipelineConfig(StrictModel):
    """One daily pipeline run; the DAG's Params map onto these fields."""

    dataset_preset: str = "criteo_kaggle"
    source_dir: str | None = Field(None, description="raw day files (day_*.tsv[.gz]) to ingest; None generates synthetic days")
    rows_per_day: int = Field(200_000, ge=100)
    train_days: int = Field(1, ge=1, description="days trained on; one more day is held out for evaluation")
    seed: int = 0
    table_cap: int = Field(100_000, ge=1, description="embedding rows per table: sigrid_hash modulus is min(cardinality, cap)")
    rows_per_shard: int = Field(50_000, ge=1)
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    champion_margin: float = Field(0.005, ge=0.0, description="AUC a new model may lose against the champion and still be promoted")
    preprocess_executor: Literal["eager", "fused", "dali"] = Field(
        "fused", description="preprocessing executor of the training workers (recforge.preprocess.executor.make_executor)")
    preprocess_plan: str = Field(
        "criteo", description="preprocessing plan: 'criteo' (RAP plan 0 over the dataset, tables capped by table_cap), "
        "a preset 'plan0'..'plan3', or a plan file path (.json/.yaml)")
    preprocessing: Literal["inline", "corun", "offline"] = Field(
        "inline", description="inline: each worker preprocesses a batch right before its step; corun: RAP, batch "
        "i+1's fused kernels run inside step i's stages (recforge.rap); offline: the train task preprocesses the "
        "whole training data first, then trains from it")
    corun: CorunConfig = Field(default_factory=CorunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    resources: ResourceConfig = Field(default_factory=ResourceConfig)

    @field_validator("dataset_preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in DATASET_PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {sorted(DATASET_PRESETS)}")
        return v

    def dataset(self) -> DatasetConfig:
        return dataset_preset(self.dataset_preset)


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
