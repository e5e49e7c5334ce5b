"""Synthetic trace of DLRM training jobs: TorchRec-shaped (default: workers only, synchronous, sharded
embeddings) or asynchronous parameter-server style (`shape="ps"`, like AntGroup's).

`generate_trace` draws jobs of recurring scenarios over four model families, each with a hidden ground truth
(`truth.py`), a user's (often misconfigured) request and injected faults: stragglers, hot servers, node
evictions, embedding growth. Every number is a field of `TraceParams`; the defaults and why:
docs/dlrover_rm.md#the-simulated-trace.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TypedDict

import numpy as np

from recforge.elastic.simulate.truth import (
    server_memory_need,
    throughput,
    tr_throughput,
    tr_worker_memory,
    trainer_coefficients,
)

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
TR_MISCONFIG = {"over_provisioned": 0.40, "under_provisioned": 0.12, "too_many_workers": 0.16,
                "low_memory": 0.07, "reasonable": 0.25}


@dataclass(frozen=True)
class TraceParams:
    shape: str = "torchrec"           # "torchrec" (workers only) or "ps" (parameter servers)
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
    # TorchRec shape only
    tr_misconfig: dict = field(default_factory=lambda: dict(TR_MISCONFIG))
    tr_batch_sizes: tuple[int, ...] = (512, 1024, 2048)
    tr_emb_growth: tuple[float, float] = (0.05, 0.3)  # embedding state grows by this fraction over the job
    tr_worker_base_gib: tuple[float, float] = (2.0, 6.0)  # a worker's memory besides its embedding shard
    tr_gamma: tuple[float, float] = (0.6, 0.9)        # thread-scaling exponent of the dense compute

    def __post_init__(self) -> None:
        if self.shape not in ("torchrec", "ps"):
            raise ValueError(f"TraceParams.shape must be 'torchrec' or 'ps', got {self.shape!r}")
        if self.n_jobs < 1:
            raise ValueError(f"TraceParams.n_jobs must be >= 1, got {self.n_jobs}")

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
    shape: str = "ps"
    tables: tuple = ()    # TorchRec: bytes of each embedding table's state (weights + optimizer state)
    loss: tuple = ()      # hidden convergence curve (b0, b1, b2, target): l(k) = 1/(b0*k + b1) + b2, k in 1e6 samples


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
    if params.shape == "torchrec":
        return _torchrec_trace(params, seed)
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


# ---- TorchRec-shaped jobs ---------------------------------------------------------------------------------------
class TRFamily(TypedDict):
    compute: float                  # multiplier on the real trainer's per-sample compute coefficient
    comm: float                     # multiplier on its collective coefficient (log2 workers)
    tables: tuple[int, int]         # number of embedding tables (range)
    rows_m: tuple[float, float]     # rows per table, millions (log-uniform range)
    dim: tuple[int, ...]            # embedding dimension choices


# The profiled trainer is a small DLRM (dim 16, small MLPs); production models do 40-200x its dense work per sample.
TR_FAMILIES: dict[str, TRFamily] = {
    "dlrm": {"compute": 60.0, "comm": 1.0, "tables": (20, 30), "rows_m": (0.1, 8.0), "dim": (64, 128)},
    "dlrm_dcn": {"compute": 120.0, "comm": 1.3, "tables": (20, 30), "rows_m": (0.1, 8.0), "dim": (64, 128)},
    "deepfm": {"compute": 40.0, "comm": 0.8, "tables": (30, 45), "rows_m": (0.05, 4.0), "dim": (32, 64)},
    "xdeepfm": {"compute": 200.0, "comm": 1.5, "tables": (30, 45), "rows_m": (0.05, 4.0), "dim": (64,)},
}
OPTIMIZER_STATE = {"rowwise_adagrad": None, "adam": 2.0}  # extra state per weight: one value per row / two per weight


def _tr_scenarios(p: TraceParams, rng: np.random.Generator) -> list[dict]:
    base = trainer_coefficients()
    fams = list(TR_FAMILIES)
    out = []
    for i in range(p.n_scenarios):
        fam = fams[i % len(fams)]
        f = TR_FAMILIES[fam]
        coef = {"a0": base["a0"] * rng.uniform(0.7, 1.4), "a1": base["a1"] * f["compute"] * rng.uniform(0.7, 1.4),
                "a2": base["a2"] * f["comm"] * rng.uniform(0.7, 1.4)}
        dim = int(rng.choice(f["dim"]))
        opt = "adam" if rng.random() < 0.3 else "rowwise_adagrad"
        n = int(rng.integers(f["tables"][0], f["tables"][1] + 1))
        rows = np.exp(rng.uniform(np.log(f["rows_m"][0]), np.log(f["rows_m"][1]), n)) * 1e6
        extra = OPTIMIZER_STATE[opt]
        state = rows * dim * 4 * (1 + (extra if extra is not None else 1.0 / dim))  # rows x dim x 4 bytes + state
        w = int(rng.choice([2, 4, 6, 8, 12, 16, 24]))
        out.append({"name": f"t{i:03d}-{fam}", "family": fam, "coef": coef,
                    "gamma": float(rng.uniform(*p.tr_gamma)), "batch": int(rng.choice(p.tr_batch_sizes)),
                    "tables": tuple(float(x) for x in state), "optimizer": opt,
                    "base_gib": float(rng.uniform(*p.tr_worker_base_gib)),
                    "expert": {"workers": w, "cpu_per_worker": float(rng.choice([4, 6, 8]))},
                    "duration_h": float(np.exp(rng.normal(np.log(p.duration_median_h), p.duration_sigma)))})
    return out


def _tr_request(kind: str, expert: dict, need, pad: float, rng: np.random.Generator,
                max_pod: tuple[float, float]) -> dict:
    """need(w, end) -> bytes a worker needs with w workers at the start (end=False) or the end of the job."""
    w, cw = expert["workers"], expert["cpu_per_worker"]
    if kind == "over_provisioned":
        cw = cw * rng.uniform(2, 4)
        mw = need(w, True) * rng.uniform(2, 4)
    elif kind == "under_provisioned":
        w, cw = max(1, w // 2), max(1.0, cw // 2)
        mw = need(w, True) * 1.3
    elif kind == "too_many_workers":  # expecting linear speed-up: collectives eat it
        w = int(round(w * rng.uniform(2, 3)))
        mw = need(w, True) * 1.3
    elif kind == "low_memory":  # room to start, not to finish (the embedding state grows)
        lo = need(w, False) * 1.05
        mw = lo + rng.uniform(0, 1) * max(need(w, True) * 0.9 - lo, 0.0)
    else:
        w = max(1, int(round(w * rng.uniform(0.7, 1.3))))
        cw = max(1.0, round(cw * rng.uniform(0.7, 1.3)))
        mw = need(w, True) * 1.3
    cpu_cap, mem_cap = max_pod
    return {"workers": int(min(w, 60)), "cpu_per_worker": float(min(np.ceil(cw * pad), cpu_cap)),
            "memory_per_worker": float(min(mw * (pad if kind != "low_memory" else 1.0), mem_cap)),
            "servers": 0, "cpu_per_server": 0.0, "memory_per_server": 0.0}


def _torchrec_trace(params: TraceParams, seed: int) -> list[TraceJob]:
    rng = np.random.default_rng(seed)
    scen = _tr_scenarios(params, rng)
    ranks = np.arange(1, params.n_scenarios + 1, dtype=float)
    pz = ranks ** -params.scenario_zipf
    pz /= pz.sum()
    kinds, kp = list(params.tr_misconfig), np.array(list(params.tr_misconfig.values()), float)
    kp /= kp.sum()
    n = params.n_jobs
    arrivals = np.sort(rng.uniform(0, params.arrival_window_h * 3600, n))
    # every draw vectorised (100,000 jobs in seconds); per-job fields below only index these arrays
    sc_idx = rng.choice(params.n_scenarios, size=n, p=pz)
    j = params.scenario_jitter
    jit = rng.uniform(1 - j, 1 + j, size=(n, 5))
    growth = rng.uniform(*params.tr_emb_growth, size=n)
    kind_idx = rng.choice(len(kinds), size=n, p=kp)
    strag = rng.random(n) < params.p_straggler
    strag_at, strag_slow = rng.uniform(0.05, 0.8, n), rng.uniform(3, 6, n)
    req_rng = np.random.default_rng((seed, 17))
    loss_floor, loss_gap = rng.uniform(0.40, 0.50, n), rng.uniform(0.05, 0.15, n)
    pad = params.user_padding
    max_pod = (params.max_pod_cpu, params.max_pod_memory_gib * GiB)
    jobs = []
    for jid in range(n):
        sc = scen[int(sc_idx[jid])]
        coef = {"a0": sc["coef"]["a0"] * jit[jid, 0], "a1": sc["coef"]["a1"] * jit[jid, 1],
                "a2": sc["coef"]["a2"] * jit[jid, 2]}
        tables = tuple(t * jit[jid, 3] for t in sc["tables"])
        state = float(sum(tables))
        batch, expert = sc["batch"], sc["expert"]
        rate = tr_throughput(coef, sc["gamma"], batch, expert["workers"], expert["cpu_per_worker"])
        samples = rate * sc["duration_h"] * 3600 * jit[jid, 4]
        base = sc["base_gib"] * GiB
        grown = state * float(growth[jid])

        def need(w, end, base=base, state=state, grown=grown):
            return tr_worker_memory(base, state, w, grown if end else 0.0)

        kind = kinds[int(kind_idx[jid])]
        request = _tr_request(kind, expert, need, pad, req_rng, max_pod)
        request["batch_size"] = batch
        straggler = (float(strag_at[jid]), float(strag_slow[jid])) if strag[jid] else None
        # hidden loss curve: from 0.69 (chance) towards the floor b2; the job stops at the target, reached when
        # the gap has shrunk to `loss_gap` of the initial one, i.e. exactly at `samples`
        b2, f = float(loss_floor[jid]), float(loss_gap[jid])
        b1 = 1.0 / (0.69 - b2)
        b0 = b1 * (1.0 / f - 1.0) / (samples / 1e6)
        jobs.append(TraceJob(jid, float(arrivals[jid]), sc["name"], sc["family"], batch, float(samples), coef,
                             sc["gamma"], base, state, grown / samples, kind, request, dict(expert), straggler, 1.0,
                             shape="torchrec", tables=tables, loss=(b0, b1, b2, b2 + f * (0.69 - b2))))
    return jobs
