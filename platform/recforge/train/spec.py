"""The worker spec: everything one training worker needs, written by the launcher as JSON."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from recforge.config import DatasetConfig, ModelConfig, TrainConfig
from recforge.train.recovery.spec import RecoverySpec


class WorkerSpec(BaseModel):
    """`python -m recforge.worker SPEC_JSON` reads one of these (the same file for every rank)."""

    model_config = ConfigDict(extra="forbid")

    manifest_dir: Path = Field(description="directory holding manifest.json of the training shards")
    plan_path: Path = Field(description="preprocessing Plan as JSON")
    preprocess_executor: str = Field("fused",
                                     description="eager | fused | dali (recforge.preprocess.executor.make_executor)")
    dataset: DatasetConfig
    model: ModelConfig
    train: TrainConfig
    master_url: str | None = Field(None, min_length=1, description="job master base URL, e.g. http://127.0.0.1:PORT; "
                                   "the launcher (recforge.elastic.job.run_training_job) fills it in")
    master_token_file: Path | None = Field(
        None, description="file holding the job master's bearer token (run_training_job writes <state_dir>/"
                          "master.token, or names the mounted Secret); read by the workers, never logged")
    checkpoint_dir: Path = Field(description="DCP checkpoint written here at the end (temp + rename)")
    output_dir: Path = Field(description="rank 0 writes result.json and probe.pt here")
    threads_per_worker: int = Field(1, ge=1)
    seed: int = 0
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    recovery: RecoverySpec = Field(default_factory=RecoverySpec, description="checkpoints, restarts, flash, accounting")
    preprocessing: Literal["inline", "corun", "offline"] = Field(
        "inline", description="corun: RAP co-running; offline: train from preprocessed_dir (recforge.rap)")
    preprocessed_dir: Path | None = Field(None, description="offline: rows preprocessed before training")
    corun_schedule_path: Path | None = Field(None,
                                             description="co-run schedule JSON (default: every kernel in mlp_bwd)")
    corun_mapping_path: Path | None = Field(
        None, description="RAP mapping JSON (recforge.rap.mapping.worker_mapping): table placements + per-rank co-run "
                          "jobs; ids preprocessed on their table's owner")
    corun_threads: int = Field(1, ge=1, description="intra-op threads of the co-run thread")
    init_checkpoint: Path | None = Field(
        None, description="warm start: a final DCP checkpoint (model + optimizer state, e.g. the champion's) loaded "
                          "at the start when this run has no step checkpoint of its own "
                          "(recforge.worker.init_checkpoint)")

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSpec:
        if self.preprocessing == "offline" and self.preprocessed_dir is None:
            raise ValueError("preprocessed_dir: required when preprocessing is 'offline'")
        if self.mlflow_run_id is not None and not self.tracking_uri:
            raise ValueError("tracking_uri: required when mlflow_run_id is set")
        if not self.train.fused_embeddings and self.train.sharding in ("table_wise", "column_wise"):
            raise ValueError(
                f"train.sharding: {self.train.sharding!r} needs train.fused_embeddings=true; torchrec on CPU "
                "runs the plain (dense) embedding kernel only with data_parallel sharding "
                "(use 'auto' or 'data_parallel')"
            )
        return self

    @classmethod
    def load(cls, path: str | Path) -> WorkerSpec:
        """The spec a worker runs: as launched, so with its master_url."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"worker spec not found: {path}")
        spec = cls.model_validate_json(path.read_text())
        if spec.master_url is None:
            raise ValueError(f"master_url: required to run a worker; {path} was not written by a launcher")
        return spec

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename) so a launching rank never reads half a spec."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.model_dump(mode="json"), indent=2))
        os.replace(tmp, path)
        return path
