"""Benchmark the cluster simulator: static vs Optimus vs DLRover-RM, and how the engine scales.

    python bench/bench_simulate.py [--jobs 1000] [--nodes 100] [--seeds 0 1 2] [--shape torchrec|ps]
    python bench/bench_simulate.py --scale [--scale-jobs 1000 10000 100000] [--scale-policies static,optimus,dlrover]

The comparison (default) runs every policy on the same trace per seed and writes bench/results/simulate.json:
each policy's metrics per seed, the gains against static per seed and their medians, next to the paper's.
`--scale` runs one policy at a time in a fresh process per point (1k jobs on 100 nodes, nodes scaled with the
jobs, the same arrival window, so the load per node is the same) and writes bench/results/simulate_scale.json
(`--scale-file NAME`: another file there): wall time, events, events/s, peak RSS and the load average per point.
Each size is checked against the machine's memory first; with `--budget-s S` a policy's point is not started when
its previous (smaller) point projects past S (its time x the jobs ratio, times the growth per 10x measured between
the two smaller points when there are two): the point records the projection instead.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the simulator is single-threaded python; keep BLAS from spinning
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model  # noqa: E402  # bench/_results.py

ROOT = Path(__file__).resolve().parents[1]
JOBS_PER_NODE = 10  # the scale curve's load: 1,000 jobs on 100 nodes


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(doc, f, indent=1, default=str)
    os.chmod(f.name, 0o644)  # NamedTemporaryFile creates 0600
    os.replace(f.name, path)



def projected_s(done: list[dict], jobs: int) -> float | None:
    """The time `jobs` would take from this policy's measured points (sorted by jobs): the largest one scaled by the
    jobs ratio, times its measured super-linearity (time ratio / jobs ratio between the last two points, >= 1)."""
    pts = [p for p in done if "sim_s" in p and p["jobs"] < jobs]
    if not pts:
        return None
    last, ratio = pts[-1], jobs / pts[-1]["jobs"]
    extra = 1.0  # the super-linearity measured between the last two points, carried over the same log-distance
    if len(pts) >= 2 and last["jobs"] > pts[-2]["jobs"]:
        prev = pts[-2]
        step = last["jobs"] / prev["jobs"]
        extra = max(1.0, (last["sim_s"] / prev["sim_s"]) / step) ** (math.log(ratio) / math.log(step))
    return last["sim_s"] * ratio * extra


def one_point(jobs: int, nodes: int, policy: str, seed: int, shape: str, window_h: float) -> dict:
    """One policy on one trace in this process: wall time, events, peak RSS."""
    from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy
    from recforge.elastic.simulate.engine import Simulation

    t0 = time.perf_counter()
    tp = TraceParams(shape=shape, n_jobs=jobs, arrival_window_h=window_h)
    trace = generate_trace(tp, seed=seed)
    t_trace = time.perf_counter() - t0
    sim = Simulation(trace, make_policy(policy), ClusterSpec(nodes=nodes),
                     SimParams(eviction_per_node_h=tp.eviction_per_node_h), seed)
    t1, c1 = time.perf_counter(), time.process_time()
    r = sim.run()
    t_sim, c_sim = time.perf_counter() - t1, time.process_time() - c1
    return {"jobs": jobs, "nodes": nodes, "policy": policy, "seed": seed, "trace_s": t_trace, "sim_s": t_sim,
            "sim_cpu_s": c_sim,  # (CPU seconds: on a shared machine the wall time also counts the waits for a core)
            "wall_s": time.perf_counter() - t0, "events": sim.events, "events_per_s": sim.events / t_sim,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "loadavg_end": os.getloadavg(),
            "completion_rate": r["completion_rate"], "jct_median_h": r["jct_median_h"],
            "cpu_utilization": r["cpu_utilization"], "memory_utilization": r["memory_utilization"]}


def scale(args) -> int:
    from recforge.elastic.simulate.limits import SimulationTooLarge, check_size

    points = []
    for jobs in args.scale_jobs:
        nodes = max(1, jobs // JOBS_PER_NODE)
        try:
            check_size(jobs, nodes)
        except SimulationTooLarge as e:
            print(f"skipped: {e}")
            points.append({"jobs": jobs, "nodes": nodes, "skipped": str(e)})
            continue
        pols = args.scale_policies_large if jobs > 10000 and args.scale_policies_large else args.scale_policies
        for policy in pols.split(","):
            proj = projected_s(sorted((p for p in points if p.get("policy") == policy), key=lambda p: p["jobs"]), jobs)
            if args.budget_s and proj is not None and proj > args.budget_s:
                points.append({"jobs": jobs, "nodes": nodes, "policy": policy, "projected_s": proj,
                               "skipped": f"projected {proj:.0f}s > budget {args.budget_s:.0f}s"})
                print(json.dumps(points[-1]))
                continue
            load0 = os.getloadavg()
            cmd = [sys.executable, __file__, "--point", str(jobs), str(nodes), policy, "--shape", args.shape,
                   "--window-h", str(args.window_h), "--seeds", str(args.seeds[0])]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout_s, check=False)
            except subprocess.TimeoutExpired:
                points.append({"jobs": jobs, "nodes": nodes, "policy": policy,
                               "error": f"timed out after {args.point_timeout_s}s"})
                print(points[-1])
                continue
            if out.returncode != 0:
                points.append({"jobs": jobs, "nodes": nodes, "policy": policy, "error": out.stderr[-2000:]})
            else:
                points.append({**json.loads(out.stdout.strip().splitlines()[-1]), "loadavg_start": load0,
                               "projected_s": proj})
            print(json.dumps(points[-1]))
    path = args.out / args.scale_file
    if args.merge and path.exists():  # keep the earlier points of sizes / policies not run now
        ran = {(p["jobs"], p.get("policy")) for p in points}
        points = [p for p in json.loads(path.read_text())["points"] if (p["jobs"], p.get("policy")) not in ran] + points
        points.sort(key=lambda p: (p["jobs"], str(p.get("policy"))))
    doc = {"what": "one policy per fresh process; nodes = jobs / 10; same arrival window (load per node constant)",
           "shape": args.shape, "window_h": args.window_h, "seed": args.seeds[0], "points": points,
           "goal": "10,000 nodes / 100,000 jobs in < 600 s",
           "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model()},
           "loadavg": os.getloadavg(), "python": sys.version.split()[0], "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
    _write(path, doc)
    print(f"wrote {path}")
    return 0


def compare(args) -> int:
    from rich.console import Console

    from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, report, simulate_policies
    from recforge.elastic.simulate.limits import check_size

    check_size(args.jobs, args.nodes)
    console = Console(width=160)
    names = args.policies.split(",")
    tp = TraceParams(shape=args.shape, n_jobs=args.jobs, arrival_window_h=args.window_h)
    cluster = ClusterSpec(nodes=args.nodes)
    params = SimParams(eviction_per_node_h=tp.eviction_per_node_h)
    runs = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        trace = generate_trace(tp, seed=seed)
        results, walls = simulate_policies(trace, names, cluster, params, seed)
        total = time.perf_counter() - t0
        console.print(report.table(results, f"seed {seed}: {args.jobs} jobs ({args.shape}), {args.nodes} nodes; "
                                            f"{total:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in walls.items())})"))
        if "static" in names:
            console.print(report.versus_table(results))
        runs.append({"seed": seed, "wall_s": total, "policy_wall_s": walls, "summary": report.summary(results)})
    med: dict = {}
    if "static" in names:
        for n in names:
            if n != "static":
                vs = [r["summary"]["versus_static"][n] for r in runs]
                med[n] = {k: statistics.median(v[k] for v in vs) for k in vs[0]}
    metrics = ("completion_rate", "jct_median_h", "cpu_utilization", "memory_utilization", "cluster_cpu_allocated",
               "queue_median_h", "plan_changes")
    per_policy = {n: {m: statistics.median(p[m] for r in runs for p in r["summary"]["policies"] if p["policy"] == n)
                      for m in metrics} for n in names}
    console.print("median over seeds, against static:", json.dumps(med, indent=1))
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "trace_params": tp.to_dict(),
           "median_policies": per_policy, "median_versus_static": med, "paper_versus_static": report.PAPER,
           "runs": runs, "loadavg": os.getloadavg(), "python": sys.version.split()[0],
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
    _write(args.out / "simulate.json", doc)
    console.print(f"wrote {args.out / 'simulate.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--shape", choices=("torchrec", "ps"), default="torchrec")
    ap.add_argument("--window-h", type=float, default=72.0, help="arrival window (hours)")
    ap.add_argument("--policies", default="static,optimus,dlrover")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--scale", action="store_true", help="the scaling curve instead of the comparison")
    ap.add_argument("--scale-jobs", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--scale-policies", default="static,optimus,dlrover")
    ap.add_argument("--scale-policies-large", default="",
                    help="policies for sizes above 10,000 jobs (default: the same)")
    ap.add_argument("--point-timeout-s", type=float, default=1800.0)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="--scale: skip a point whose projection from the policy's smaller points exceeds this")
    ap.add_argument("--merge", action="store_true", help="--scale: add to the scale file's points")
    ap.add_argument("--scale-file", default="simulate_scale.json",
                    help="--scale: the results file's name under --out (another name keeps the committed one)")
    ap.add_argument("--point", nargs=3, metavar=("JOBS", "NODES", "POLICY"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.point:
        jobs, nodes, policy = int(args.point[0]), int(args.point[1]), args.point[2]
        print(json.dumps(one_point(jobs, nodes, policy, args.seeds[0], args.shape, args.window_h)))
        return 0
    return scale(args) if args.scale else compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
