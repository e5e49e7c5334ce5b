"""Event-driven cluster simulation: jobs arrive, pend, run, get profiled, change plans, fail and finish.

Between events every running job progresses at its true throughput (truth.py), so the clock jumps from
event to event. Events: arrival, profiler tick (every `tick_s`), resume after a (re)launch overhead,
finish, server OOM (when the growing embeddings pass the memory of the most loaded server), worker OOM,
node eviction, pending checks, and for a cluster-wide policy (Optimus) a re-allocation every
`policy.interval_s`. Randomness comes from the trace, a hash of (seed, job, tick) and generators seeded
by (seed, node), so a run is deterministic under its seed and the policies face the same faults.
Per event only the job concerned is touched (indexes of waiting jobs by cores, of jobs by node, a
counter of ended jobs): docs/dlrover_rm.md#engine-and-scale.
"""
from __future__ import annotations

import bisect
import gc
import hashlib
import heapq
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from recforge.elastic.optimizer import Event, JobDescription, JobLimits, Observation, PodPlan
from recforge.elastic.simulate import truth
from recforge.elastic.simulate.cluster import Cluster, ClusterSpec
from recforge.elastic.simulate.policies import SimPolicy
from recforge.elastic.simulate.trace import TraceJob

GiB = float(1 << 30)
ARRIVE, TICK, RESUME, FINISH, OOM, EVICT, PENDING_CHECK, REALLOC = range(8)
_TWO_U32 = struct.Struct("<II").unpack  # `_noise`: a digest's two 4-byte halves as little-endian integers
_TWO_PI = 2 * math.pi
_NO_TOTALS, _NO_OOM_AT = (None, 0.0, 0.0), (None, 0.0)  # `JobRun.totals` / `oom_at` before a plan is read
GC_GEN0 = 100_000  # `Simulation.run`'s garbage-collector threshold (Python's default: 700 new objects)


@dataclass(frozen=True)
class SimParams:
    tick_s: float = 300.0             # profiler report interval
    startup_s: float = 120.0          # pod start and rendezvous after a (re)launch
    restart_s: float = 180.0          # a whole-job restart from its checkpoint
    resize_workers_s: float = 30.0    # adding / removing workers (async PS: others keep training)
    resize_pods_s: float = 120.0      # relaunching pods with other CPU / memory (migration)
    failover_s: float = 60.0          # an evicted pod relaunched alone (elastic failover)
    checkpoint_s: float = 1800.0
    max_restarts: int = 3             # whole-job restarts before the job fails (TFJob backoffLimit)
    abandon_pending_s: float = 6 * 3600.0  # users kill a job pending this long
    noise: float = 0.05               # relative noise of a throughput measurement
    horizon_s: float = 60 * 86400.0
    limit_factor: float = 1.5         # a job's resource limits: this x its request (at least one node)
    max_failed_placements: int = 64   # a scheduling pass stops after this many jobs that did not fit (the rest
                                      # wait for the next event; on a big fragmented cluster every finish would
                                      # otherwise retry thousands of waiting jobs)
    eviction_per_node_h: float = 0.0  # node evictions per node-hour (the trace's value is passed in)


@dataclass
class JobRun:
    job: TraceJob
    plan: PodPlan
    status: str = "waiting"
    pods: list = field(default_factory=list)
    where: list | None = None
    done: float = 0.0
    ckpt: float = 0.0
    ckpt_t: float = 0.0
    t_last: float = 0.0
    rate: float = 0.0
    used_cpu: float = 0.0
    used_mem: float = 0.0
    resume_at: float = 0.0
    version: int = 0
    restarts: int = 0
    straggling: bool = False
    straggler_fixed: bool = False
    pending_since: float | None = None
    pend_key: tuple | None = None  # (cores requested, job id) while in the index of waiting jobs
    start: float | None = None
    finish: float | None = None
    ticks: int = 0
    peak_server_mem: float = 0.0
    events: list = field(default_factory=list)
    plan_changes: int = 0
    fail_reason: str = ""
    rate_at: tuple = (None, 0.0, 0.0, 0.0)  # (plan, slowdown, rate, cores busy): a TorchRec job's rate moves with those
    noise_at: tuple = (-1, 1.0)  # (tick, noise) of the last measurement: the loss and the report share one hash
    totals: tuple = _NO_TOTALS  # (plan, its cpu_total, its memory_total), `_advance`'s
    oom_at: tuple = _NO_OOM_AT  # (plan, the samples at which a TorchRec worker's shard outgrows it), `_set_rate`'s
    sched: tuple | None = None  # `_sched_numbers(plan)` of the plan a scheduling pass last read (None: none yet)


def _sched_numbers(p: PodPlan) -> tuple:
    """What a scheduling pass reads of a plan: (the plan, its cores in all, a worker's cores and memory, workers,
    servers, the pod shape it groups failed placements by)."""
    return (p, p.cpu_total, p.cpu_per_worker, p.memory_per_worker, p.workers, p.servers,
            (p.cpu_per_worker, p.memory_per_worker, p.servers, p.cpu_per_server, p.memory_per_server))


class Simulation:
    def __init__(self, trace: list[TraceJob], policy: SimPolicy, cluster: ClusterSpec = ClusterSpec(),
                 params: SimParams = SimParams(), seed: int = 0, keep_events: bool = False) -> None:
        self.trace, self.policy, self.params, self.seed = trace, policy, params, seed
        self.cluster = Cluster(cluster)
        self.keep_events = keep_events
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.runs: dict[int, JobRun] = {}
        self.pending: list[tuple[float, int]] = []  # waiting jobs by (cores requested, job id): bisect finds what fits
        self.acc = {"alloc_cpu_s": 0.0, "used_cpu_s": 0.0, "alloc_mem_s": 0.0, "used_mem_s": 0.0}
        self.decisions: dict[str, int] = {}
        self._by_id = {j.job_id: j for j in trace}
        self.on_node: dict[int, set[int]] = {}  # node -> jobs with a pod on it (evictions touch only those)
        self.n_ended = 0                          # jobs done or failed (the run ends when all have)
        self.live: dict[int, None] = {}           # jobs arrived and not ended, in arrival order
        self.events = 0
        self.every_event = False  # True: `_set_rate` pushes every event the reference did, stale ones included
        self.full_reports = False  # True: a `rate_only` policy gets the full Observation (`on_tick`) as before
        self.gc_gen0: int | None = GC_GEN0  # the collector's first threshold during `run` (None: left as it is)

    # ---- event queue ----------------------------------------------------------------------
    def push(self, t: float, kind: int, key: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, key, version))

    def run(self) -> dict[str, Any]:
        """Run to the end (every job ended, or the horizon): the result (`_result`).

        The cyclic garbage collector's first threshold is raised to `gc_gen0` for the run and restored after it: the
        run allocates millions of small objects (events, samples, tuples), most kept, so with Python's default
        (700) the collector walked the whole growing heap again and again: 21% of the CPU of a 100k Optimus run
        (49 full collections of up to 1.1 s in its first 150 s), ~10% at 10k. The simulation makes no reference
        cycles that matter (a 10k run's peak RSS is the same with the collector off), and nothing in it depends on
        when objects are freed, so the results are the same with either setting (tested)."""
        gen0 = self.gc_gen0
        old = gc.get_threshold()
        if gen0 is not None and gen0 > old[0] > 0:  # (0: the collector is off; never lower a raised threshold)
            gc.set_threshold(gen0, *old[1:])
        try:
            return self._run()
        finally:
            if gc.get_threshold() != old:
                gc.set_threshold(*old)

    def _run(self) -> dict[str, Any]:
        # arrivals wait in a sorted list, not in the heap: with the sequence numbers they would have had in it
        # (pushed first, in trace order) the merge below pops every event in the same (time, seq) order, while the heap
        # holds only the live jobs' events (at 100,000 jobs the arrivals made it several times larger)
        base = self.seq
        arrivals = sorted((j.arrival_s, base + i + 1, j.job_id) for i, j in enumerate(self.trace))
        self.seq += len(arrivals)
        self._schedule_evictions()
        handlers = {ARRIVE: self._arrive, TICK: self._tick, RESUME: self._resume, FINISH: self._finish,
                    OOM: self._oom, EVICT: self._evict, PENDING_CHECK: self._pending_check, REALLOC: self._realloc}
        interval = self.policy.interval_s
        if interval:
            self.push(interval, REALLOC, -1)
        n = len(self.trace)
        heap, pop = self.heap, heapq.heappop
        ai, na = 0, len(arrivals)
        nxt = arrivals[0] if na else None
        while heap or nxt is not None:
            if nxt is not None and (not heap or nxt[0] < heap[0][0] or (nxt[0] == heap[0][0] and nxt[1] < heap[0][1])):
                t, _, key = nxt
                kind, version = ARRIVE, 0
                ai += 1
                nxt = arrivals[ai] if ai < na else None
            else:
                t, _, kind, key, version = pop(heap)
            if t > self.params.horizon_s:
                break
            if kind not in (ARRIVE, EVICT, REALLOC):
                r = self.runs.get(key)
                if r is None or r.version != version or r.status in ("done", "failed"):
                    continue
            self.now = t
            self.events += 1
            handlers[kind](key, t)
            if self.n_ended == n:
                break
        for r in self.runs.values():
            if r.status in ("running", "pending"):
                self._advance(r, self.now)
                r.status, r.fail_reason = "failed", "horizon"
        return self._result()

    def _end(self, r: JobRun, status: str, t: float, why: str = "") -> None:
        r.status, r.fail_reason, r.finish = status, why, t
        r.totals, r.oom_at = _NO_TOTALS, _NO_OOM_AT  # (caches of a running job: not kept for every ended one)
        self.n_ended += 1
        self.live.pop(r.job.job_id, None)

    def _index(self, r: JobRun) -> None:
        for n in set(r.where or ()):
            self.on_node.setdefault(int(n), set()).add(r.job.job_id)

    def _unindex(self, r: JobRun) -> None:
        for n in set(r.where or ()):
            self.on_node.get(int(n), set()).discard(r.job.job_id)

    # ---- bookkeeping ----------------------------------------------------------------------
    def _advance(self, r: JobRun, t: float) -> None:
        dt = t - r.t_last
        if dt > 0 and r.status == "running":
            r.done = min(r.job.total_samples, r.done + r.rate * dt)
            p, tot = r.plan, r.totals
            if tot[0] is not p:  # (the plan's cores and memory in all, read once per plan: Optimus advances every
                tot = r.totals = (p, p.cpu_total, p.memory_total)  # running job every round)
            a = self.acc
            a["alloc_cpu_s"] += tot[1] * dt
            a["used_cpu_s"] += r.used_cpu * dt
            a["alloc_mem_s"] += tot[2] * dt
            a["used_mem_s"] += r.used_mem * dt
        r.t_last = t

    def _pods(self, plan: PodPlan) -> list[tuple[float, float]]:
        return ([(plan.cpu_per_worker, plan.memory_per_worker)] * plan.workers
                + [(plan.cpu_per_server, plan.memory_per_server)] * plan.servers)

    def _truth(self, r: JobRun, plan: PodPlan | None = None) -> tuple[float, float, float, float]:
        """(samples/s, cores busy, memory in use, memory of the most loaded server / worker)."""
        p, j = plan or r.plan, r.job
        if j.shape == "torchrec":
            sl = j.straggler[1] if r.straggling and j.straggler else 1.0
            c = r.rate_at
            if c[0] is p and c[1] == sl:
                rate, cpu = c[2], c[3]
            else:
                rate = truth.tr_throughput(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, sl)
                cpu = truth.tr_cpu_used(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, sl)
                r.rate_at = (p, sl, rate, cpu)
            need = truth.tr_worker_memory(j.worker_mem, j.emb_bytes, p.workers, j.emb_growth_per_sample * r.done)
            return rate, cpu, min(need, p.memory_per_worker) * p.workers, need
        slow = j.straggler[1] if r.straggling and j.straggler else None
        rate = truth.throughput(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, p.servers, p.cpu_per_server,
                                j.hot_server, slow)
        cw, cs = truth.cpu_used(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, p.servers, p.cpu_per_server,
                                j.hot_server)
        smem = truth.server_memory_need(j.emb_bytes, r.done, j.emb_growth_per_sample, p.servers, 1.0)
        hot_mem = truth.server_memory_need(j.emb_bytes, r.done, j.emb_growth_per_sample, p.servers, j.hot_server)
        used_mem = (min(j.worker_mem, p.memory_per_worker) * p.workers + smem * (p.servers - 1)
                    + min(hot_mem, p.memory_per_server))
        return rate, cw + cs, used_mem, hot_mem

    def _set_rate(self, r: JobRun, t: float) -> None:
        """Recompute the job's rate and (re)schedule its finish / OOM events."""
        r.version += 1
        rate, cpu, mem, need = self._truth(r)
        if t < r.resume_at:
            r.rate, r.used_cpu, r.used_mem = 0.0, 0.1 * r.plan.cpu_total, 0.3 * mem
            self.push(r.resume_at, RESUME, r.job.job_id, r.version)
            return
        r.rate, r.used_cpu, r.used_mem = rate, cpu, mem
        j, p = r.job, r.plan
        # (`_worker_oom`: for a TorchRec job its memory need is `_truth`'s last value, the same formula on the same
        # numbers)
        if (need > p.memory_per_worker) if j.shape == "torchrec" else (j.worker_mem > p.memory_per_worker):
            self.push(t + 60.0, OOM, j.job_id, r.version)  # dies as soon as it loads its first batches
            return
        left = j.total_samples - r.done
        t_finish = t + left / rate if rate > 0 else math.inf
        if j.shape == "torchrec":  # the most loaded worker's shard grows until it passes the pod's memory
            o = r.oom_at
            if o[0] is p:  # (a function of the job and the plan only: computed once per plan)
                oom_at = o[1]
            else:
                g = j.emb_growth_per_sample * truth.SHARD_SKEW / p.workers
                room = p.memory_per_worker - truth.tr_worker_memory(j.worker_mem, j.emb_bytes, p.workers)
                oom_at = math.inf if g <= 0 else room / g
                r.oom_at = (p, oom_at)
        else:
            oom_at = truth.samples_until_server_oom(j.emb_bytes, j.emb_growth_per_sample, p.servers, j.hot_server,
                                                    p.memory_per_server)
        t_oom = t + max(oom_at - r.done, 0.0) / rate if oom_at < j.total_samples else None
        next_tick = t + self.params.tick_s
        if self.every_event:  # the reference: all three (the later ones are skipped as stale when they pop)
            self.push(t_finish, FINISH, j.job_id, r.version)
            if t_oom is not None:
                self.push(t_oom, OOM, j.job_id, r.version)
            self.push(next_tick, TICK, j.job_id, r.version)
            return
        # only the first of them (in (time, push order) order) can run: each of the three ends the job or bumps its
        # version, which makes the others stale. The rest were most of the heap (a finish pushed per tick, popped
        # and skipped hours later); leaving them out keeps every other event's relative order (sequence numbers
        # only break ties, and they stay in push order)
        first, kind = t_finish, FINISH
        if t_oom is not None and t_oom < first:
            first, kind = t_oom, OOM
        if next_tick < first:
            first, kind = next_tick, TICK
        self.push(first, kind, j.job_id, r.version)

    def _worker_oom(self, r: JobRun) -> bool:
        j, p = r.job, r.plan
        if j.shape == "torchrec":
            need = truth.tr_worker_memory(j.worker_mem, j.emb_bytes, p.workers, j.emb_growth_per_sample * r.done)
            return need > p.memory_per_worker
        return j.worker_mem > p.memory_per_worker

    def _noise(self, r: JobRun) -> float:
        """exp(N(0, noise)), a function of (seed, job, tick) only: every policy sees the same noise (Box-Muller
        on a hash: a numpy generator per observation cost more than the rest of the event)."""
        if r.noise_at[0] == r.ticks:
            return r.noise_at[1]
        h = hashlib.blake2b(f"{self.seed},{r.job.job_id},{r.ticks}".encode(), digest_size=8).digest()
        lo, hi = _TWO_U32(h)  # (the two little-endian halves `int.from_bytes` reads)
        u1 = (lo + 0.5) / 2**32
        u2 = hi / 2**32
        v = math.exp(self.params.noise * math.sqrt(-2.0 * math.log(u1)) * math.cos(_TWO_PI * u2))
        r.noise_at = (r.ticks, v)
        return v

    def _observe(self, r: JobRun, t: float, oom_w=(), oom_s=()) -> Observation:
        j, p = r.job, r.plan
        if j.shape == "torchrec":
            return self._observe_tr(r, t, oom_w)
        rate, cpu, _, hot_mem = self._truth(r)
        step_t = truth.step_time(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, p.servers,
                                 p.cpu_per_server, j.hot_server)
        steps = [step_t] * p.workers
        if r.straggling and j.straggler:
            steps[0] = step_t * j.straggler[1]
        cw, cs = truth.cpu_used(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, p.servers, p.cpu_per_server,
                                j.hot_server)
        wu = min(1.0, cw / (p.workers * p.cpu_per_worker))
        u = cs / max(p.servers * p.cpu_per_server, 1e-9)
        utils = [[min(1.0, u * j.hot_server)] * 3] + [[min(1.0, u)] * 3] * (p.servers - 1)
        loads = [j.hot_server] + [1.0] * (p.servers - 1)
        smem = truth.server_memory_need(j.emb_bytes, r.done, j.emb_growth_per_sample, p.servers, 1.0)
        per_step = p.batch_size  # Observation.step counts the whole job's batches
        return Observation(time_s=t, plan=p, samples_per_s=rate * self._noise(r),
                           step=int(r.done / per_step), worker_step_s=steps, worker_cpu_util=[wu] * min(p.workers, 4),
                           worker_memory=[min(j.worker_mem, p.memory_per_worker)] * min(p.workers, 4),
                           server_memory=[hot_mem] + [smem] * min(p.servers - 1, 3), server_cpu_util=utils,
                           shard_load=loads, oom_workers=oom_w, oom_servers=oom_s,
                           total_steps=j.total_samples / per_step)

    def _observe_tr(self, r: JobRun, t: float, oom_w=()) -> Observation:
        j, p = r.job, r.plan
        rate, cpu, _, need = self._truth(r)
        step_t = truth.tr_step_time(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker)
        n = min(p.workers, 8)  # a profiler reports a few workers; the straggler (when any) is worker 0
        steps = [step_t] * n
        if r.straggling and j.straggler:  # its own compute is slow; the others wait in the collectives
            steps[0] = truth.tr_step_time(j.coef, j.gamma, p.batch_size, p.workers, p.cpu_per_worker, j.straggler[1])
        util = min(1.0, cpu / (p.workers * p.cpu_per_worker))
        return Observation(time_s=t, plan=p, samples_per_s=rate * self._noise(r), step=int(r.done / p.batch_size),
                           worker_step_s=steps, worker_cpu_util=[util] * min(n, 4),
                           worker_memory=[min(need, p.memory_per_worker)] * min(n, 4), oom_workers=oom_w,
                           total_steps=j.total_samples / p.batch_size)

    def _report_rate(self, r: JobRun, rate: float, need: float) -> None:
        """A `rate_only` policy's report: the samples/s and largest worker memory `_observe` would report (the same
        values), without building the Observation. `rate`, `need`: `_truth(r)`'s first and last values."""
        j, p = r.job, r.plan
        mem = min(need, p.memory_per_worker) if j.shape == "torchrec" else min(j.worker_mem, p.memory_per_worker)
        self.policy.on_rate(j, p, rate * self._noise(r), mem)

    def _record(self, r: JobRun, events: list[Event]) -> None:
        for e in events:
            self.decisions[f"{e.stage}.{e.action}"] = self.decisions.get(f"{e.stage}.{e.action}", 0) + 1
            if self.keep_events:
                r.events.append(e)

    # ---- scheduling -----------------------------------------------------------------------
    def _try_start(self, r: JobRun, t: float) -> bool:
        pods = self._pods(r.plan)
        where = self.cluster.place(pods)
        if where is None:
            return False
        r.pods, r.where = pods, where
        self._index(r)
        r.status = "running"
        r.start = t if r.start is None else r.start
        r.pending_since = None
        r.t_last = t
        r.resume_at = t + self.params.startup_s
        r.ckpt_t = t
        self._set_rate(r, t)
        return True

    def _pend(self, r: JobRun) -> None:
        self._unpend(r)
        r.pend_key = (r.plan.cpu_total, r.job.job_id)
        bisect.insort(self.pending, r.pend_key)

    def _unpend(self, r: JobRun) -> None:
        if r.pend_key is not None:
            i = bisect.bisect_left(self.pending, r.pend_key)
            if i < len(self.pending) and self.pending[i] == r.pend_key:
                self.pending.pop(i)
            r.pend_key = None

    def _schedule_pending(self, t: float) -> None:
        """Start what now fits, in arrival order (a job that does not fit does not block smaller ones). Only jobs
        asking for at most the free cores are tried: the index by cores finds them without a scan of all waiting."""
        cl = self.cluster
        n = bisect.bisect_right(self.pending, (cl.free_cpu_total + 1e-6, math.inf))
        if not n:
            return
        # the roomiest node's free CPU / memory, and the free cores, with the margins the checks below add: they
        # change only when a job starts (a placement that fails takes nothing)
        big_c, big_m = float(cl.free_cpu.max()) + 1e-9, float(cl.free_mem.max()) + 1e-3
        free_c, free_m = cl.free_cpu_total + 1e-6, cl.free_mem_total + 1.0
        failed: dict[tuple, float] = {}  # pod shape -> fewest pods of it that did not fit: more will not either
        misses, most = 0, self.params.max_failed_placements
        runs = self.runs
        # `Cluster.refuses(c, m, n)` inline: c * n and m * n against the free totals, n against the bucket bound of the
        # pod shape (`Cluster.over_limit`: `n > fit_limit(c, m)`, each bound kept per pod size and cluster version)
        over_limit = cl.over_limit
        for jid in sorted([k[1] for k in self.pending[:n]]):
            r = runs[jid]
            if r.status != "pending":
                self._unpend(r)
                continue
            # (the plan's numbers the pass reads, kept per plan: a waiting job is tried in pass after pass)
            s = r.sched
            if s is None or s[0] is not r.plan:
                s = r.sched = _sched_numbers(r.plan)
            _, cpu_total, c, m, workers, servers, shape = s
            if cpu_total > free_c or c > big_c or m > big_m or workers >= failed.get(shape, math.inf):
                continue
            if not servers:
                refused = c * workers > free_c or m * workers > free_m or over_limit(c, m, workers)
            else:
                refused = False
            if refused:
                pass  # `place` would refuse its workers (identical pods) at once: a miss, without building them
            elif self._try_start(r, t):
                self._unpend(r)
                big_c, big_m = float(cl.free_cpu.max()) + 1e-9, float(cl.free_mem.max()) + 1e-3
                free_c, free_m = cl.free_cpu_total + 1e-6, cl.free_mem_total + 1.0
                continue
            failed[shape] = workers  # (fewer than any that failed before: the check above let it through)
            misses += 1
            if misses >= most:
                break

    def _release(self, r: JobRun) -> None:
        if r.where is not None:
            self._unindex(r)
            self.cluster.release(r.pods, r.where)
        r.pods, r.where = [], None

    def _arrive(self, jid: int, t: float) -> None:
        j = self._by_id[jid]
        req = PodPlan(**j.request)
        spec = self.cluster.spec
        limits = JobLimits(cpu=max(req.cpu_total * self.params.limit_factor, spec.cpu_per_node),
                           memory=max(req.memory_total * self.params.limit_factor, spec.memory_per_node),
                           max_cpu_per_worker=spec.cpu_per_node, max_cpu_per_server=spec.cpu_per_node,
                           max_memory_per_pod=spec.memory_per_node * 0.95)
        desc = JobDescription(dataset=j.scenario, model_family=j.family, requested=req, total_samples=j.total_samples,
                              parameter_server=j.shape != "torchrec", table_bytes=j.tables)
        plan, events = self.policy.initial_plan(j, desc, limits)
        r = JobRun(job=j, plan=plan, status="pending", pending_since=t, t_last=t)
        self.runs[jid] = r
        self.live[jid] = None
        self._record(r, events)
        if not self._try_start(r, t):
            self._pend(r)
            self.push(t + 900.0, PENDING_CHECK, jid, r.version)
            self.push(t + self.params.abandon_pending_s, PENDING_CHECK, jid, r.version)

    def _pending_check(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        if r.status != "pending":
            return
        waited = t - (r.pending_since or t)
        if waited >= self.params.abandon_pending_s - 1e-6:
            self._end(r, "failed", t, "pending too long (user gave up)")
            self._unpend(r)
            return
        events = self.policy.on_pending(r.job, Observation(time_s=t, plan=r.plan, pending_s=waited))
        self._record(r, events)
        new_plan = next((e.plan_after for e in events if e.changes_plan and e.plan_after is not None), None)
        if new_plan is not None:
            r.plan = PodPlan.from_dict(new_plan)
            r.plan_changes += 1
            if self._try_start(r, t):
                self._unpend(r)
                return
            self._pend(r)  # waits with the new plan
        self.push(t + 900.0, PENDING_CHECK, jid, r.version)

    # ---- cluster-wide allocation (Optimus) -----------------------------------------------------
    def _realloc(self, _key: int, t: float) -> None:
        """The policy re-divides the cluster among the jobs that arrived and have not ended: a worker count per job
        (0: wait). Shrinks first (they free room), then growths, then starts; a move that does not fit is skipped."""
        active = [self.runs[jid] for jid in self.live]
        if active:
            for r in active:
                if r.status == "running":
                    self._advance(r, t)
            target = self.policy.allocate(active, self.cluster, t)
            order = sorted(active, key=lambda r: (target.get(r.job.job_id, r.plan.workers) - r.plan.workers,
                                                  r.job.job_id))
            for r in order:
                p = r.plan
                w = target.get(r.job.job_id, p.workers)
                if w == p.workers or w < 1:
                    continue
                # (`replace(p, workers=int(w))`: the same fields through the class's __init__, without replace's
                # per-field reflection)
                new = type(p)(workers=int(w), cpu_per_worker=p.cpu_per_worker, memory_per_worker=p.memory_per_worker,
                              batch_size=p.batch_size, servers=p.servers, cpu_per_server=p.cpu_per_server,
                              memory_per_server=p.memory_per_server)
                if r.status == "running":
                    if self._resize(r, new, t):
                        r.plan_changes += 1
                        self._set_rate(r, t)
                elif r.status == "pending":
                    r.plan = new
                    r.plan_changes += 1
                    self._pend(r)
            self._schedule_pending(t)
        if self.n_ended < len(self.trace) and self.policy.interval_s:
            self.push(t + self.policy.interval_s, REALLOC, -1)

    # ---- running jobs ---------------------------------------------------------------------
    def _resume(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        self._advance(r, t)
        self._set_rate(r, t)

    def _tick(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        self._advance(r, t)
        r.ticks += 1
        j = r.job
        if t - r.ckpt_t >= self.params.checkpoint_s:
            r.ckpt, r.ckpt_t = r.done, t
        if j.straggler and not r.straggling and not r.straggler_fixed and r.done >= j.straggler[0] * j.total_samples:
            r.straggling = True
        now = self._truth(r)
        r.peak_server_mem = max(r.peak_server_mem, now[3])
        if j.loss and self.policy.wants_loss:  # the training loss the job logs (1% noise)
            b0, b1, b2, _ = j.loss
            k = r.done / 1e6
            self.policy.on_loss(j, k, (1.0 / (b0 * k + b1) + b2) * (1 + 0.01 * (self._noise(r) - 1)))
        if self.policy.observes and self.policy.rate_only and not self.full_reports:
            self._report_rate(r, now[0], now[3])
        elif self.policy.observes:  # (building the report is a third of a tick; static never reads it)
            events = self.policy.on_tick(j, self._observe(r, t))
            self._record(r, events)
            self._apply(r, events, t)
        self._set_rate(r, t)

    def _apply(self, r: JobRun, events: list[Event], t: float) -> None:
        for e in events:
            if e.action == "replace_straggler" and r.straggling:
                r.straggling, r.straggler_fixed = False, True
            if not e.changes_plan or e.plan_after is None:  # (a plan change always has plan_after)
                continue
            new = PodPlan.from_dict(e.plan_after)
            if self._resize(r, new, t):
                r.plan_changes += 1
            break  # one plan change per report

    def _resize(self, r: JobRun, new: PodPlan, t: float) -> bool:
        old_pods, old_where = r.pods, r.where
        self._release(r)
        pods = self._pods(new)
        where = self.cluster.place(pods)
        if where is None:  # no room: keep the old pods exactly where they were
            assert old_where is not None  # only placed (running) jobs are resized
            self.cluster.take(old_pods, old_where)
            r.pods, r.where = old_pods, old_where
            self._index(r)
            return False
        # an async PS job adds / removes workers while the others train; a synchronous TorchRec job reshards its
        # embeddings: checkpoint, stop, relaunch at the new plan
        only_workers = r.job.shape != "torchrec" and replace(new, workers=r.plan.workers) == r.plan
        r.pods, r.where, r.plan = pods, where, new
        self._index(r)
        r.resume_at = t + (self.params.resize_workers_s if only_workers else self.params.resize_pods_s)
        self._schedule_pending(t)  # a shrink may make room
        return True

    def _fail(self, r: JobRun, t: float, why: str, elastic: bool) -> None:
        """A pod died: elastic failover relaunches it alone; otherwise the job restarts from its checkpoint."""
        if elastic:
            r.resume_at = t + self.params.failover_s
            return
        r.restarts += 1
        r.done = r.ckpt
        if r.restarts > self.params.max_restarts:
            self._release(r)
            self._end(r, "failed", t, why)
            self._schedule_pending(t)
            return
        r.resume_at = t + self.params.restart_s

    def _oom(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        self._advance(r, t)
        j = r.job
        worker = self._worker_oom(r)
        obs = self._observe(r, t, oom_w=[0] if worker else [], oom_s=[] if worker else [0])
        events = self.policy.on_oom(j, obs)
        self._record(r, events)
        r.restarts += 1  # an OOM kills the pod's state: back to the checkpoint, whatever the policy
        r.done = r.ckpt
        if r.restarts > self.params.max_restarts:
            self._release(r)
            self._end(r, "failed", t, "out of memory")
            self._schedule_pending(t)
            return
        r.resume_at = t + self.params.restart_s
        new_plan = next((e.plan_after for e in events if e.changes_plan and e.plan_after is not None), None)
        if new_plan is not None:
            self._resize(r, PodPlan.from_dict(new_plan), t)
            r.resume_at = max(r.resume_at, t + self.params.restart_s)
        self._set_rate(r, t)

    def _finish(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        self._advance(r, t)
        r.done = r.job.total_samples
        self._end(r, "done", t)
        self._release(r)
        # the peak RSS a worker reports: a TorchRec worker's includes its embedding shard at the end (not only
        # the base; a history of bases made every warm start too small for its shard)
        peak_w = self._truth(r)[3] if r.job.shape == "torchrec" else r.job.worker_mem
        self.policy.on_finish(r.job, r.plan, {"time": t, "rate": r.rate, "peak_worker_mem": peak_w,
                                              "peak_server_mem": r.peak_server_mem or self._truth(r)[3]})
        self._schedule_pending(t)

    def _schedule_evictions(self) -> None:
        rate = self.params.eviction_per_node_h
        if rate <= 0:
            return
        horizon = max(j.arrival_s for j in self.trace) + 3 * 86400 if self.trace else 0
        for n in range(self.cluster.spec.nodes):
            rng = np.random.default_rng((self.seed, 1_000_003, n))
            t = 0.0
            while True:
                t += rng.exponential(3600.0 / rate)
                if t > horizon:
                    break
                self.push(t, EVICT, n)

    def _evict(self, node: int, t: float) -> None:
        for jid in sorted(self.on_node.get(node, ())):
            r = self.runs[jid]
            if r.status == "running" and r.where is not None:
                self._advance(r, t)
                self._fail(r, t, "evicted too often", self.policy.elastic_failover)
                if r.status == "running":
                    self._set_rate(r, t)

    # ---- results --------------------------------------------------------------------------
    def _result(self) -> dict[str, Any]:
        runs = list(self.runs.values())
        done = [r for r in runs if r.status == "done"]
        jct = np.array([r.finish - r.job.arrival_s for r in done if r.finish is not None]) if done else np.zeros(0)
        wait = np.array([(r.start - r.job.arrival_s) for r in runs if r.start is not None]) if runs else np.zeros(0)
        a = self.acc
        end = max((r.finish or self.now) for r in runs) if runs else 0.0
        cap = self.cluster.capacity_cpu * end
        fails: dict[str, int] = {}
        for r in runs:
            if r.status == "failed":
                fails[r.fail_reason] = fails.get(r.fail_reason, 0) + 1
        return {
            "policy": self.policy.name,
            "jobs": len(runs),
            "completed": len(done),
            "completion_rate": len(done) / max(len(runs), 1),
            "jct_mean_h": float(jct.mean() / 3600) if len(jct) else float("nan"),
            "jct_median_h": float(np.median(jct) / 3600) if len(jct) else float("nan"),
            "jct_p95_h": float(np.percentile(jct, 95) / 3600) if len(jct) else float("nan"),
            "queue_median_h": float(np.median(wait) / 3600) if len(wait) else float("nan"),
            "cpu_utilization": a["used_cpu_s"] / a["alloc_cpu_s"] if a["alloc_cpu_s"] else float("nan"),
            "memory_utilization": a["used_mem_s"] / a["alloc_mem_s"] if a["alloc_mem_s"] else float("nan"),
            "cluster_cpu_allocated": a["alloc_cpu_s"] / cap if cap else float("nan"),
            "makespan_h": end / 3600,
            "failures": fails,
            "decisions": dict(sorted(self.decisions.items())),
            "plan_changes": int(sum(r.plan_changes for r in runs)),
            "jct_h": sorted((jct / 3600).tolist()),
            "per_job": [{"job": r.job.job_id, "status": r.status, "misconfig": r.job.misconfig,
                         "jct_h": (r.finish - r.job.arrival_s) / 3600
                         if r.status == "done" and r.finish is not None else None}
                        for r in runs],
        }



def simulate(trace: list[TraceJob], policy: SimPolicy, *, cluster: ClusterSpec = ClusterSpec(),
             params: SimParams = SimParams(), seed: int = 0, keep_events: bool = False) -> dict[str, Any]:
    return Simulation(trace, policy, cluster, params, seed, keep_events).run()
