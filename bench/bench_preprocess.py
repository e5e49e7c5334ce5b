"""Preprocessing throughput (rows/s) for RAP's plans 0-3, side by side in one run (`recforge bench preprocess`).

Variants, each over the same raw batches (batch 8192, nulls and int64 extremes, row-major as RawBatch.from_arrow
gives them), fixed torch / DALI thread counts, medians of interleaved rounds, ratios against eager:
  eager          one torch op per feature per op (RAP's unfused baseline)
  stacked        PreprocessModule: same-chain features stacked into [B, g] torch ops, no kernel fusion
  fused          the fused executor as the pipeline runs it: on CPU one recforge::fused_chain call, every feature's
                 chain per row tile in one pass (C++), when the plan keeps one value per row
  fused_groups   the compiled plan's groups, one recforge::fused_* call per group (RAP's horizontal fusion)
  fused_torch    the same groups on the kernels' torch fallback (shows what the C++ buys)
  dali           NVIDIA DALI CPU pipeline (device_id=None) + fused for what DALI cannot express
  compiled       torch.compile of the stacked module with the hash in plain torch ops (child process, time limit)
  compiled_steps the same with each step of each group compiled on its own (one graph per op step): plans 2-3 chain
                 sigrid_hash 4 times, and Inductor's compile time grows steeply with chained hashes in one graph
                 (see --compile-timeout and the printed reason)
  pandas         pandas/numpy: vectorized columns, list ops row by row (a stand-in for TorchArrow on CPU)
Every variant's output is checked against fused (ints equal, floats within 1e-6 relative) before it is timed.
Machine limits: streaming bandwidth (numpy copy of 256 MiB) and int64 multiply-add throughput (numpy, in cache);
per plan the bytes moved and integer ops per row are estimated from the compiled plan, so the fused rate can be
read against both limits; `which_limit` measures which one binds (the fused rate at the full batch against a batch
that fits in L2). glibc malloc is tuned in-process (mallopt: no mmap below 32 MiB, no heap trimming below 2 GiB), for
every variant alike, unless --default-malloc: with glibc's defaults (or a trim threshold that wraps to 0, as 2**40
did through mallopt's int) every large output is page-faulted in again on every batch.

    python bench/bench_preprocess.py                     # plans 0-3, batch 8192, 1 thread
    python bench/bench_preprocess.py --plans plan3 --variants eager,fused --rounds 3

Writes bench/results/bench_preprocess.json (temp + rename) and prints a table.
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from _results import write_report  # bench/_results.py (bench/ is the script's directory)
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.dali import dali_available
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.presets import load_plan, preset_dataset
from recforge.preprocess.semantics.ops import logit_bounds
from recforge.preprocess.synth import random_raw_batch
from recforge_kernels import cpu_ext
from recforge_kernels import fused as fused_kernels

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("eager", "stacked", "fused", "fused_groups", "fused_torch", "dali", "compiled", "compiled_steps", "pandas")
# integer ops per value, counted from the kernels: twang_mix64 (~15) + hash_128_to_64 (~10) + floor-mod (~8)
INT_OPS = {"sigrid_hash": 33, "fill_null": 2, "clamp": 2, "mapid": 3, "bucketize": 2, "cast": 2, "firstx": 1,
           "ngram": 1, "onehot": 3, "logit": 0, "boxcox": 0}


# ---------------------------------------------------------------- machine


def tune_malloc() -> str:
    """glibc: keep freed memory (no munmap / trim), so large buffers are not page-faulted in on every batch."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        # mallopt takes a C int: 2**40 would wrap to 0 (trim on every free, so every batch faults its buffers in)
        ok = libc.mallopt(m_mmap_threshold, 32 * 2**20) and libc.mallopt(m_trim_threshold, 2**31 - 1)
        return "mallopt(M_MMAP_THRESHOLD=32MiB, M_TRIM_THRESHOLD=2GiB-1)" if ok else "mallopt failed: glibc defaults"
    except OSError:
        return "not glibc: defaults"


def machine_limits() -> dict[str, float]:
    src = np.ones(2**25, dtype=np.float64)  # 256 MiB
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    bw = 2 * src.nbytes / min(times)  # read + write
    a = np.arange(2**16, dtype=np.int64)
    b = np.full_like(a, 0x9DDFEA08EB382D69 - 2**64)
    c = np.empty_like(a)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        np.multiply(a, b, out=c)
        np.add(c, a, out=c)
        times.append(time.perf_counter() - t)
    return {"stream_bytes_per_s": bw, "int64_ops_per_s": 2 * a.size / min(times)}


def plan_costs(plan, dataset) -> dict[str, float]:
    """Bytes read + written and integer ops per row over the compiled plan's nodes (fixed widths), as RAP's plan
    states them: the fused executor's pruning (values no consumer reads) moves less on plans 2 and 3."""
    compiled = compile_plan(plan)
    graph = compiled.graph
    width = {}
    bytes_row, ops_row = 0.0, 0.0
    for n in graph.nodes:
        w_in = 1 if n.parent is None else width[n.parent]
        p = n.params
        w_out = {"onehot": p.get("C", 1), "firstx": min(p.get("X", 1), w_in),
                 "ngram": (w_in - min(p.get("n", 1), w_in) + 1) * min(p.get("n", 1), w_in)}.get(n.op, w_in)
        width[n.id] = w_out
        bytes_row += 8 * w_in + (1 if n.op == "fill_null" else 0) + 8 * w_out
        ops_row += INT_OPS.get(n.op, 1) * w_in
    bytes_row += 8 * len(plan.sparse_features()) + 4 * len(plan.dense_features())  # the outputs' assembly
    return {"bytes_per_row": bytes_row, "int_ops_per_row": ops_row, "groups": len(compiled.groups),
            "nodes": len(graph.nodes), "milp_solve_s": compiled.solve_time_s, "milp_status": compiled.solver_status}


def single_pass_bytes(plan, dataset) -> int:
    """What the single-pass kernel moves per row: the raw matrices read once (int64 + valid byte per column), the
    dense float32 matrix and the ids (int64) written, the KJT lengths (int32) written."""
    return (9 * (len(dataset.dense) + len(dataset.sparse)) + 4 * len(plan.dense_features())
            + 12 * len(plan.sparse_features()))


def which_limit(fused: Callable, dataset, args, bytes_per_row: int) -> dict[str, Any]:
    """Measured, not modelled: the fused rate on a batch whose raw rows fit in L2 (1024 rows) against the rate at
    the benchmark's batch, each less the per-call cost (a 1-row batch). Near equal: the arithmetic binds (hash,
    float64 log / exp); far lower at the full batch: memory does."""
    sizes = (1, 1024, args.batch)
    raws = {n: random_raw_batch(dataset, n, seed=args.seed + 5) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(max(7, args.rounds)):  # interleaved, like the variants: load on the machine hits all three
        for n in sizes:
            t = time.perf_counter()
            fused(raws[n])
            times[n].append(time.perf_counter() - t)
    t1, t_small, t_big = (statistics.median(times[n]) for n in sizes)
    small = 1023 / max(t_small - t1, 1e-9)
    big = (args.batch - 1) / max(t_big - t1, 1e-9)
    return {"fused_in_l2_rows_per_s": small, "fused_full_batch_rows_per_s": big, "fused_call_overhead_s": t1,
            "fused_full_vs_in_l2": big / small,
            "fused_single_pass_bytes_per_s": big * bytes_per_row,
            "binding_limit": "compute (the full batch runs at >= 80% of its in-L2 rate)" if big >= 0.8 * small
            else "memory (the full batch runs below 80% of its in-L2 rate)"}


# ---------------------------------------------------------------- pandas / numpy baseline


def _hash_np(x: np.ndarray, salt: int, M: int) -> np.ndarray:
    k = x.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        k = (~k) + (k << np.uint64(21))
        k ^= k >> np.uint64(24)
        k = k + (k << np.uint64(3)) + (k << np.uint64(8))
        k ^= k >> np.uint64(14)
        k = k + (k << np.uint64(2)) + (k << np.uint64(4))
        k ^= k >> np.uint64(28)
        k = k + (k << np.uint64(31))
        s, mul = np.uint64(salt & (2**64 - 1)), np.uint64(0x9DDFEA08EB382D69)
        a = (k ^ s) * mul
        a ^= a >> np.uint64(47)
        b = (s ^ a) * mul
        b ^= b >> np.uint64(47)
        h = (b * mul).view(np.int64)
    return np.mod(h, M) if M > 1 else np.zeros_like(h)


def pandas_pipeline(plan, dataset) -> Callable:
    """Columns as pandas Series with vectorized numpy ops; firstx / ngram / onehot row by row, as list UDFs."""
    cols = {n: ("dense", j) for j, n in enumerate(dataset.dense_names)}
    cols |= {n: ("sparse", j) for j, n in enumerate(dataset.sparse_names)}

    def run(raw) -> dict[str, Any]:
        frames = {"dense": pd.DataFrame(raw.dense.numpy()), "sparse": pd.DataFrame(raw.sparse.numpy())}
        masks = {"dense": raw.dense_valid.numpy(), "sparse": raw.sparse_valid.numpy()}
        out = {}
        for f in plan.features:
            kind, j = cols[f.source]
            s = frames[kind][j].where(masks[kind][:, j], f.ops[0].params["value"])
            s = s.astype(np.float32 if kind == "dense" else np.int64)
            for spec in f.ops[1:]:
                p = spec.params
                if spec.op == "logit":
                    lo, hi = logit_bounds(p["eps"])
                    t = s.clip(lo, hi).astype(np.float64)
                    s = np.log(t / (1 - t)).astype(np.float32)
                elif spec.op == "boxcox":
                    x64 = s.astype(np.float64)
                    lam = float(np.float32(p["lambda"]))
                    y = np.log(x64.clip(lower=1e-300)) if lam == 0 else (x64.clip(lower=1e-300) ** lam - 1) / lam
                    s = s.where(s <= 0, y.astype(np.float32))
                elif spec.op == "sigrid_hash":
                    s = pd.Series(_hash_np(s.to_numpy(), p["salt"], p["M"]), index=s.index)
                elif spec.op == "clamp":
                    s = s.clip(p["lo"], p["hi"])
                elif spec.op == "bucketize":
                    s = pd.Series(np.searchsorted(np.array(p["borders"], np.float32), s.to_numpy(), side="left"),
                                  index=s.index)
                elif spec.op == "mapid":
                    table = p["map"]
                    s = s.map(lambda v, t=table: t[v] if 0 <= v < len(t) else 0)
                elif spec.op == "cast":
                    s = s.astype(np.float32) if p["to"] == "float" else s.fillna(0).astype(np.int64)
                elif spec.op == "onehot":
                    lo = np.float32(p["lo"])
                    step = (np.float32(p["hi"]) - lo) / np.float32(p["C"])

                    def onehot(v, lo=lo, C=p["C"], step=step):
                        v = v[0] if isinstance(v, list) else v
                        q = (np.float32(v) - lo) / step
                        i = int(q) if 0 <= q < C else 0
                        return [1.0 if c == i else 0.0 for c in range(C)]
                    s = s.apply(onehot)
                elif spec.op == "ngram":
                    def ngram(v, n=p["n"]):
                        v = v if isinstance(v, list) else [v]
                        k = min(n, len(v))
                        return [a for i in range(len(v) - k + 1) for a in v[i:i + k]]
                    s = s.apply(ngram)
                elif spec.op == "firstx":
                    s = s.apply(lambda v, X=p["X"]: (v if isinstance(v, list) else [v])[:X])
            out[f.name] = s
        dense = np.stack([np.asarray([v[0] if isinstance(v, list) else v for v in out[n]], np.float32)
                          for n in plan.dense_features()], 1)
        ids = np.concatenate([np.asarray([a for v in out[n] for a in (v if isinstance(v, list) else [v])], np.int64)
                              for n in plan.sparse_features()])
        return {"dense": dense, "ids": ids}

    return run


# ---------------------------------------------------------------- torch.compile (child process, time limit)


def _compiled_child(plan_name: str, batch: int, threads: int, rounds: int, seed: int, per_step: bool,
                    queue) -> None:
    try:
        torch.set_num_threads(threads)
        tune_malloc()
        ds = preset_dataset(plan_name)
        plan = load_plan(plan_name, ds)
        raw = random_raw_batch(ds, batch, seed=seed)
        args = (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
        module = PreprocessModule(plan, ds, inline_hash=True)
        t0 = time.perf_counter()
        if per_step:
            for group in module.groups:
                for i, step in enumerate(group.steps):
                    group.steps[i] = torch.compile(step, dynamic=False)
            compiled = module
        else:
            compiled = torch.compile(module, dynamic=False)
        got = compiled(*args)
        compile_s = time.perf_counter() - t0
        want = PreprocessModule(plan, ds)(*args)
        ok = torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-6, atol=0, equal_nan=True)
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            compiled(*args)
            times.append(time.perf_counter() - t)
        queue.put({"median_s": statistics.median(times), "compile_s": compile_s, "matches": bool(ok)})
    except Exception as e:  # reported, not raised: one variant failing must not lose the others
        queue.put({"error": repr(e)[:500]})


def measure_compiled(plan_name: str, batch: int, threads: int, rounds: int, seed: int, timeout_s: float,
                     per_step: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_compiled_child, args=(plan_name, batch, threads, rounds, seed, per_step, q))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"error": f"torch.compile did not finish within {timeout_s:.0f} s (compile + {rounds} runs)"}
    return q.get() if not q.empty() else {"error": f"child exited with {proc.exitcode}"}


# ---------------------------------------------------------------- main


def same_output(a, b) -> bool:
    (da, ka), (db, kb) = a, b
    return (torch.allclose(da, db, rtol=1e-6, atol=0, equal_nan=True) and torch.equal(ka.values(), kb.values())
            and torch.equal(ka.lengths(), kb.lengths()))


def bench_plan(name: str, args, limits: dict[str, float]) -> dict[str, Any]:
    ds = preset_dataset(name)
    plan = load_plan(name, ds)
    raws = [random_raw_batch(ds, args.batch, seed=args.seed + i) for i in range(2)]
    runners: dict[str, Callable] = {}
    checks: dict[str, Any] = {}
    fused = make_executor("fused", plan, ds)
    ref_out = make_executor("eager", plan, ds)(raws[0])  # every variant is checked against eager
    for v in args.variants:
        if v == "eager":
            runners[v] = make_executor("eager", plan, ds)
        elif v == "stacked":
            runners[v] = make_executor("module", plan, ds)
        elif v == "fused":
            runners[v] = fused
        elif v == "fused_groups":
            runners[v] = make_executor("fused", plan, ds, single_pass=False)
        elif v == "fused_torch":
            ex = make_executor("fused", plan, ds)

            def run_torch(raw, ex=ex):
                fused_kernels.set_cpu_backend("torch")
                try:
                    return ex(raw)
                finally:
                    fused_kernels.set_cpu_backend("cpp")
            runners[v] = run_torch
        elif v == "dali":
            if not dali_available():
                checks[v] = "skipped: nvidia-dali not installed"
                continue
            runners[v] = make_executor("dali", plan, ds, num_threads=args.threads)
            checks["dali_fallback"] = runners[v].describe()["fallback_by_op"]
        elif v == "pandas":
            runners[v] = pandas_pipeline(plan, ds)
    for v, run in runners.items():
        if v != "pandas":
            checks[v] = "matches eager" if same_output(run(raws[0]), ref_out) else "MISMATCH"
    checks["pandas"] = "not checked (a stand-in for TorchArrow)" if "pandas" in runners else checks.get("pandas")
    # interleaved rounds: every variant once per round, so machine noise spreads over all of them
    times: dict[str, list[float]] = {v: [] for v in runners}
    pandas_rows = min(args.batch, args.pandas_rows)
    pandas_raw = [random_raw_batch(ds, pandas_rows, seed=args.seed + 9)]
    for r in range(args.rounds):
        for v, run in runners.items():
            raw = pandas_raw[0] if v == "pandas" else raws[r % 2]
            t = time.perf_counter()
            run(raw)
            times[v].append(time.perf_counter() - t)
    rows = {v: (pandas_rows if v == "pandas" else args.batch) for v in runners}
    result: dict[str, Any] = {"variants": {}, "checks": checks, **plan_costs(plan, ds),
                              "single_pass_bytes_per_row": single_pass_bytes(plan, ds)}
    for v, ts in times.items():
        med = statistics.median(ts)
        result["variants"][v] = {"median_s": med, "rows_per_s": rows[v] / med, "rounds": len(ts), "rows": rows[v]}
    for v in ("compiled", "compiled_steps"):
        if v not in args.variants:
            continue
        c = measure_compiled(name, args.batch, args.threads, args.rounds, args.seed, args.compile_timeout,
                             per_step=v == "compiled_steps")
        result["checks"][v] = "matches reference" if c.get("matches") else c.get("error", "MISMATCH")
        if "median_s" in c:
            result["variants"][v] = {"median_s": c["median_s"], "rows_per_s": args.batch / c["median_s"],
                                     "rounds": args.rounds, "rows": args.batch, "compile_s": c["compile_s"]}
    eager = result["variants"].get("eager", {}).get("rows_per_s")
    for r in result["variants"].values():
        r["vs_eager"] = r["rows_per_s"] / eager if eager else None
    f = result["variants"].get("fused")
    if f:
        result["fused_bytes_per_s"] = f["rows_per_s"] * result["bytes_per_row"]
        result["fused_int_ops_per_s"] = f["rows_per_s"] * result["int_ops_per_row"]
        result["fused_share_of_bandwidth"] = result["fused_bytes_per_s"] / limits["stream_bytes_per_s"]
        result["fused_share_of_int_throughput"] = result["fused_int_ops_per_s"] / limits["int64_ops_per_s"]
        result |= which_limit(fused, ds, args, result["single_pass_bytes_per_row"])
        for other in ("compiled", "compiled_steps", "dali", "fused_groups"):
            if other in result["variants"]:
                result[f"fused_vs_{other}"] = f["rows_per_s"] / result["variants"][other]["rows_per_s"]
    return result


def print_table(results: dict[str, Any], variants: list[str]) -> None:
    head = f"{'plan':6s}" + "".join(f"{v:>16s}" for v in variants)
    print(head + "   (M rows/s, x eager)")
    for name, r in results.items():
        cells = []
        for v in variants:
            x = r["variants"].get(v)
            cells.append(f"{x['rows_per_s'] / 1e6:8.3f} {x['vs_eager']:5.1f}x" if x and x.get("vs_eager") else
                         f"{'-':>14s}")
        print(f"{name:6s}" + "".join(f"{c:>16s}" for c in cells))
    for name, r in results.items():
        for v in ("compiled", "compiled_steps"):
            if v in variants:
                x = r["variants"].get(v)
                print(f"{name} {v}: " + (f"compiled in {x['compile_s']:.0f} s" if x else r["checks"].get(v, "-")))
    for name, r in results.items():
        print(f"{name}: {r['bytes_per_row']:.0f} B/row, {r['int_ops_per_row']:.0f} int ops/row; fused uses "
              f"{100 * r.get('fused_share_of_bandwidth', 0):.1f}% of streaming bandwidth, "
              f"{100 * r.get('fused_share_of_int_throughput', 0):.1f}% of int64 throughput; {r['groups']} groups, "
              f"MILP {r['milp_solve_s']:.3f} s ({r['milp_status']}); checks {r['checks']}")
        if "binding_limit" in r:
            print(f"{name}: fused single pass moves {r['single_pass_bytes_per_row']} B/row = "
                  f"{r['fused_single_pass_bytes_per_s'] / 1e9:.2f} GB/s; full batch at "
                  f"{100 * r['fused_full_vs_in_l2']:.0f}% of its in-L2 rate "
                  f"({r['fused_in_l2_rows_per_s'] / 1e6:.2f} M rows/s); per-call cost "
                  f"{1e6 * r['fused_call_overhead_s']:.0f} us -> binds: {r['binding_limit']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="plan0,plan1,plan2,plan3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pandas-rows", type=int, default=1024, help="rows per pandas batch (row-wise UDFs are slow)")
    ap.add_argument("--compile-timeout", type=float, default=300.0,
                    help="seconds for torch.compile + runs per plan and compiled variant")
    ap.add_argument("--default-malloc", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_preprocess.json")
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    torch.set_num_threads(args.threads)
    malloc = "glibc defaults (--default-malloc)" if args.default_malloc else tune_malloc()
    cpu_ext.load()
    limits = machine_limits()
    print(f"threads {args.threads}, batch {args.batch}, rounds {args.rounds}; malloc: {malloc}; C++ kernels: "
          f"{cpu_ext.status()}; streaming {limits['stream_bytes_per_s'] / 1e9:.1f} GB/s, int64 "
          f"{limits['int64_ops_per_s'] / 1e9:.2f} Gops/s (numpy); load average {os.getloadavg()}")
    results = {}
    for name in [p.strip() for p in args.plans.split(",") if p.strip()]:
        results[name] = bench_plan(name, args, limits)
        print(f"{name} done", flush=True)
    print_table(results, [v for v in VARIANTS if v in args.variants])
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "load_average": os.getloadavg(), **limits},
        "settings": {"threads": args.threads, "batch": args.batch, "rounds": args.rounds, "malloc": malloc,
                     "cpp_kernels": cpu_ext.status(), "torch": torch.__version__},
        "plans": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
