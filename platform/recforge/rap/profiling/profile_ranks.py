"""A job's stage profile measured on as many processes as it has workers (recforge.rap.profiling.profile_job for
world > 1).

    profile = profile_in_processes(cfg, plan, dataset, world_size, manifest_dir, threads, device)

Starts `world_size` processes (`python -m recforge.rap.profiling.profile_ranks JOB.json`, a gloo / nccl group over a
free local port, each with the trainer's thread budget), like the training job's workers: every rank trains the job's
model on the manifest's first batches, rank 0 leads the StageProfiler and tells the others when to step and where
the proxy runs (recforge.rap.profiling.profile_job.lead_profile / follow_profile), and writes the profile. So the stages
include the collectives (input / pooled-embedding all-to-all, the dense all-reduce) and the workers' contention
for the machine, which a single-process profile misses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from recforge.config import DatasetConfig, PipelineConfig
from recforge.preprocess.planning.plan import Plan
from recforge.rap.profiling.profile_job import describe, follow_profile, job_step, lead_profile
from recforge.rap.profiling.profiler import ProfileKey, StageProfile
from recforge.train.distributed import free_port

TIMEOUT_S = 900


def profile_in_processes(cfg, plan: Plan, dataset, world_size: int, manifest_dir: str | Path, threads: int,
                         device: torch.device, timeout_s: float = TIMEOUT_S) -> StageProfile:
    with tempfile.TemporaryDirectory(prefix="rap_profile_") as tmp:
        job = Path(tmp) / "job.json"
        plan.save(Path(tmp) / "plan.json")
        job.write_text(json.dumps({
            "cfg": cfg.model_dump(mode="json"),
            "plan": str(Path(tmp) / "plan.json"), "dataset": dataset.model_dump(mode="json"),
            "world_size": world_size, "manifest_dir": str(manifest_dir), "threads": threads, "device": device.type,
            "out": str(Path(tmp) / "profile.json")}))
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(threads)}
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                with open(Path(tmp) / f"rank{rank}.log", "w") as log:
                    cmd = [sys.executable, "-m", "recforge.rap.profiling.profile_ranks", str(job)]
                    procs.append(subprocess.Popen(cmd, env=env | {"RANK": str(rank)}, stdout=log,
                                                  stderr=subprocess.STDOUT))
            failed = _wait_all(procs, time.monotonic() + timeout_s)
        finally:
            for proc in procs:  # a failed rank leaves the others blocked in a collective: end them
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        if failed:
            report = "\n".join(f"rank {r} ended with {rc}:\n{(Path(tmp) / f'rank{r}.log').read_text()[-2000:]}"
                               for r, rc in failed)
            raise RuntimeError(f"stage profile on {world_size} processes failed:\n{report}")
        return StageProfile.from_json((Path(tmp) / "profile.json").read_text())


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> list[tuple[int, object]]:
    """Until every process exited 0 (returns []), one exited otherwise, or the deadline passed: the failed ranks
    (rank, exit code or 'timeout'), the first to fail first."""
    failed: list[tuple[int, object]] = []
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, rc) for r, rc in enumerate(codes) if rc not in (None, 0)]
        if failed or all(rc == 0 for rc in codes):
            return failed
        if time.monotonic() > deadline:
            return [(r, "timeout") for r, rc in enumerate(codes) if rc is None]
        time.sleep(0.2)


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    cfg = PipelineConfig.model_validate(job["cfg"])
    plan, dataset = Plan.load(job["plan"]), DatasetConfig.model_validate(job["dataset"])
    rank, world = int(os.environ["RANK"]), int(job["world_size"])
    threads = int(job["threads"])
    torch.set_num_threads(threads)
    device = torch.device(f"cuda:{rank}" if job["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        if torch.cuda.device_count() <= rank:
            raise RuntimeError(f"stage profile: rank {rank} needs GPU {rank}, this machine has "
                               f"{torch.cuda.device_count()}")
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        tracker, step, served = job_step(cfg, plan, dataset, job["manifest_dir"], world, device)
        t_steps = time.perf_counter()
        if rank == 0:
            key = ProfileKey.of(cfg.model, plan.tables(), world, cfg.train.batch_size, device)
            profile, max_units = lead_profile(cfg, key, tracker, step, device, world)
            describe(profile, key, threads, max_units, served[0], t_steps)
            out = Path(job["out"])
            out.with_suffix(".tmp").write_text(profile.to_json())
            out.with_suffix(".tmp").replace(out)
        else:
            follow_profile(cfg, tracker, step, device)
        tracker.detach()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
