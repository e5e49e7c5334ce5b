"""Cluster simulator for resource policies (`recforge simulate`).

An event-driven simulation of a Kubernetes-like cluster (nodes with CPU and memory) running a trace
of DLRM parameter-server jobs (`trace.py`: arrivals, sizes, users' misconfigurations, faults) whose
true throughput comes from a hidden ground truth (`truth.py`). Policies (`policies.py`): the user's
static request, an Optimus-style model-based policy, and DLRover-RM built from recforge.elastic's
real optimizer. `run_comparison` runs them on one trace and returns their results (report.py turns
them into a table, JSON and plots).
"""
from __future__ import annotations

from typing import Any, Sequence

DEFAULT_POLICIES = ("static", "optimus", "dlrover")

# Lazy: `recforge --help` imports the CLI module of this package; numpy / scipy load only when used.
_EXPORTS = {
    "ClusterSpec": "recforge.elastic.simulate.cluster", "SimParams": "recforge.elastic.simulate.engine",
    "simulate": "recforge.elastic.simulate.engine", "make_policy": "recforge.elastic.simulate.policies",
    "TraceParams": "recforge.elastic.simulate.trace", "generate_trace": "recforge.elastic.simulate.trace",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_comparison(trace_params=None, *, cluster=None, params=None, policies: Sequence[str] = DEFAULT_POLICIES,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Run `policies` on one generated trace (same faults for all); their results, in order."""
    from dataclasses import replace

    from recforge.elastic.simulate.cluster import ClusterSpec
    from recforge.elastic.simulate.engine import SimParams, simulate
    from recforge.elastic.simulate.policies import make_policy
    from recforge.elastic.simulate.trace import TraceParams, generate_trace

    trace_params = trace_params or TraceParams()
    trace = generate_trace(trace_params, seed=seed)
    params = replace(params or SimParams(), eviction_per_node_h=trace_params.eviction_per_node_h)
    return simulate_policies(trace, policies, cluster or ClusterSpec(), params, seed)[0]


def simulate_policies(trace, policies: Sequence[str], cluster, params, seed: int = 0
                      ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Each policy on the same trace: (results in order, wall seconds per policy)."""
    import time

    from recforge.elastic.simulate.engine import simulate
    from recforge.elastic.simulate.policies import make_policy

    results, walls = [], {}
    for name in policies:
        t = time.perf_counter()
        results.append(simulate(trace, make_policy(name), cluster=cluster, params=params, seed=seed))
        walls[name] = time.perf_counter() - t
    return results, walls


__all__ = ["ClusterSpec", "SimParams", "TraceParams", "generate_trace", "make_policy", "run_comparison", "simulate",
           "simulate_policies"]
