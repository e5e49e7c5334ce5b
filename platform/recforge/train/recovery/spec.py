"""How a training worker survives failures: checkpoint cadence and places, flash checkpoints, the
launch generation, gradient accumulation, per-sample accounting. Part of the worker spec
(`WorkerSpec.recovery`); every field has a default that keeps the pre-recovery behaviour cheap.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from recforge.train.recovery.private_dir import pointer_path, read_pointer

STEPS_SUFFIX = ".steps"


class RecoverySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_every_steps: int = Field(
        0, ge=0, description="take a resumable checkpoint every this many steps (at the next logging-window "
        "boundary); 0: only the final checkpoint, so a restart trains from the initial weights and all data again")
    checkpoint_root: Path | None = Field(
        None, description="where step checkpoints go (default: <checkpoint_dir>.steps next to the final checkpoint)")
    keep_checkpoints: int = Field(2, ge=1, description="step checkpoints kept on disk (older ones are deleted)")
    flash: bool = Field(
        False, description="checkpoint into shared memory (synchronous, fast) and let the agent persist to disk "
        "asynchronously; used only when an agent runs (flash_agent, or RECFORGE_FLASH_AGENT in the environment), "
        "else a synchronous disk save")
    flash_root: Path | None = Field(
        None, description="the job's private shared-memory directory (set by the launcher: a tempfile.mkdtemp under "
        "/dev/shm, mode 0700, recorded in the pointer file `flash_pointer`); loaded from only while it is private")
    flash_agent: bool = Field(False, description="set by the launcher when it runs a FlashPersister for this job")
    generation_base: int = Field(0, ge=0, description="launch generation of this launch's first worker group; "
                                 "a worker's generation is this plus torchrun's restart count")
    global_batch: int | None = Field(None, ge=1, description="rows per optimizer step over all ranks, kept when "
                                      "the world size changes (default: world_size * train.batch_size)")
    grad_accumulation: int = Field(1, ge=1, description="micro-batches per step: each rank trains its share of the "
                                   "global batch in k forward/backward passes, then steps once")
    ledger_dir: Path | None = Field(None, description="per-sample accounting: every rank appends the rows it trains")
    events_file: Path | None = Field(
        None, description="rank 0 appends one JSON line per group start, step checkpoint and finish (what the "
        "pipeline's checkpoint record is built from, across relaunches and task retries)")
    failures_dir: Path | None = Field(None, description="a failing rank writes its exception here for the failover "
                                      "policy")
    master_retry_attempts: int = Field(10, ge=1, description="job master calls are retried this often (backoff up "
                                       "to 5 s) before a worker gives up: rides out a master restart")

    def steps_root(self, checkpoint_dir: Path) -> Path:
        return Path(self.checkpoint_root) if self.checkpoint_root is not None else default_steps_root(checkpoint_dir)

    def flash_pointer(self, checkpoint_dir: Path) -> Path:
        """The file recording the job's flash directory: `<checkpoint_dir>.flash`, or `<checkpoint_root>.flash` when
        the step checkpoints live elsewhere (the pipeline's work dir: it outlives a task attempt's checkpoint_dir)."""
        return pointer_path(self.checkpoint_root if self.checkpoint_root is not None else checkpoint_dir)

    def shm_root(self, checkpoint_dir: Path) -> Path | None:
        """The flash directory: `flash_root`, else the one the pointer file records (None: there is none)."""
        if self.flash_root is not None:
            return Path(self.flash_root)
        return read_pointer(self.flash_pointer(checkpoint_dir))


def default_steps_root(checkpoint_dir: str | Path) -> Path:
    p = Path(checkpoint_dir)
    return p.with_name(p.name + STEPS_SUFFIX)
