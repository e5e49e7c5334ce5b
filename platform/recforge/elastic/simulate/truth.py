"""The hidden ground truth of the simulation: no policy reads this module.

Step time of an asynchronous parameter-server job (seconds; every worker processes one batch B):

    T = a0 + a1*B/cw^g + hot*b1*(w/p)*B/cs^g + b2*(w/p) + b3*p + b4*w

with g < 1 (extra cores help sublinearly, which the policies' model, linear in 1/cores, does not
assume) and `hot` >= 1 the load factor of the hottest server (every step waits for it). A straggling
worker runs `slow` times slower; dynamic data sharding lets the others take its share, so the job
loses (1 - 1/slow) of one worker. CPU in use: the core-seconds of compute per step over the step time
(more cores than the work can use are idle; half the fixed overhead keeps one core busy). Server memory:
base + (embeddings now) / p x hot share.
"""
from __future__ import annotations

import math

GiB = float(1 << 30)
SERVER_BASE = 1.0 * GiB


def step_time(coef: dict, g: float, b: int, w: int, cw: float, p: int, cs: float, hot: float = 1.0) -> float:
    return (coef["a0"] + coef["a1"] * b / cw ** g + hot * coef["b1"] * (w / p) * b / cs ** g
            + coef["b2"] * (w / p) + coef["b3"] * p + coef["b4"] * w)


def throughput(coef: dict, g: float, b: int, w: int, cw: float, p: int, cs: float, hot: float = 1.0,
               slow: float | None = None) -> float:
    t = step_time(coef, g, b, w, cw, p, cs, hot)
    eff = w if slow is None else (w - 1 + 1.0 / slow)
    return eff * b / t


def cpu_used(coef: dict, g: float, b: int, w: int, cw: float, p: int, cs: float,
             hot: float = 1.0) -> tuple[float, float]:
    """Cores busy on average: (all workers, all servers)."""
    t = step_time(coef, g, b, w, cw, p, cs, hot)
    workers = w * (coef["a1"] * b * cw ** (1 - g) + 0.5 * coef["a0"]) / t  # the fixed overhead runs on one core
    servers = (coef["b1"] * w * b * cs ** (1 - g) * (1 + (hot - 1) / p) + coef["b2"] * w * 0.5) / t
    return min(workers, w * cw), min(servers, p * cs)


def server_memory_need(emb0: float, samples_done: float, growth_per_sample: float, p: int, hot: float = 1.0) -> float:
    """Bytes the most loaded server needs."""
    share = (1.0 + (hot - 1.0) * 0.5) / p  # a hot server also holds more of the variables
    return SERVER_BASE + (emb0 + growth_per_sample * samples_done) * share


def samples_until_server_oom(emb0: float, growth_per_sample: float, p: int, hot: float, memory: float) -> float:
    share = (1.0 + (hot - 1.0) * 0.5) / p
    room = (memory - SERVER_BASE) / share - emb0
    if room <= 0:
        return 0.0
    return float("inf") if growth_per_sample <= 0 else room / growth_per_sample


# ---- TorchRec-shaped jobs (workers only, synchronous, sharded embeddings) --------------------------------------
#
#     T = a0 + a1*B/c^g + a2*log2(w)          (seconds per step; every worker processes B samples)
#
# a0, a1, a2: the const / b_per_cpu / log_w coefficients of the real trainer's throughput model fitted on its
# committed profile (`trainer_coefficients`); the trace scales them per model family. A straggler slows the
# compute of its step and, the training being synchronous, every worker waits for it. CPU in use: cores busy
# in compute (c cores for a1*B/c^g, with g < 1 the extra cores spin), half the fixed overhead on one core;
# nothing while waiting in collectives. Memory of a worker: base + its embedding shard (weights + optimizer
# state; tables sharded over the workers, planner imbalance `SHARD_SKEW`) + growth.
SHARD_SKEW = 1.05


def tr_step_time(coef: dict, g: float, b: int, w: int, c: float, slow: float = 1.0) -> float:
    return coef["a0"] + slow * coef["a1"] * b / c ** g + coef["a2"] * math.log2(w)


def tr_throughput(coef: dict, g: float, b: int, w: int, c: float, slow: float = 1.0) -> float:
    return w * b / tr_step_time(coef, g, b, w, c, slow)


def tr_cpu_used(coef: dict, g: float, b: int, w: int, c: float, slow: float = 1.0) -> float:
    """Cores busy on average over all workers."""
    t = tr_step_time(coef, g, b, w, c, slow)
    per = (coef["a1"] * b * c ** (1 - g) + 0.5 * coef["a0"]) / t
    return min(per, c) * w


def tr_worker_memory(base: float, emb_state_bytes: float, w: int, grown: float = 0.0) -> float:
    """Bytes the most loaded worker needs: base + its shard of the embedding state (+ growth so far)."""
    return base + SHARD_SKEW * (emb_state_bytes + grown) / w


def trainer_coefficients() -> dict:
    """(a0, a1, a2) of the real trainer: its throughput model fitted on the committed profile's points where the
    ranks had a core each (w * threads <= host cores), with terms const, b_per_cpu, b_threads, log_w; b_threads
    (extra threads contending on a busy 2-core host) is left out: pods on a cluster have their own cores."""
    if not _TRAINER:
        from recforge.elastic.optimizer.models.throughput_model import fit, load_profile  # lazy: reads a file

        samples, cond = load_profile()
        host = float((cond.get("machine") or {}).get("logical_cpus") or 2)
        ok = [s for s in samples if s.allocation.workers * s.allocation.cpu_per_worker <= host]
        m = fit(ok, ("const", "b_per_cpu", "b_threads", "log_w"))
        c = dict(zip(m.terms, m.coef, strict=True))
        _TRAINER.update({"a0": c["const"], "a1": c["b_per_cpu"], "a2": c["log_w"], "fit_mape": m.fit_mape,
                         "points": len(ok)})
    return dict(_TRAINER)


_TRAINER: dict = {}
