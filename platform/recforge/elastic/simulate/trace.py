"""Synthetic trace of DLRM training jobs (asynchronous parameter-server style, like AntGroup's).

`generate_trace` draws jobs of recurring scenarios over four model families, each with a hidden ground truth
(`truth.py`), a user's (often misconfigured) request and injected faults: stragglers, hot servers, node
evictions, embedding growth. Every number is a field of `TraceParams`; the defaults and why:
docs/dlrover_rm.md#the-simulated-trace.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TypedDict

import numpy as np

from recforge.elastic.simulate.truth import server_memory_need, throughput

GiB = float(1 << 30)


class Family(TypedDict):
    compute: float                 # multiplier on the worker compute coefficient
    server: float                  # multiplier on the server load coefficient
    emb_gib: tuple[float, float]   # embedding size range, GiB


# family -> multipliers on the base ground-truth coefficients (compute, server load) and embedding GiB range
FAMILIES: dict[str, Family] = {
    "wide_deep": {"compute": 0.6, "server": 0.8, "emb_gib": (6, 30)},
    "deepfm": {"compute": 1.0, "server": 1.0, "emb_gib": (10, 50)},
    "dcn": {"compute": 1.6, "server": 0.9, "emb_gib": (8, 40)},
    "xdeepfm": {"compute": 2.5, "server": 1.3, "emb_gib": (15, 80)},
}

MISCONFIG = {"over_provisioned": 0.40, "under_provisioned": 0.12, "too_few_servers": 0.16,
             "low_memory": 0.07, "reasonable": 0.25}


@dataclass(frozen=True)
class TraceParams:
    n_jobs: int = 1000
    arrival_window_h: float = 48.0
    n_scenarios: int = 60
    scenario_zipf: float = 1.1
    scenario_jitter: float = 0.10
    duration_median_h: float = 1.5
    duration_sigma: float = 0.8
    batch_sizes: tuple[int, ...] = (256, 512, 1024)
    misconfig: dict = field(default_factory=lambda: dict(MISCONFIG))
    user_padding: float = 1.25
    p_straggler: float = 0.12
    p_hot_server: float = 0.15
    eviction_per_node_h: float = 0.004
    emb_growth: tuple[float, float] = (0.3, 1.0)   # embedding grows by this fraction over the job
    worker_memory_gib: tuple[float, float] = (1.5, 4.0)
    max_pod_cpu: float = 32.0         # the largest pod a user may request (a node)
    max_pod_memory_gib: float = 120.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TraceJob:
    job_id: int
    arrival_s: float
    scenario: str
    family: str
    batch_size: int
    total_samples: float
    coef: dict            # hidden ground-truth coefficients (see truth.py)
    gamma: float          # hidden thread-scaling exponent (<1: cores help sublinearly)
    worker_mem: float     # bytes a worker needs
    emb_bytes: float      # embedding bytes at start, all servers together
    emb_growth_per_sample: float
    misconfig: str
    request: dict         # PodPlan fields the user asked for
    expert: dict          # the scenario's expert plan (for reference only; no policy sees it)
    straggler: tuple[float, float] | None  # (fraction of the job done when it starts, slowdown)
    hot_server: float     # load factor of the hottest server (1 = balanced)


BASE_COEF = {"a0": 0.02, "a1": 4e-4, "b1": 5e-5, "b2": 0.002, "b3": 0.001, "b4": 0.0005}


def _scenarios(p: TraceParams, rng: np.random.Generator) -> list[dict]:
    out = []
    fams = list(FAMILIES)
    for i in range(p.n_scenarios):
        fam = fams[i % len(fams)]
        f = FAMILIES[fam]
        coef = dict(BASE_COEF)
        coef["a1"] *= f["compute"] * rng.uniform(0.7, 1.4)
        coef["b1"] *= f["server"] * rng.uniform(0.7, 1.4)
        for k in ("a0", "b2", "b3", "b4"):
            coef[k] *= rng.uniform(0.6, 1.6)
        w = int(rng.choice([4, 6, 8, 12, 16, 24, 32]))
        expert = {"workers": w, "cpu_per_worker": float(rng.choice([4, 6, 8])),
                  "servers": max(1, int(round(w / rng.uniform(3, 5)))), "cpu_per_server": float(rng.choice([4, 6, 8]))}
        out.append({"name": f"s{i:03d}-{fam}", "family": fam, "coef": coef, "gamma": float(rng.uniform(0.75, 0.95)),
                    "batch": int(rng.choice(p.batch_sizes)), "expert": expert,
                    "emb_gib": float(rng.uniform(*f["emb_gib"])),
                    "worker_gib": float(rng.uniform(*p.worker_memory_gib)),
                    "duration_h": float(np.exp(rng.normal(np.log(p.duration_median_h), p.duration_sigma)))})
    return out


def _request(kind: str, expert: dict, need_worker: float, need_server_start: float, need_server_end: float,
             pad: float, rng: np.random.Generator, max_pod: tuple[float, float]) -> dict:
    w, cw, s, cs = expert["workers"], expert["cpu_per_worker"], expert["servers"], expert["cpu_per_server"]
    mw, ms = need_worker * 1.5, need_server_end * 1.3
    if kind == "over_provisioned":
        k = rng.uniform(2, 4)
        cw, cs = min(32.0, cw * k), min(32.0, cs * rng.uniform(1.5, 3))
        mw, ms = need_worker * rng.uniform(2, 4), need_server_end * rng.uniform(2, 4)
    elif kind == "under_provisioned":
        w, cw = max(1, w // 2), max(1.0, cw // 2)
    elif kind == "too_few_servers":
        s = max(1, int(w // rng.uniform(8, 16)))
        ms = need_server_end * expert["servers"] / s * 1.3
    elif kind == "low_memory":
        lo = need_server_start * 1.05  # room to start, not to finish (when growth is small, it may finish)
        ms = lo + rng.uniform(0, 1) * max(need_server_end * 0.9 - lo, 0.0)
    else:
        w = max(1, int(round(w * rng.uniform(0.7, 1.3))))
        cw = max(1.0, round(cw * rng.uniform(0.7, 1.3)))
    # nobody can ask for a pod larger than a node (`max_pod`): such requests are cut to it
    cpu_cap, mem_cap = max_pod
    return {"workers": int(w), "cpu_per_worker": float(min(np.ceil(cw * pad), cpu_cap)),
            "memory_per_worker": float(min(mw * pad, mem_cap)), "servers": int(s),
            "cpu_per_server": float(min(np.ceil(cs * pad), cpu_cap)),
            "memory_per_server": float(min(ms * (pad if kind != "low_memory" else 1.0), mem_cap))}


def generate_trace(params: TraceParams = TraceParams(), seed: int = 0) -> list[TraceJob]:
    rng = np.random.default_rng(seed)
    scen = _scenarios(params, rng)
    ranks = np.arange(1, params.n_scenarios + 1, dtype=float)
    pz = ranks ** -params.scenario_zipf
    pz /= pz.sum()
    kinds, kp = list(params.misconfig), np.array(list(params.misconfig.values()), float)
    kp /= kp.sum()
    arrivals = np.sort(rng.uniform(0, params.arrival_window_h * 3600, params.n_jobs))
    jobs = []
    for jid, t in enumerate(arrivals):
        sc = scen[int(rng.choice(params.n_scenarios, p=pz))]
        j = params.scenario_jitter
        coef = {k: v * rng.uniform(1 - j, 1 + j) for k, v in sc["coef"].items()}
        batch = sc["batch"]
        expert = dict(sc["expert"])
        emb = sc["emb_gib"] * GiB * rng.uniform(1 - j, 1 + j)
        growth_frac = rng.uniform(*params.emb_growth)
        rate = throughput(coef, sc["gamma"], batch, expert["workers"], expert["cpu_per_worker"], expert["servers"],
                          expert["cpu_per_server"])
        samples = rate * sc["duration_h"] * 3600 * rng.uniform(1 - j, 1 + j)
        hot = float(rng.uniform(1.5, 3.0)) if rng.random() < params.p_hot_server else 1.0
        worker_mem = sc["worker_gib"] * GiB
        per_sample = emb * growth_frac / samples
        need_s0 = server_memory_need(emb, 0.0, per_sample, expert["servers"], hot)
        need_s1 = server_memory_need(emb, samples, per_sample, expert["servers"], hot)
        kind = kinds[int(rng.choice(len(kinds), p=kp))]
        request = _request(kind, expert, worker_mem, need_s0, need_s1, params.user_padding, rng,
                           (params.max_pod_cpu, params.max_pod_memory_gib * GiB))
        request["batch_size"] = batch
        straggler = ((float(rng.uniform(0.05, 0.8)), float(rng.uniform(3, 6)))
                     if rng.random() < params.p_straggler else None)
        jobs.append(TraceJob(jid, float(t), sc["name"], sc["family"], batch, float(samples), coef, sc["gamma"],
                             worker_mem, emb, per_sample, kind, request, expert, straggler, hot))
    return jobs
