"""The rank's side of the elastic job: its launch generation, the job master's client, its failure record."""
from __future__ import annotations

import os

from recforge.elastic.agent.client import MasterClient, read_token_file
from recforge.elastic.master.failover import record_exception
from recforge.train.spec import WorkerSpec


def launch_generation(spec: WorkerSpec) -> int:
    """This group's launch generation: the launch's base (set per relaunch by the supervisor) plus
    torchrun's restart count; the job master refuses calls from older generations."""
    return spec.recovery.generation_base + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def join_master(spec: WorkerSpec, rank: int, generation: int) -> MasterClient:
    """A client of the job master, joined (it leases data-shard tasks and receives stop commands)."""
    if spec.master_url is None:  # WorkerSpec.load refuses such a spec; this is for a spec built in-process
        raise ValueError("master_url: required to join the job master (run_training_job fills it in)")
    # the spec names the token's file (run_training_job's or the mounted Secret); else the environment's
    token = read_token_file(spec.master_token_file) if spec.master_token_file is not None else None
    client = MasterClient(spec.master_url, worker_id=f"rank{rank}-{os.getpid()}", token=token, generation=generation,
                          max_attempts=spec.recovery.master_retry_attempts)
    client.join()
    return client


def record_failure(spec: WorkerSpec, rank: int, exc: BaseException) -> None:
    """The rank's exception for the failover policy (recovery.failures_dir), unless it is an interrupt / exit."""
    if spec.recovery.failures_dir is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        record_exception(spec.recovery.failures_dir, rank=rank, generation=launch_generation(spec), exc=exc)
