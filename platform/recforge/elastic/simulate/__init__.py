"""Cluster simulator for resource policies (`recforge simulate`): static vs Optimus vs DLRover-RM on one trace."""
# The trace (trace.py: arrivals, sizes, misconfigurations, faults) runs on a Kubernetes-like cluster
# (cluster.py) at a hidden true throughput (truth.py) under each policy (policies.py; DLRover-RM is
# recforge.elastic.optimizer's real code); report.py turns the results into a table, JSON and plots.
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from recforge.elastic.simulate.cluster import ClusterSpec
from recforge.exports import lazy_exports

if TYPE_CHECKING:
    from recforge.elastic.simulate.engine import SimParams as SimParams
    from recforge.elastic.simulate.engine import simulate as simulate
    from recforge.elastic.simulate.policies import make_policy as make_policy
    from recforge.elastic.simulate.trace import TraceParams as TraceParams
    from recforge.elastic.simulate.trace import generate_trace as generate_trace

DEFAULT_POLICIES = ("static", "optimus", "dlrover")

# Names resolve on first use: `recforge --help` imports this package's CLI; numpy / scipy load only when used.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.elastic.simulate.engine": ("SimParams", "simulate"),
    "recforge.elastic.simulate.policies": ("make_policy",),
    "recforge.elastic.simulate.trace": ("TraceParams", "generate_trace"),
}, eager=("DEFAULT_POLICIES", "ClusterSpec", "run_comparison", "simulate_policies"))


def run_comparison(trace_params=None, *, cluster=None, params=None, policies: Sequence[str] = DEFAULT_POLICIES,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Run `policies` on one generated trace (same faults for all); their results, in order."""
    from recforge.elastic.simulate.engine import SimParams  # lazy: numpy / scipy off the `recforge --help` path
    from recforge.elastic.simulate.trace import TraceParams, generate_trace  # lazy: as above

    trace_params = trace_params or TraceParams()
    trace = generate_trace(trace_params, seed=seed)
    params = replace(params or SimParams(), eviction_per_node_h=trace_params.eviction_per_node_h)
    return simulate_policies(trace, policies, cluster or ClusterSpec(), params, seed)[0]


def simulate_policies(trace, policies: Sequence[str], cluster, params, seed: int = 0
                      ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Each policy on the same trace: (results in order, wall seconds per policy)."""
    from recforge.elastic.simulate.engine import simulate  # lazy: numpy / scipy off the `recforge --help` path
    from recforge.elastic.simulate.policies import make_policy  # lazy: as above

    results, walls = [], {}
    for name in policies:
        t = time.perf_counter()
        results.append(simulate(trace, make_policy(name), cluster=cluster, params=params, seed=seed))
        walls[name] = time.perf_counter() - t
    return results, walls

