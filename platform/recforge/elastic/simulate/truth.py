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
