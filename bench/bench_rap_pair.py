"""The trainer thread beside a busy preprocessing thread: how much each slows the other, per executor form.

RAP's co-run needs two things of the CPU: a core for the co-run thread and a GIL the co-run thread does not hold
for long. This checks both without RAP's schedule: the point's training step (1 thread) is timed alone, beside a
thread running the point's executor form over a batch in a loop, and beside a GIL-free matmul loop (the cost of
sharing the machine alone); the executor is timed alone and beside the steps. A form whose Python dispatch holds
the GIL slows both sides; one that releases it (the C++ kernels, TorchScript) only shares cores and caches.

    python bench/bench_rap_pair.py --plan plan2 --model micro --forms script,torch,grouped
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_rap_share as share  # noqa: E402  (bench/ is the script's directory)
from recforge.preprocess.synth import random_raw_batch  # noqa: E402


def median_ms(fn: Callable[[], object], n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def beside(fn: Callable[[], object], n: int, other: Callable[[], object]) -> tuple[float, list[float]]:
    """fn's median ms while `other` runs in a loop on a second thread (1 intra-op thread); other's call times."""
    stop, times = threading.Event(), []

    def loop() -> None:
        torch.set_num_threads(1)
        while not stop.is_set():
            t = time.perf_counter()
            other()
            times.append(time.perf_counter() - t)

    th = threading.Thread(target=loop)
    th.start()
    time.sleep(0.05)
    try:
        return median_ms(fn, n), times
    finally:
        stop.set()
        th.join()


def pair(c: share.Candidate, steps: int, seed: int = 0) -> dict[str, float]:
    point = share.Point(c, seed)
    step = point.stepper(point.fresh())
    raw = random_raw_batch(point.ds, c.batch, seed=seed + 1)
    ex = share.build_executor(c.form, point.plan, point.ds, point.executor.compiled)
    for _ in range(3):
        step()
        ex(raw)
    step_alone, ex_alone = median_ms(step, steps), median_ms(lambda: ex(raw), steps)
    step_by_ex, ex_times = beside(step, steps, lambda: ex(raw))
    a = torch.rand(192, 192)
    step_by_mm, _ = beside(step, steps, lambda: a @ a)
    ex_by_step = statistics.median(ex_times) * 1e3
    return {"step_alone_ms": step_alone, "step_beside_executor_ms": step_by_ex, "step_beside_matmul_ms": step_by_mm,
            "executor_alone_ms": ex_alone, "executor_beside_steps_ms": ex_by_step,
            "step_slowdown": step_by_ex / step_alone, "step_slowdown_matmul": step_by_mm / step_alone,
            "executor_slowdown": ex_by_step / ex_alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default="plan2")
    ap.add_argument("--model", default="micro", choices=sorted(share.MODELS))
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--forms", default="script,torch,grouped")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement (medians)")
    args = ap.parse_args()
    cands = share.parse_candidates(args.plan, args.model, str(args.batch), args.forms)
    share.check_machine(cands, 1, 1, args.batch * 4)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()}, autogroup {share.autogroup()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_rap_pair_") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            for c in cands:
                r = pair(c, args.steps)
                print(f"{c.name}: step alone {r['step_alone_ms']:.1f} ms, beside the executor loop "
                      f"{r['step_beside_executor_ms']:.1f} ms ({r['step_slowdown']:.2f}x), beside a matmul loop "
                      f"{r['step_beside_matmul_ms']:.1f} ms ({r['step_slowdown_matmul']:.2f}x); executor alone "
                      f"{r['executor_alone_ms']:.1f} ms, beside the steps {r['executor_beside_steps_ms']:.1f} ms "
                      f"({r['executor_slowdown']:.2f}x); load {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
