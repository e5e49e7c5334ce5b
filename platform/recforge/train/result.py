"""What rank 0 of a training job writes to `<output_dir>/result.json` and the pipeline reads back: `WorkerResult`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

RESULT_FILE = "result.json"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class TableSharding(_Record):
    """One embedding table as the planner sharded it (recforge.train.sharding.plan_summary)."""

    sharding_type: str
    compute_kernel: str
    ranks: list[int]


class ProbeRange(_Record):
    """Rows whose logits rank 0 saved to probe.pt (recforge.train.probe.probe_logits, less the logits)."""

    shard: int
    row_start: int
    row_end: int


class ResumedFrom(_Record):
    """The checkpoint this generation resumed from (recforge.train.recovery.resume.Restored)."""

    path: str
    step: int
    source: str = Field(description="disk | memory")
    saved_by_generation: int | None = None
    saved_at_world_size: int | None = None
    skipped: list[tuple[str, str]] = Field(default_factory=list, description="(path, why) of newer unusable ones")


class CheckpointStats(_Record):
    """Step checkpoints this generation wrote (recforge.train.recovery.checkpointer.Checkpointer.summary)."""

    checkpoints: int
    kind: str = Field(description="memory | disk")
    stall_s_median: float | None = None
    stall_s: list[float]
    flash_full_saves: int | None = None
    flash_fast_saves: int | None = None


class ExecutedPreprocessing(_Record):
    """The preprocessing executor path rank 0 ran over this generation's training batches, counted per batch
    (recforge.preprocess.executors.record.summarize); the train stage copies it into TrainOutputs.executor."""

    requested: str = Field(description="as configured: eager | fused | dali")
    path: str = Field(description="what ran: cpp_single_pass | cpp_per_group | triton_per_group | torch_fallback | "
                      "eager | dali | module, '+' between several (most batches first); none: no batch here")
    native_kernels: bool = Field(description="everything that ran used recforge_kernels' C++ / Triton kernels")
    detail: dict[str, Any] = Field(default_factory=dict, description="batches and group calls per path, reasons")


class WorkerResult(_Record):
    """The job's result as rank 0 of the last generation saw it."""

    world_size: int = Field(ge=1)
    steps: int = Field(ge=0, description="optimizer steps, counted across generations")
    epochs: list[int]
    samples_per_epoch: list[int]
    loss_per_epoch: list[float | None]
    final_loss: float | None = None
    wall_s: float = Field(description="this process, start to result")
    train_wall_s: float = Field(description="the training loop only")
    samples_per_s: float = Field(description="samples this generation trained / train_wall_s")
    batch_size: int
    threads_per_worker: int
    fused_embeddings: bool
    sharding_plan: dict[str, TableSharding]
    checkpoint_dir: str
    probe: ProbeRange
    generation: int
    resumed_from: ResumedFrom | None = None
    checkpoints: CheckpointStats
    grad_accumulation: int = Field(ge=1)
    micro_batch_size: int
    rows_per_rank_step: int
    global_batch: int
    rap: dict[str, Any] | None = Field(None, description="RAP co-run summary (recforge.rap CorunSession.summary)")
    executor: ExecutedPreprocessing | None = Field(None, description="the preprocessing path that executed")
    peak_rss_bytes: list[float] | None = Field(
        None, description="peak resident memory of each rank of this generation (bytes, by rank): DLRover-RM's "
        "memory model is fitted on these")
    prefetch_steps: int | None = Field(
        None, ge=0, description="steps each rank prepared ahead on the prefetch thread as run: train.prefetch_steps, "
        "or env RECFORGE_TRAIN_PREFETCH; 0: the synchronous loop (RAP co-run always); None: not recorded")
    prefetch_sched: Literal["idle", "normal"] | None = Field(
        None, description="the prefetch thread's scheduling as run: idle (SCHED_IDLE, the default) or normal (env "
        "RECFORGE_PREFETCH_SCHED=normal, or where SCHED_IDLE could not be set); None: no prefetch thread ran")
    allocator: Literal["kept", "system"] | None = Field(
        None, description="the ranks' allocator mode as launched (env RECFORGE_ALLOCATOR, recforge.elastic."
        "allocator_env): kept (the default: freed pages stay with the process) or system; None: not recorded")
    sparse_dist_pipeline: bool | None = Field(
        None, description="whether the step loop ran TorchRec's TrainPipelineSparseDist (train.sparse_dist_pipeline "
        "or env RECFORGE_TRAIN_PIPELINE, where it applies); None: not recorded")
    interaction: Literal["cpp", "torch", "torchrec"] | None = Field(
        None, description="how the model's dot interaction ran: cpp (recforge's C++ kernel, train.fused_interaction), "
        "torch (its torch fallback: the kernel could not be built) or torchrec (torchrec's module: "
        "train.fused_interaction off, or DLRM-DCN's cross net); None: not recorded")
    embedding_update: Literal["cpp", "fbgemm", "mixed", "none"] | None = Field(
        None, description="which kernel applied the embedding optimizer to the fused tables in backward: cpp "
        "(recforge's row-wise Adagrad kernel, train.rowwise_adagrad_kernel), fbgemm (FBGEMM's: the option off, "
        "another embedding optimizer, or no kernel), mixed, none (no fused tables); None: not recorded")
    dense_sync: Literal["exchange", "allreduce", "none"] | None = Field(
        None, description="what averaged the dense gradients across ranks: exchange (one all_to_all, "
        "train.dense_grad_exchange on a gloo group of 2-4 ranks), allreduce (DDP's), none (no DDP wrapper, e.g. one "
        "rank); None: not recorded")

    def save(self, output_dir: str | Path) -> Path:
        """Write `output_dir`/result.json atomically (temp file + rename)."""
        path = Path(output_dir) / RESULT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(RESULT_FILE + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, output_dir: str | Path) -> WorkerResult:
        """`output_dir`/result.json; FileNotFoundError when rank 0 wrote none, ValueError naming the bad fields."""
        path = Path(output_dir) / RESULT_FILE
        if not path.exists():
            raise FileNotFoundError(f"worker result not found: {path} (rank 0 writes it when training finishes)")
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as e:
            fields = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{path} does not hold a WorkerResult: {fields}") from None
