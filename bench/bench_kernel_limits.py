"""The fused preprocessing kernel against this machine's limits, on ONE thread (`recforge bench kernel_limits`).

Side by side in one run, interleaved rounds, medians (csrc/fused_cpu.cpp's `limit_loop` runs each loop in C++, so no
Python sits inside a timing):
  (a) streaming bandwidth: int64 copy (memcpy, read + write) and STREAM triad (o = x + 3 y) over arrays far beyond
      the last-level cache;
  (b) the microkernel, in L1: sigrid hash + floor-mod of int64 values three ways: invariant-divisor magic numbers
      (multiply-high + shift, as libdivide and Velox do; what the kernel runs, AVX2 where the CPU has it), the
      hardware divide, the float64 reciprocal the kernel used before; plus the hash alone, a float64 logit (Sleef
      vector log) and an integer clamp (the cost of a cheap step);
  (c) the fused single-pass kernel (recforge_cpu::chain, as the pipeline calls it) on RAP plans 0-3, rows/s.
Each plan's limit for its op mix is a roofline over its compiled chain program: per row, compute = hash steps x the
hash + magic-mod time + float64-log steps x the logit time + other steps x the clamp time; memory = the single-pass
bytes (raw int64 + valid byte per column read, float32 dense and int64 ids written) / triad bandwidth; the limit is
1 / max(compute, memory). Reported: rows/s, limit, limit / rows (goal <= 2), plan 0 >= 15 M rows/s. Rates are given
per wall second and per CPU second of the timing thread (the machine is shared: CPU time leaves out time the thread
waited for a core); the load average before and after is recorded.

    python bench/bench_kernel_limits.py                      # plans 0-3, batch 8192, 7 rounds
    python bench/bench_kernel_limits.py --rounds 3 --plans plan0

Writes bench/results/bench_kernel_limits.json (temp + rename) and prints a table.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread, fixed, before torch starts its pools

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model, write_report  # noqa: E402  # bench/_results.py

RESULTS = Path(__file__).resolve().parent / "results"
PLANS = ("plan0", "plan1", "plan2", "plan3")
# limit_loop kinds (csrc/fused_cpu.cpp)
COPY, TRIAD, HASH_MAGIC, HASH_DIV, HASH_F64, HASH_ONLY, LOGIT, CLAMP = range(8)
MICRO = {"hash_magic_mod": HASH_MAGIC, "hash_hw_divide": HASH_DIV, "hash_float64_mod": HASH_F64,
         "hash_only": HASH_ONLY, "logit_float64": LOGIT, "clamp_int64": CLAMP}
MODULUS = 10_131_227  # Criteo Kaggle C3's table size: a large modulus that is not a power of two
GOAL_RATIO, GOAL_PLAN0 = 2.0, 15e6


class Refused(ValueError):
    """A configuration this machine cannot hold (the message names the limit)."""



def check_config(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, what cannot run here: the streaming arrays and the batches against available
    memory, and bad sizes."""
    if args.batch < 1 or args.rounds < 1 or args.micro_values < 4 or args.stream_mib < 1:
        raise Refused(f"--batch ({args.batch}), --rounds ({args.rounds}) must be >= 1, --micro-values "
                      f"({args.micro_values}) >= 4, --stream-mib ({args.stream_mib}) >= 1")
    unknown = sorted(set(args.plans) - set(PLANS))
    if unknown:
        raise Refused(f"unknown plans {unknown}; choose from {list(PLANS)}")
    # three streaming arrays, and per plan a raw batch (up to 221 int64 + bool columns in plan 3's dataset) and its
    # outputs, twice over (the L2-sized batch is small)
    need = 3 * args.stream_mib * 2**20 + len(args.plans) * args.batch * (221 * 9 + 221 * 12)
    avail = psutil.virtual_memory().available
    if need > 0.5 * avail:
        raise Refused(f"needs ~{need / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB is available "
                      f"(psutil.virtual_memory().available; the limit is half of it): lower --stream-mib or --batch")


def median_rate(samples: list[tuple[float, float]], work: float) -> dict[str, float]:
    """Medians of (wall s, CPU s) samples -> work per second."""
    wall = statistics.median(s[0] for s in samples)
    cpu = statistics.median(s[1] for s in samples)
    return {"per_wall_s": work / max(wall, 1e-12), "per_cpu_s": work / max(cpu, 1e-12), "median_wall_s": wall,
            "median_cpu_s": cpu, "rounds": len(samples)}


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


def plan_program(name: str):
    """(chain program, dataset, op mix) of a RAP plan; the op mix counts its chain steps per row."""
    from recforge.preprocess.executors import chain  # lazy: the platform's preprocess layer, only for plans
    from recforge.preprocess.presets import load_plan, preset_dataset  # lazy: as above

    plan, dataset = load_plan(name), preset_dataset(name)
    prog = chain.chain_program(plan, dataset)
    logs = {chain.LOGIT, chain.BOXCOX, chain.LOG1P}
    fills = {chain.FILL_FLOAT, chain.FILL_ID}
    mix = {"hash": sum(c == chain.SIGRID_HASH for c in prog.codes), "float64_log": sum(c in logs for c in prog.codes),
           "fill": sum(c in fills for c in prog.codes),
           "other": sum(c not in logs | fills | {chain.SIGRID_HASH} for c in prog.codes),
           "features": len(prog.src_kind),
           "bytes_per_row": 9 * (len(dataset.dense) + len(dataset.sparse)) + 4 * prog.num_dense + 8 * prog.num_sparse}
    return prog, dataset, mix


def op_mix_limit(mix: dict[str, int], micro: dict[str, dict[str, float]], triad_bytes_per_s: float,
                 key: str) -> dict[str, float]:
    """Roofline limit (rows/s) of a plan's op mix from the measured microkernel rates (values/s) and bandwidth.
    Fills count as cheap steps (their gather from the row-major raw batch is in the memory term)."""
    compute = (mix["hash"] / micro["hash_magic_mod"][key] + mix["float64_log"] / micro["logit_float64"][key]
               + (mix["fill"] + mix["other"]) / micro["clamp_int64"][key])
    memory = mix["bytes_per_row"] / triad_bytes_per_s
    return {"compute_s_per_row": compute, "memory_s_per_row": memory, "limit_rows_per_s": 1.0 / max(compute, memory),
            "bound": "compute" if compute >= memory else "memory"}


def run(args: argparse.Namespace, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Measure (a), (b), (c) in interleaved rounds; the report's dict."""
    from recforge.preprocess.synth import random_raw_batch  # lazy: the platform's synthetic batches
    from recforge_kernels import cpu_ext  # lazy: builds the C++ extension on first use

    check_config(args)
    torch.set_num_threads(1)
    if not cpu_ext.load():
        raise RuntimeError(f"the C++ kernels are not available: {cpu_ext.status()}")
    ops = torch.ops.recforge_cpu
    load_before = os.getloadavg()
    n_stream = args.stream_mib * 2**20 // 8
    sx, sy = torch.arange(n_stream, dtype=torch.int64), torch.ones(n_stream, dtype=torch.int64)
    so = torch.empty_like(sx)
    n_micro = args.micro_values
    mx = torch.randint(0, 2**32, (n_micro,), dtype=torch.int64, generator=torch.Generator().manual_seed(args.seed))
    my = torch.rand(2 * n_micro, generator=torch.Generator().manual_seed(args.seed + 1)).clamp(1e-3, 0.999)
    my = my.view(torch.int64)  # float32 values in [1e-3, 0.999] as bytes: the logit loop's input
    mo = torch.empty_like(mx)
    micro_reps = max(1, args.micro_work // n_micro)
    plans = {name: plan_program(name) for name in args.plans}
    batches = {name: random_raw_batch(ds, args.batch, seed=args.seed) for name, (_, ds, _) in plans.items()}
    for name, (prog, _, _) in plans.items():
        prog.run(batches[name])  # warm: first-call allocations
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in ("copy", "triad", *MICRO, *args.plans)}
    for r in range(args.rounds):
        for key, kind in (("copy", COPY), ("triad", TRIAD)):
            samples[key].append(timed(lambda kind=kind: ops.limit_loop(sx, sy, so, kind, 1, 1)))
        for key, kind in MICRO.items():
            samples[key].append(timed(lambda kind=kind: ops.limit_loop(mx, my, mo, kind, MODULUS, micro_reps)))
        for name, (prog, _, _) in plans.items():
            samples[name].append(timed(lambda prog=prog, name=name: prog.run(batches[name])))
        progress(f"round {r + 1}/{args.rounds}")
    stream = {"copy_bytes_per_s": median_rate(samples["copy"], 16.0 * n_stream),
              "triad_bytes_per_s": median_rate(samples["triad"], 24.0 * n_stream)}
    micro = {k: median_rate(samples[k], float(n_micro * micro_reps)) for k in MICRO}
    for key in ("per_wall_s", "per_cpu_s"):
        base = micro["hash_magic_mod"][key]
        micro["hash_hw_divide"][f"magic_speedup_{key}"] = base / micro["hash_hw_divide"][key]
        micro["hash_float64_mod"][f"magic_speedup_{key}"] = base / micro["hash_float64_mod"][key]
    report_plans = {}
    for name, (_, _, mix) in plans.items():
        rate = median_rate(samples[name], float(args.batch))
        entry: dict[str, Any] = {"op_mix": mix, "rows_per_s": rate}
        for key in ("per_wall_s", "per_cpu_s"):
            lim = op_mix_limit(mix, micro, stream["triad_bytes_per_s"][key], key)
            lim["limit_over_rows"] = lim["limit_rows_per_s"] / rate[key]
            lim["within_2x"] = lim["limit_over_rows"] <= GOAL_RATIO
            entry[f"limit_{key}"] = lim
        report_plans[name] = entry
    goals = {"plan0_rows_per_s_goal": GOAL_PLAN0, "ratio_goal": GOAL_RATIO}
    if "plan0" in report_plans:
        goals["plan0_meets_15M_wall"] = report_plans["plan0"]["rows_per_s"]["per_wall_s"] >= GOAL_PLAN0
        goals["plan0_meets_15M_cpu"] = report_plans["plan0"]["rows_per_s"]["per_cpu_s"] >= GOAL_PLAN0
    return {
        "machine": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "memory_available_bytes": psutil.virtual_memory().available},
        "settings": {"threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                     "batch": args.batch, "rounds": args.rounds, "stream_mib": args.stream_mib,
                     "micro_values": n_micro, "micro_reps": micro_reps, "modulus": MODULUS, "seed": args.seed,
                     "cpp_kernels": cpu_ext.status(), "march": cpu_ext.MARCH, "torch": torch.__version__,
                     # the widest vector ISA torch sees (AVX2 / AVX512): a native build's loops follow it
                     "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "stream": stream, "micro_values_per_s": micro, "plans": report_plans, "goals": goals,
    }


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console  # lazy: printing only
    from rich.table import Table  # lazy: as above

    m, s = report["micro_values_per_s"], report["stream"]
    con = Console()
    con.print(f"{report['machine']['cpu_model']} ({report['settings']['cpu_capability']}), 1 thread; load "
              f"{report['machine']['load_average_before']} -> {report['machine']['load_average_after']}")
    t = Table(title="machine limits (median; wall / CPU-time rates)")
    t.add_column("measure")
    t.add_column("wall")
    t.add_column("cpu")
    for k in ("copy_bytes_per_s", "triad_bytes_per_s"):
        t.add_row(k, f"{s[k]['per_wall_s'] / 1e9:.2f} GB/s", f"{s[k]['per_cpu_s'] / 1e9:.2f} GB/s")
    for k, v in m.items():
        t.add_row(k, f"{v['per_wall_s'] / 1e6:.0f} M/s", f"{v['per_cpu_s'] / 1e6:.0f} M/s")
    con.print(t)
    t = Table(title="fused single-pass kernel vs its op mix's limit")
    for c in ("plan", "hash/log/other steps", "M rows/s wall", "limit", "limit/rows", "M rows/s cpu", "limit",
              "limit/rows", "bound"):
        t.add_column(c)
    for name, e in report["plans"].items():
        mix, r, lw, lc = e["op_mix"], e["rows_per_s"], e["limit_per_wall_s"], e["limit_per_cpu_s"]
        t.add_row(name, f"{mix['hash']}/{mix['float64_log']}/{mix['fill'] + mix['other']}",
                  f"{r['per_wall_s'] / 1e6:.2f}", f"{lw['limit_rows_per_s'] / 1e6:.2f}", f"{lw['limit_over_rows']:.2f}",
                  f"{r['per_cpu_s'] / 1e6:.2f}", f"{lc['limit_rows_per_s'] / 1e6:.2f}", f"{lc['limit_over_rows']:.2f}",
                  lc["bound"])
    con.print(t)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stream-mib", type=int, default=256, help="MiB per streaming array (three of them)")
    ap.add_argument("--micro-values", type=int, default=2048, help="values per microkernel loop (in L1)")
    ap.add_argument("--micro-work", type=int, default=4_000_000, help="values per microkernel timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_kernel_limits.json")
    args = ap.parse_args(argv)
    args.plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    from rich.progress import Progress  # lazy: the progress bar only when run as a script

    args = parse_args(argv)
    try:
        check_config(args)
    except Refused as e:
        raise SystemExit(f"bench kernel_limits: refused: {e}") from None
    with Progress() as bar:
        task = bar.add_task("kernel limits", total=args.rounds)
        report = run(args, progress=lambda _: bar.advance(task))
    print_table(report)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
