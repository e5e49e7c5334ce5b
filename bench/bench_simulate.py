"""Benchmark the cluster simulator: 1,000 DLRM jobs on 100 nodes under static, Optimus-style and DLRover-RM.

    python bench/bench_simulate.py [--jobs 1000] [--nodes 100] [--seeds 0 1 2]

Prints the comparison table per seed and the wall time of each policy's run (the goal: the whole
1,000-job / 100-node comparison in <= 60 s on this machine), and writes bench/results/bench_simulate_<UTC>.json
plus the plots of the first seed. The machine is shared: report medians over seeds, not single timings.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the simulator is single-threaded python; keep BLAS from spinning
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", default="static,optimus,dlrover")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    from rich.console import Console

    from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, report, simulate_policies

    console = Console(width=160)
    names = args.policies.split(",")
    tp = TraceParams(n_jobs=args.jobs, arrival_window_h=72.0 * args.jobs / 1000)
    cluster = ClusterSpec(nodes=args.nodes)
    params = SimParams(eviction_per_node_h=tp.eviction_per_node_h)
    runs = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        trace = generate_trace(tp, seed=seed)
        t_trace = time.perf_counter() - t0
        results, walls = simulate_policies(trace, names, cluster, params, seed)
        total = time.perf_counter() - t0
        per_policy = ", ".join(f"{k} {v:.1f}s" for k, v in walls.items())
        console.print(report.table(results, f"seed {seed}: {args.jobs} jobs, {args.nodes} nodes; trace {t_trace:.1f}s, "
                                            f"all policies {total:.1f}s ({per_policy})"))
        if "static" in names:
            console.print(report.versus_table(results))
        runs.append({"seed": seed, "wall_s": total, "trace_s": t_trace, "policy_wall_s": walls,
                     "summary": report.summary(results)})
        if seed == args.seeds[0]:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            plots = report.plot(results, args.out.mkdir(parents=True, exist_ok=True) or args.out)
            for p in plots.values():
                p.rename(args.out / f"bench_simulate_{stamp}_{p.name}")

    med = {}
    if "static" in names:
        for n in names:
            if n == "static":
                continue
            vs = [r["summary"]["versus_static"][n] for r in runs]
            med[n] = {k: statistics.median(v[k] for v in vs) for k in vs[0]}
        console.print("median over seeds, against static:", json.dumps(med, indent=1))
    walls = [r["wall_s"] for r in runs]
    console.print(f"wall time of the whole comparison: median {statistics.median(walls):.1f}s over {len(walls)} seeds "
                  f"(goal <= 60 s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    out = args.out / f"bench_simulate_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "trace_params": tp.to_dict(),
                               "median_versus_static": med, "runs": runs, "loadavg": os.getloadavg(),
                               "python": sys.version}, indent=1, default=str))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
