"""Event-driven cluster simulation: jobs arrive, pend, run, get profiled, change plans, fail and finish.

Between events every running job progresses at its true throughput (truth.py), so the clock jumps from
event to event. Events: arrival, profiler tick (every `tick_s`), resume after a (re)launch overhead,
finish, server OOM (when the growing embeddings pass the memory of the most loaded server), worker OOM,
node eviction, pending checks. Randomness comes from the trace and from generators seeded by
(seed, job, tick) / (seed, node), so a run is deterministic under its seed and the policies face the
same faults.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from recforge.elastic.optimizer import Event, JobDescription, JobLimits, Observation, PodPlan
from recforge.elastic.simulate import truth
from recforge.elastic.simulate.cluster import Cluster, ClusterSpec
from recforge.elastic.simulate.policies import SimPolicy
from recforge.elastic.simulate.trace import TraceJob

GiB = float(1 << 30)
ARRIVE, TICK, RESUME, FINISH, OOM, EVICT, PENDING_CHECK = range(7)


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
    start: float | None = None
    finish: float | None = None
    ticks: int = 0
    peak_server_mem: float = 0.0
    events: list = field(default_factory=list)
    plan_changes: int = 0
    fail_reason: str = ""


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
        self.pending: list[int] = []
        self.acc = {"alloc_cpu_s": 0.0, "used_cpu_s": 0.0, "alloc_mem_s": 0.0, "used_mem_s": 0.0}
        self.decisions: dict[str, int] = {}
        self._by_id = {j.job_id: j for j in trace}

    # ---- event queue ----------------------------------------------------------------------
    def push(self, t: float, kind: int, key: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, key, version))

    def run(self) -> dict[str, Any]:
        for j in self.trace:
            self.push(j.arrival_s, ARRIVE, j.job_id)
        self._schedule_evictions()
        handlers = {ARRIVE: self._arrive, TICK: self._tick, RESUME: self._resume, FINISH: self._finish,
                    OOM: self._oom, EVICT: self._evict, PENDING_CHECK: self._pending_check}
        while self.heap:
            t, _, kind, key, version = heapq.heappop(self.heap)
            if t > self.params.horizon_s:
                break
            if kind not in (ARRIVE, EVICT):
                r = self.runs.get(key)
                if r is None or r.version != version or r.status in ("done", "failed"):
                    continue
            self.now = t
            handlers[kind](key, t)
            if kind in (FINISH, OOM, PENDING_CHECK, EVICT) and self._all_arrived_and_finished():
                break
        for r in self.runs.values():
            if r.status in ("running", "pending"):
                self._advance(r, self.now)
                r.status, r.fail_reason = "failed", "horizon"
        return self._result()

    def _all_arrived_and_finished(self) -> bool:
        return len(self.runs) == len(self.trace) and all(r.status in ("done", "failed") for r in self.runs.values())

    # ---- bookkeeping ----------------------------------------------------------------------
    def _advance(self, r: JobRun, t: float) -> None:
        dt = t - r.t_last
        if dt > 0 and r.status == "running":
            r.done = min(r.job.total_samples, r.done + r.rate * dt)
            a = self.acc
            a["alloc_cpu_s"] += r.plan.cpu_total * dt
            a["used_cpu_s"] += r.used_cpu * dt
            a["alloc_mem_s"] += r.plan.memory_total * dt
            a["used_mem_s"] += r.used_mem * dt
        r.t_last = t

    def _pods(self, plan: PodPlan) -> list[tuple[float, float]]:
        return ([(plan.cpu_per_worker, plan.memory_per_worker)] * plan.workers
                + [(plan.cpu_per_server, plan.memory_per_server)] * plan.servers)

    def _truth(self, r: JobRun, plan: PodPlan | None = None) -> tuple[float, float, float, float]:
        p, j = plan or r.plan, r.job
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
        rate, cpu, mem, _ = self._truth(r)
        if t < r.resume_at:
            r.rate, r.used_cpu, r.used_mem = 0.0, 0.1 * r.plan.cpu_total, 0.3 * mem
            self.push(r.resume_at, RESUME, r.job.job_id, r.version)
            return
        r.rate, r.used_cpu, r.used_mem = rate, cpu, mem
        j, p = r.job, r.plan
        if j.worker_mem > p.memory_per_worker:
            self.push(t + 60.0, OOM, j.job_id, r.version)  # dies as soon as it loads its first batches
            return
        left = j.total_samples - r.done
        self.push(t + left / rate if rate > 0 else math.inf, FINISH, j.job_id, r.version)
        oom_at = truth.samples_until_server_oom(j.emb_bytes, j.emb_growth_per_sample, p.servers, j.hot_server,
                                                p.memory_per_server)
        if oom_at < j.total_samples:
            self.push(t + max(oom_at - r.done, 0.0) / rate, OOM, j.job_id, r.version)
        next_tick = t + self.params.tick_s
        self.push(next_tick, TICK, j.job_id, r.version)

    def _observe(self, r: JobRun, t: float, oom_w=(), oom_s=()) -> Observation:
        j, p = r.job, r.plan
        rng = np.random.default_rng((self.seed, j.job_id, r.ticks))
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
        return Observation(time_s=t, plan=p, samples_per_s=rate * float(np.exp(rng.normal(0, self.params.noise))),
                           step=int(r.done / per_step), worker_step_s=steps, worker_cpu_util=[wu] * min(p.workers, 4),
                           worker_memory=[min(j.worker_mem, p.memory_per_worker)] * min(p.workers, 4),
                           server_memory=[hot_mem] + [smem] * min(p.servers - 1, 3), server_cpu_util=utils,
                           shard_load=loads, oom_workers=oom_w, oom_servers=oom_s,
                           total_steps=j.total_samples / per_step)

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
        r.status = "running"
        r.start = t if r.start is None else r.start
        r.pending_since = None
        r.t_last = t
        r.resume_at = t + self.params.startup_s
        r.ckpt_t = t
        self._set_rate(r, t)
        return True

    def _schedule_pending(self, t: float) -> None:
        still = []
        for jid in self.pending:
            r = self.runs[jid]
            if r.status == "pending" and not self._try_start(r, t):
                still.append(jid)
        self.pending = [jid for jid in still if self.runs[jid].status == "pending"]

    def _release(self, r: JobRun) -> None:
        if r.where is not None:
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
                              parameter_server=True)
        plan, events = self.policy.initial_plan(j, desc, limits)
        r = JobRun(job=j, plan=plan, status="pending", pending_since=t, t_last=t)
        self.runs[jid] = r
        self._record(r, events)
        if not self._try_start(r, t):
            self.pending.append(jid)
            self.push(t + 900.0, PENDING_CHECK, jid, r.version)
            self.push(t + self.params.abandon_pending_s, PENDING_CHECK, jid, r.version)

    def _pending_check(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        if r.status != "pending":
            return
        waited = t - (r.pending_since or t)
        if waited >= self.params.abandon_pending_s - 1e-6:
            r.status, r.fail_reason, r.finish = "failed", "pending too long (user gave up)", t
            return
        events = self.policy.on_pending(r.job, Observation(time_s=t, plan=r.plan, pending_s=waited))
        self._record(r, events)
        new_plan = next((e.plan_after for e in events if e.changes_plan and e.plan_after is not None), None)
        if new_plan is not None:
            r.plan = PodPlan.from_dict(new_plan)
            r.plan_changes += 1
            if self._try_start(r, t):
                self.pending.remove(jid)
                return
        self.push(t + 900.0, PENDING_CHECK, jid, r.version)

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
        r.peak_server_mem = max(r.peak_server_mem, self._truth(r)[3])
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
            for (c, m), n in zip(old_pods, old_where, strict=True):
                self.cluster.free_cpu[n] -= c
                self.cluster.free_mem[n] -= m
            r.pods, r.where = old_pods, old_where
            return False
        only_workers = replace(new, workers=r.plan.workers) == r.plan
        r.pods, r.where, r.plan = pods, where, new
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
            r.status, r.fail_reason, r.finish = "failed", why, t
            self._schedule_pending(t)
            return
        r.resume_at = t + self.params.restart_s

    def _oom(self, jid: int, t: float) -> None:
        r = self.runs[jid]
        self._advance(r, t)
        j = r.job
        worker = j.worker_mem > r.plan.memory_per_worker
        obs = self._observe(r, t, oom_w=[0] if worker else [], oom_s=[] if worker else [0])
        events = self.policy.on_oom(j, obs)
        self._record(r, events)
        r.restarts += 1  # an OOM kills the pod's state: back to the checkpoint, whatever the policy
        r.done = r.ckpt
        if r.restarts > self.params.max_restarts:
            self._release(r)
            r.status, r.fail_reason, r.finish = "failed", "out of memory", t
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
        r.status, r.finish = "done", t
        self._release(r)
        self.policy.on_finish(r.job, r.plan, {"time": t, "rate": r.rate, "peak_worker_mem": r.job.worker_mem,
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
        for r in list(self.runs.values()):
            if r.status == "running" and r.where is not None and node in r.where:
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
