"""The policies the simulator compares; each sees only what a job's profiler would report.

- `static`: the user's request, never changed; an OOM or eviction restarts the job with the same plan.
- `optimus`: Optimus's own allocation (Peng et al., EuroSys'18): every `interval_s` it fits each job's
  convergence curve (loss vs samples) and throughput model (online NNLS from a generic prior), estimates
  each job's remaining time and gives the cluster away one worker at a time to the job whose remaining
  time drops most per unit of its dominant resource, until the cluster is full (`OptimusAllocator`).
  Pods keep the user's size; no warm start, no instability handling. It shares only the model fitting
  utilities with DLRover-RM, not its search. (`optimus-stage2`: the former stand-in, DLRover-RM's stage 2
  with right-sizing off.)
- `dlrover`: DLRover-RM: stage 1 from the history of the job's scenario (filled as jobs finish), stage 2
  as above but from the warm-start model, stage 3 (stragglers, hot servers, memory, pending), and
  elastic failover (an evicted pod is relaunched alone, without restarting the job).
DLRover-RM uses the real `recforge.elastic.optimizer` code.
"""
from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import replace

import numpy as np

from recforge.elastic.optimizer import (
    PS_TERMS,
    Event,
    InMemoryHistory,
    InstabilityStage,
    JobDescription,
    JobLimits,
    JobRecord,
    Observation,
    OptimizerConfig,
    PodPlan,
    RuntimeStage,
    Sample,
    ThroughputModel,
    embedding_shard_bytes,
    warm_start,
)
from recforge.elastic.optimizer.models.throughput_model import Allocation, OnlineThroughputModel, refit_many

GiB = float(1 << 30)

# A generic prior for PS jobs: an engineer's guess of a "typical DLRM", deliberately not the truth
# (each coefficient is 0.5x-2x off the trace's base values).
GENERIC_PRIOR = ThroughputModel(PS_TERMS, (0.04, 2e-4, 1e-4, 0.001, 0.002, 0.001), meta={"source": "generic prior"})
# The same for TorchRec-shaped jobs, in the worker-only form of the real trainer's model (const, B/cpu, log2 w):
# a guess 2x off the trace's typical level and 1.5x off its collective cost (truth.py, trace.TR_FAMILIES).
TR_TERMS = ("const", "b_per_cpu", "log_w")
GENERIC_TR_PRIOR = ThroughputModel(TR_TERMS, (0.03, 1.5e-3, 0.04), meta={"source": "generic prior (worker-only)"})


def prior_for(job) -> ThroughputModel:
    return GENERIC_TR_PRIOR if getattr(job, "shape", "ps") == "torchrec" else GENERIC_PRIOR


class SimPolicy:
    name = "base"
    elastic_failover = False
    interval_s: float | None = None  # a cluster-wide policy re-plans every interval_s (`allocate`)
    observes = True                  # it reads the profiler's reports (`on_tick`); static does not
    wants_loss = False               # it reads the jobs' training loss (`on_loss`)
    rate_only = False                # it reads only a report's samples/s and worker memory (`on_rate`, not `on_tick`)

    def initial_plan(self, job, desc: JobDescription, limits: JobLimits) -> tuple[PodPlan, list[Event]]:
        return desc.requested, []

    def on_tick(self, job, obs: Observation) -> list[Event]:
        return []

    def on_rate(self, job, plan: PodPlan, samples_per_s: float, worker_memory: float | None) -> None:
        """A `rate_only` policy's report: what `on_tick` would read of it (it returns no events)."""

    def on_oom(self, job, obs: Observation) -> list[Event]:
        return []

    def on_pending(self, job, obs: Observation) -> list[Event]:
        return []

    def on_finish(self, job, plan: PodPlan, state) -> None:
        pass

    def on_loss(self, job, k: float, loss: float) -> None:
        pass

    def allocate(self, runs, cluster, t: float) -> dict[int, int]:
        """Workers per job id for the jobs `runs` (cluster-wide policies only); {}: no change."""
        return {}


class StaticPolicySim(SimPolicy):
    name = "static"
    observes = False


class OptimusStage2Sim(SimPolicy):
    """The former stand-in for Optimus: DLRover-RM's stage 2 search with right-sizing off."""
    name = "optimus-stage2"

    def __init__(self, config: OptimizerConfig = OptimizerConfig()) -> None:
        self.config = replace(config, rightsize=False)  # Optimus only follows its throughput model
        self.stages: dict[int, RuntimeStage] = {}

    def initial_plan(self, job, desc, limits):
        self.stages[job.job_id] = RuntimeStage(desc, limits, self.config, prior_for(job))
        return desc.requested, []

    def on_tick(self, job, obs):
        return self.stages[job.job_id].observe(obs)

    def on_finish(self, job, plan, state):
        self.stages.pop(job.job_id, None)


class DLRoverPolicySim(SimPolicy):
    name = "dlrover"
    elastic_failover = True

    def __init__(self, config: OptimizerConfig = OptimizerConfig(), warm: bool = True, instability: bool = True,
                 failover: bool = True) -> None:
        self.config = config
        self.history = InMemoryHistory()
        self.warm, self.instability, self.elastic_failover = warm, instability, failover
        self.runtime: dict[int, RuntimeStage] = {}
        self.stage3: dict[int, InstabilityStage] = {}
        if not (warm and instability and failover):
            self.name = "dlrover" + "".join(s for s, on in (("-nowarm", warm), ("-nostage3", instability),
                                                             ("-nofailover", failover)) if not on)

    def initial_plan(self, job, desc, limits):
        ws = warm_start(desc, self.history if self.warm else None, limits, self.config, prior_for(job))
        for e in ws.events:
            e.time_s = job.arrival_s
        self.runtime[job.job_id] = RuntimeStage(desc, limits, self.config, ws.prior or prior_for(job), None)
        self.stage3[job.job_id] = InstabilityStage(desc, limits, self.config, None)
        return ws.plan, ws.events

    def on_tick(self, job, obs):
        events = self.stage3[job.job_id].observe(obs) if self.instability else []
        if any(e.changes_plan for e in events):
            return events
        return events + self.runtime[job.job_id].observe(obs)

    def on_oom(self, job, obs):
        return self.stage3[job.job_id].observe(obs) if self.instability else []

    def on_pending(self, job, obs):
        return self.stage3[job.job_id].observe(obs) if self.instability else []

    def on_finish(self, job, plan, state):
        rt = self.runtime.pop(job.job_id, None)
        self.stage3.pop(job.job_id, None)
        # the job's own model once it saw its own samples (fitted, or the prior rescaled to them)
        model = rt.model.model if rt is not None and rt.model.samples else None
        self.history.add(JobRecord(dataset=job.scenario, model_family=job.family, final_plan=plan.to_dict(),
                                   samples_per_s=state.get("rate"), model=model,
                                   peak_memory_bytes=state.get("peak_worker_mem"), finished_at=state["time"],
                                   extra={"peak_server_memory": state.get("peak_server_mem")}))


# ---- Optimus (Peng et al., EuroSys'18) ---------------------------------------------------------------------------
def fit_convergence(k: np.ndarray, loss: np.ndarray, grid: int = 32) -> tuple[float, float, float] | None:
    """Optimus's convergence model l(k) = 1/(b0*k + b1) + b2 (b >= 0) fitted to (k, loss) by least squares:
    for each b2 on a grid below the smallest loss, 1/(l - b2) is linear in k (a least-squares line); the b2 whose
    curve has the smallest squared loss error wins. None with fewer than 3 points or no decreasing fit.
    (Few numpy calls: Optimus refits every job's curve each round; np.linspace's grid, means as sums / n.)"""
    k, loss = np.asarray(k, float), np.asarray(loss, float)
    n = len(k)
    if n < 3 or not k.max() - k.min() > 0:
        return None
    top = float(loss.min()) * 0.995
    if grid >= 2:  # np.linspace(0, top, grid): arange * step, the last point exactly `top`
        b2s = _ARANGE[:grid] * (top / (grid - 1)) if grid <= len(_ARANGE) else np.arange(grid) * (top / (grid - 1))
        b2s[-1] = top
    else:
        b2s = np.linspace(0.0, top, grid)
    col = b2s[:, None]
    y = 1.0 / (loss - col)                    # grid x points
    km, ym = k.sum() / n, y.sum(axis=1) / n
    dk = k - km
    b0 = np.maximum((dk * (y - ym[:, None])).sum(axis=1) / (dk * dk).sum(), 0.0)
    b1 = np.maximum(ym - b0 * km, 1e-9)
    r = 1.0 / (b0[:, None] * k + b1[:, None]) + col - loss
    i = int(np.argmin((r * r).sum(axis=1)))
    if b0[i] <= 0:
        return None
    return float(b0[i]), float(b1[i]), float(b2s[i])


_ARANGE = np.arange(64, dtype=float)
_MANY_CHUNK = 64  # curves per vectorised block in `fit_convergence_many` (64 x 32 x 30 doubles: 0.5 MB a temporary)


def fit_convergence_many(ks: list, losses: list, grid: int = 32) -> list[tuple[float, float, float] | None]:
    """`fit_convergence` of many curves ((k, loss) sequences), to the same values: the curves of one length are
    fitted together, row by row in the same arithmetic (each row's sums are numpy's sums over that row's
    contiguous values, as for one curve; `tests/unit/test_simulate_speedups7.py` checks them equal). Optimus
    refits every running job's curve every round; one job at a time, numpy's per-call overhead was most of it."""
    if len(ks) != len(losses):
        raise ValueError(f"fit_convergence_many: {len(ks)} k sequences but {len(losses)} loss sequences")
    out: list[tuple[float, float, float] | None] = [None] * len(ks)
    if grid < 2 or grid > len(_ARANGE):
        for i, (k, loss) in enumerate(zip(ks, losses, strict=True)):
            out[i] = fit_convergence(np.asarray(k, float), np.asarray(loss, float), grid)
        return out
    by_n: dict[int, list[int]] = {}
    for i, (k, loss) in enumerate(zip(ks, losses, strict=True)):
        if len(k) != len(loss):
            raise ValueError(f"fit_convergence_many: curve {i} has {len(k)} k values but {len(loss)} losses")
        if len(k) >= 3:
            by_n.setdefault(len(k), []).append(i)
    steps = _ARANGE[:grid]
    for n, idx_all in by_n.items():
        # one curves x grid x points buffer per length: every elementwise step below writes into it (`out=`), the
        # same operations in the same order as `fit_convergence`, without a new 0.5 MB temporary per step
        buf = np.empty((min(len(idx_all), _MANY_CHUNK), grid, n))
        for c0 in range(0, len(idx_all), _MANY_CHUNK):
            idx = idx_all[c0:c0 + _MANY_CHUNK]
            K = np.array([ks[i] for i in idx], float)
            L = np.array([losses[i] for i in idx], float)
            ok = K.max(axis=1) - K.min(axis=1) > 0
            if not ok.all():
                K, L, idx = K[ok], L[ok], [i for i, o in zip(idx, ok.tolist(), strict=True) if o]
                if not idx:
                    continue
            top = L.min(axis=1) * 0.995
            b2s = steps[None, :] * (top / (grid - 1))[:, None]  # (np.linspace's grid per curve, as above)
            b2s[:, -1] = top
            col = b2s[:, :, None]
            a = buf[:len(idx)]
            y = np.divide(1.0, np.subtract(L[:, None, :], col, out=a), out=a)  # curves x grid x points
            km, ym = K.sum(axis=1) / n, y.sum(axis=2) / n
            dk = K - km[:, None]
            t = np.multiply(dk[:, None, :], np.subtract(y, ym[:, :, None], out=a), out=a)  # (y is not read again)
            b0 = np.maximum(t.sum(axis=2) / (dk * dk).sum(axis=1)[:, None], 0.0)
            b1 = np.maximum(ym - b0 * km[:, None], 1e-9)
            r = np.multiply(b0[:, :, None], K[:, None, :], out=a)  # r = 1 / (b0 * k + b1) + b2 - loss
            np.add(r, b1[:, :, None], out=r)
            np.divide(1.0, r, out=r)
            np.add(r, col, out=r)
            np.subtract(r, L[:, None, :], out=r)
            best = np.argmin(np.multiply(r, r, out=r).sum(axis=2), axis=1)
            rows = np.arange(len(idx))
            fb0, fb1, fb2 = b0[rows, best].tolist(), b1[rows, best].tolist(), b2s[rows, best].tolist()
            for j, i in enumerate(idx):
                if fb0[j] > 0:
                    out[i] = (fb0[j], fb1[j], fb2[j])
    return out


def steps_to_target(fit: tuple[float, float, float], target: float) -> float:
    """k at which the fitted curve reaches `target` (inf when it never does)."""
    b0, b1, b2 = fit
    if target <= b2:
        return math.inf
    return max((1.0 / (target - b2) - b1) / b0, 0.0)


class _OptimusJob:
    def __init__(self, job, desc: JobDescription, limits: JobLimits) -> None:
        self.job, self.limits = job, limits
        req = desc.requested
        self.cpu, self.mem = req.cpu_per_worker, req.memory_per_worker  # Optimus keeps the user's pod size
        self.model = OnlineThroughputModel(TR_TERMS, GENERIC_TR_PRIOR, min_points=3)
        self.refit_at = -1
        self.k: list[float] = []
        self.loss: list[float] = []
        self.target = job.loss[3] if job.loss else math.nan  # the user's stopping criterion
        self.max_w = int(max(1, min(limits.max_workers, limits.cpu // max(self.cpu, 1e-9))))
        # Optimus has no memory model: until a worker's memory was measured, the fewest workers are the user's;
        # then the fewest whose measured base + embedding shard (+20%) fits the pod (`learn_memory`)
        self.tables = list(desc.table_bytes)
        self.min_w = min(req.workers, self.max_w)
        self.memory_known = not self.tables
        self.fit_n = -1
        self.fit: tuple[float, float, float] | None = None
        self.alloc_of: PodPlan | None = None  # the plan `alloc` was built from
        self.alloc: Allocation | None = None
        self.coef_of: tuple = (None, None, None)  # (model, its terms, its coef) `coef` was read from
        self.coef: list[float] = []

    def learn_memory(self, workers: int, peak: float) -> None:
        if self.memory_known or not self.tables:
            return
        self.memory_known = True
        base = max(peak - embedding_shard_bytes(self.tables, workers), 0.0)
        desc = sorted(self.tables, reverse=True)  # (`_shard_of_sorted`: the tables sorted and checked once, not per w)
        finite = all(math.isfinite(b) for b in desc)
        w = 1
        while w < self.max_w and base + 1.2 * _shard_of_sorted(desc, w, finite) > 0.9 * self.mem:
            w += 1
        self.min_w = w


def _shard_of_sorted(desc: list[float], workers: int, finite: bool) -> float:
    """`embedding_shard_bytes(tables, workers)` of tables already sorted largest first (`finite`: all their sizes
    are): its heap placement, the same sums in the same order; otherwise `embedding_shard_bytes` itself."""
    if workers < 1 or not finite:
        return embedding_shard_bytes(desc, workers)
    if workers == 1:  # (the heap's one worker takes every table: the same sums, in the same order)
        load = 0.0
        for b in desc:
            load = load + b
        return load
    heap = [(0.0, i) for i in range(workers)]
    for b in desc:
        load, i = heap[0]
        heapq.heapreplace(heap, (load + b, i))
    return max(load for load, _ in heap)


def _tr_coef(st: _OptimusJob, mod: ThroughputModel) -> list[float]:
    """The model's (const, B/cpu, log2 w) coefficients (0 for a term it lacks), read again only when the job's model
    (or its terms / coef tuples) changed: Optimus refits a job every few samples, not every round."""
    key = st.coef_of
    if key[0] is not mod or key[1] is not mod.terms or key[2] is not mod.coef:
        st.coef_of = (mod, mod.terms, mod.coef)
        st.coef = [dict(zip(mod.terms, mod.coef, strict=True)).get(k, 0.0) for k in TR_TERMS]
    return st.coef


class OptimusAllocator:
    """Optimus's greedy: every job gets its minimum, then one worker at a time goes to the job whose estimated
    remaining time falls most per unit of dominant resource share, while the cluster has room."""

    @staticmethod
    def allocate(jobs: list[dict], cpu_total: float, mem_total: float) -> dict[int, int]:
        """jobs: dicts with id, min_w, max_w, cpu, mem, remaining (samples), thr (samples/s at w = index + 1:
        array of max_w values). Returns workers per job id (0: no room for its minimum)."""
        return OptimusAllocator.allocate_rows(
            [(j["id"], j["min_w"], j["max_w"], j["cpu"], j["mem"], j["remaining"], j["thr"]) for j in jobs],
            cpu_total, mem_total)

    @staticmethod
    def allocate_rows(jobs: list[tuple], cpu_total: float, mem_total: float) -> dict[int, int]:
        """`allocate` on tuples (id, min_w, max_w, cpu, mem, remaining, thr), in priority order: the same greedy,
        `gain`'s arithmetic inline on the same floats (the greedy pops ~200 workers a job at 100k jobs; Optimus's
        round builds these tuples directly, no dict per job)."""
        free_c, free_m = cpu_total, mem_total
        out: dict[int, int] = {}
        heap: list[tuple[float, int, int]] = []
        # per job (id, cpu, mem, max_w, thr, remaining, share), read by the greedy below
        rows: list[tuple] = []
        for i, (jid, min_w, max_w, c, m, rem, thr) in enumerate(jobs):  # (running first, then by arrival)
            share = max(c / cpu_total, m / mem_total)
            rows.append((jid, c, m, max_w, thr, rem, share))
            need_c, need_m = min_w * c, min_w * m
            if need_c > free_c + 1e-9 or need_m > free_m + 1e-3:
                out[jid] = 0
                continue
            free_c, free_m = free_c - need_c, free_m - need_m
            out[jid] = min_w
            if min_w >= max_w:  # `gain(job, min_w)`
                g = 0.0
            else:
                now, nxt = thr[min_w - 1], thr[min_w]
                g = rem * (1.0 / now - 1.0 / nxt) / share if now > 0 and nxt > 0 else 0.0
            heapq.heappush(heap, (-g, i, min_w))
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            neg, i, w = pop(heap)
            if -neg <= 0:
                break  # no job gains from another worker
            jid, c, m, max_w, thr, rem, share = rows[i]
            if c > free_c + 1e-9 or m > free_m + 1e-3:
                continue  # this job's worker does not fit; a smaller one may
            free_c, free_m = free_c - c, free_m - m
            w += 1
            out[jid] = w
            if w < max_w:  # gain(job, w): (w < max_w here)
                now, nxt = thr[w - 1], thr[w]
                push(heap, (-(rem * (1.0 / now - 1.0 / nxt) / share if now > 0 and nxt > 0 else 0.0), i, w))
        return out

    @staticmethod
    def gain(j: dict, w: int, cpu_total: float, mem_total: float) -> float:
        """Reduction of the remaining time from w to w+1 workers, per unit of the worker's dominant share."""
        if w >= j["max_w"]:
            return 0.0
        thr = j["thr"]
        now, nxt = thr[w - 1], thr[w]
        if not (now > 0 and nxt > 0):
            return 0.0
        share = max(j["cpu"] / cpu_total, j["mem"] / mem_total)
        return j["remaining"] * (1.0 / now - 1.0 / nxt) / share


class OptimusPolicySim(SimPolicy):
    name = "optimus"
    interval_s: float | None = 600.0  # Optimus re-plans every 10 minutes
    wants_loss = True
    rate_only = True
    refit_every = 3           # refit a job's throughput model after this many new samples (or a new size)
    min_change_s = 240.0      # ours: resize a running job only when its predicted remaining time moves by more
                              # (two checkpoint-stop-relaunch pauses); every 10 min otherwise costs 2 min of 10

    def __init__(self) -> None:
        self.jobs: dict[int, _OptimusJob] = {}
        self.finished_samples: list[float] = []
        self._typical: tuple[int, float] = (-1, 0.0)  # (finished jobs, median samples of the last 200)

    def initial_plan(self, job, desc, limits):
        st = _OptimusJob(job, desc, limits)
        self.jobs[job.job_id] = st
        return replace(desc.requested, workers=st.min_w), []

    def on_tick(self, job, obs):
        self.on_rate(job, obs.plan, obs.samples_per_s, max(obs.worker_memory) if obs.worker_memory else None)
        return []

    def on_rate(self, job, plan: PodPlan, samples_per_s: float, worker_memory: float | None) -> None:
        """`on_tick` on the two numbers of the report Optimus reads (the engine passes them without building the
        report, `SimPolicy.rate_only`): the measured samples/s and the largest worker memory (None: none)."""
        st = self.jobs.get(job.job_id)
        if st is not None and samples_per_s:
            alloc = st.alloc
            if st.alloc_of is not plan or alloc is None:  # (one Allocation per plan: its samples share it, frozen)
                st.alloc_of, st.alloc = plan, (alloc := plan.allocation())
            st.model.add(Sample(alloc, float(samples_per_s)), refit=False)
            if worker_memory is not None and not st.memory_known:  # (`learn_memory` does nothing once it is known)
                st.learn_memory(plan.workers, worker_memory)

    def on_loss(self, job, k: float, loss: float) -> None:
        st = self.jobs.get(job.job_id)
        if st is not None:
            st.k.append(k)
            st.loss.append(loss)

    def on_oom(self, job, obs):
        st = self.jobs.get(job.job_id)
        if st is not None:  # its shard did not fit: spread the tables over twice the workers from now on
            st.memory_known = True
            st.min_w = min(st.max_w, max(st.min_w * 2, obs.plan.workers * 2))
        return []

    def on_finish(self, job, plan, state):
        self.jobs.pop(job.job_id, None)
        self.finished_samples.append(job.total_samples)

    def remaining_samples(self, st: _OptimusJob, done: float) -> float:
        if st.fit_n != len(st.k):  # refit the curve only when the job logged new losses
            st.fit_n = len(st.k)
            st.fit = fit_convergence(np.array(st.k[-30:]), np.array(st.loss[-30:]))
        fit = st.fit
        if fit is not None and math.isfinite(st.target):
            k_end = steps_to_target(fit, st.target) * 1e6
            if math.isfinite(k_end):
                return max(k_end - done, 0.01 * max(done, 1.0))
        # before the curve can be fitted: as long again as it ran, or what finished jobs took
        n = len(self.finished_samples)
        if self._typical[0] != n:  # (the median of the last 200 changes only when a job finishes)
            self._typical = (n, statistics.median(self.finished_samples[-200:]) if n else 1e8)
        typical = self._typical[1]
        return max(done, typical - done, 0.1 * typical)

    def allocate(self, runs, cluster, t: float) -> dict[int, int]:
        runs = sorted(runs, key=lambda r: (r.status != "running", r.job.arrival_s, r.job.job_id))
        due: list[OnlineThroughputModel] = []
        kept = []
        for r in runs:
            st = self.jobs.get(r.job.job_id)
            if st is None:
                continue
            m = st.model
            if m.samples and (len(m.samples) - st.refit_at >= self.refit_every or st.refit_at < 0):
                due.append(m)
                st.refit_at = len(m.samples)  # (a refit does not change the samples)
            kept.append((r, st))
        # the due refits together (`refit_many`: each model as its own `refit` leaves it; a ModelFitError keeps the
        # previous model, as before)
        if due:
            refit_many(due)
        rows = [(r, st, st.model.model or GENERIC_TR_PRIOR) for r, st in kept]
        if not rows:
            return {}
        # the convergence curves of the jobs that logged new losses, all in one batch (`remaining_samples` below
        # then finds them fitted): the values `fit_convergence` gives one job at a time
        stale = [st for _, st, _ in rows if st.fit_n != len(st.k)]
        if stale:
            fits = fit_convergence_many([st.k[-30:] for st in stale], [st.loss[-30:] for st in stale])
            for st, f in zip(stale, fits, strict=True):
                st.fit_n, st.fit = len(st.k), f
        # every job's throughput at 1..max_w workers in one vectorised evaluation of the (const, B/cpu, log2 w) form
        wmax = max(st.max_w for _, st, _ in rows)
        ws = np.arange(1, wmax + 1, dtype=float)
        coef = np.array([_tr_coef(st, mod) for _, st, mod in rows])
        b = np.array([r.plan.batch_size for r, _, _ in rows], float)
        c = np.array([st.cpu for _, st, _ in rows], float)
        step = coef[:, :1] + coef[:, 1:2] * (b / c)[:, None] + coef[:, 2:3] * np.log2(ws)[None, :]
        # (as python floats: the greedy's arithmetic on them is numpy's float64 arithmetic, without its scalar
        # overhead)
        thr = (ws[None, :] * b[:, None] / np.maximum(step, 1e-12)).tolist()
        remaining = self.remaining_samples
        jobs = [(r.job.job_id, st.min_w, st.max_w, st.cpu, st.mem, remaining(st, r.done), th)
                for (r, st, _), th in zip(rows, thr, strict=True)]
        out = OptimusAllocator.allocate_rows(jobs, cluster.capacity_cpu, cluster.capacity_memory)
        min_change = self.min_change_s
        for (r, st, _), (jid, _, max_w, _, _, rem, th) in zip(rows, jobs, strict=True):
            w_new, w_old = out[jid], r.plan.workers
            if r.status != "running" or w_new == w_old or w_new < 1 or w_old > max_w or w_old < st.min_w:
                continue
            t_old, t_new = rem / th[w_old - 1], rem / th[w_new - 1]
            if abs(t_old - t_new) < min_change:
                out[jid] = w_old
        return out


# The optimizer as the simulator configures it: a plan change costs a relaunch of SimParams.resize_pods_s (120 s)
SIM_CONFIG = OptimizerConfig(relaunch_s=120.0)


def make_policy(name: str, config: OptimizerConfig = SIM_CONFIG) -> SimPolicy:
    if name == "static":
        return StaticPolicySim()
    if name == "optimus":
        return OptimusPolicySim()
    if name == "optimus-stage2":
        return OptimusStage2Sim(config)
    if name == "dlrover":
        return DLRoverPolicySim(config)
    if name == "dlrover-nopayoff":  # DLRover's scaling rule alone, every predicted gain taken
        return DLRoverPolicySim(replace(config, relaunch_s=0.0))
    if name.startswith("dlrover-"):
        flags = set(name.split("-")[1:])
        unknown = flags - {"nowarm", "nostage3", "nofailover"}
        if unknown:
            raise ValueError(f"unknown dlrover variant flags {sorted(unknown)}")
        return DLRoverPolicySim(config, warm="nowarm" not in flags, instability="nostage3" not in flags,
                                failover="nofailover" not in flags)
    raise ValueError(f"unknown policy {name!r}; "
                     "choose static, optimus, optimus-stage2, dlrover (or dlrover-nowarm/-nostage3/-nofailover)")
