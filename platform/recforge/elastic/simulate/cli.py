"""`recforge simulate`: run the cluster simulation for several policies and print / write the comparison."""
from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="cluster simulator: static vs Optimus vs DLRover-RM resource policies",
                  invoke_without_command=True)


@app.callback()
def simulate_cmd(
    jobs: int = typer.Option(1000, help="jobs in the trace"),
    nodes: int = typer.Option(100, help="cluster nodes"),
    cpu_per_node: float = typer.Option(32.0, help="cores per node"),
    memory_per_node_gib: float = typer.Option(128.0, help="memory per node (GiB)"),
    arrival_window_h: float | None = typer.Option(
        None, help="arrivals spread over this many hours (default: 72 h per 1,000 jobs)"),
    policies: str = typer.Option("static,optimus,dlrover", help="comma-separated: static, optimus, optimus-stage2, "
                                 "dlrover, dlrover-nowarm, dlrover-nostage3, dlrover-nofailover"),
    shape: str = typer.Option("torchrec", help="job shape: torchrec (workers only) or ps (parameter servers)"),
    seed: int = typer.Option(0, help="trace and fault seed (the run is deterministic under it)"),
    out: Path | None = typer.Option(None, help="directory for simulation.json and the plots"),
    params_json: Path | None = typer.Option(None, "--trace-params", help="JSON file overriding TraceParams fields"),
):
    """Simulate a trace of DLRM jobs on a cluster under each policy; print a table, write JSON and plots."""
    from recforge.elastic.simulate.limits import SimulationTooLarge, check_size  # lazy: as below

    try:
        check_size(jobs, nodes)  # before anything is generated: a size this machine cannot hold says so
    except SimulationTooLarge as e:
        raise typer.BadParameter(str(e)) from e
    from recforge.elastic.simulate import (  # lazy: numpy / scipy off the `recforge --help` path
        ClusterSpec,
        SimParams,
        TraceParams,
        generate_trace,
        make_policy,
        report,  # lazy: numpy off the `recforge --help` path
        simulate_policies,
    )

    console = Console()
    overrides = json.loads(params_json.read_text()) if params_json else {}
    unknown = set(overrides) - set(TraceParams.__dataclass_fields__)
    if unknown:
        raise typer.BadParameter(f"unknown trace parameters {sorted(unknown)}; "
                                 f"known: {sorted(TraceParams.__dataclass_fields__)}")
    window = arrival_window_h if arrival_window_h is not None else 72.0 * jobs / 1000
    tp = TraceParams(**{"shape": shape, "n_jobs": jobs, "arrival_window_h": window, **overrides})
    cluster = ClusterSpec(nodes=nodes, cpu_per_node=cpu_per_node, memory_per_node=memory_per_node_gib * (1 << 30))
    names = [p.strip() for p in policies.split(",") if p.strip()]
    for n in names:
        make_policy(n)  # unknown names fail before any work
    t0 = time.perf_counter()
    trace = generate_trace(tp, seed=seed)
    params = SimParams(eviction_per_node_h=tp.eviction_per_node_h)
    results, timings = simulate_policies(trace, names, cluster, params, seed)
    wall = time.perf_counter() - t0
    console.print(report.table(results,
                               f"{jobs} jobs on {nodes} nodes x {cpu_per_node:g} cores, seed {seed} ({wall:.1f}s)"))
    if "static" in names and len(names) > 1:
        console.print(report.versus_table(results))
    if out is not None:
        meta = {"trace_params": tp.to_dict(), "cluster": {"nodes": nodes, "cpu_per_node": cpu_per_node,
                "memory_per_node_gib": memory_per_node_gib}, "sim_params": params.__dict__, "seed": seed,
                "wall_s": wall, "policy_wall_s": timings}
        paths = report.write(results, out, meta)
        console.print(f"wrote {', '.join(str(p) for p in paths.values())}")
