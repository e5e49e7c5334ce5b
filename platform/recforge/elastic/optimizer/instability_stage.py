"""Stage 3 of DLRover-RM, instability handling: a straggler (step time > 2x the median of the other
workers) is relaunched elsewhere; a hot server (CPU >= 0.9 over the last 3 samples, or shard load > 2x
the median) gets more cores; predicted memory exhaustion or an OOM relaunches with more memory (double,
at most +8 GiB a step, 64 GiB cap); a job pending past `pending_timeout_s` is relaunched smaller. Each
decision is an `Event`; nothing here executes a plan."""
from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from recforge.elastic.optimizer.events import Event
from recforge.elastic.optimizer.models.memory_model import (
    GiB,
    MemoryModel,
    MemoryTrend,
    embedding_shard_bytes,
    next_memory,
)
from recforge.elastic.optimizer.observation import Observation
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, OptimizerConfig, PodPlan
from recforge.elastic.optimizer.search import job_steps


class InstabilityStage:
    """Stage 3: stragglers, hot servers / shards, memory exhaustion, pending pods."""

    def __init__(self, job: JobDescription, limits: JobLimits, cfg: OptimizerConfig = OptimizerConfig(),
                 memory: MemoryModel | None = None) -> None:
        self.job, self.limits, self.cfg, self.memory = job, limits, cfg, memory
        self.trends: dict[tuple[str, int], MemoryTrend] = {}
        self._trend_shape: tuple[int, int] | None = None  # (workers, servers) the trends were measured under
        self.pending_relaunches = 0
        self.last_migration_s: float | None = None

    def observe(self, obs: Observation) -> list[Event]:
        events: list[Event] = []
        plan = obs.plan
        # pending pods: nothing else matters until the job runs
        if obs.pending_s > self.cfg.pending_timeout_s:
            smaller = self._smaller(plan) if self.pending_relaunches < self.cfg.max_pending_relaunches else plan
            if smaller != plan:
                self.pending_relaunches += 1
                return [Event("instability", "relaunch_smaller",
                              f"pending {obs.pending_s:.0f}s > {self.cfg.pending_timeout_s:.0f}s: "
                              "relaunch with half the resources",
                              inputs={"pending_s": obs.pending_s}, prediction={},
                              plan_before=plan.to_dict(), plan_after=smaller.to_dict(), time_s=obs.time_s)]
            return [Event("instability", "hold", f"pending {obs.pending_s:.0f}s; the plan is minimal or was already "
                          f"relaunched smaller {self.pending_relaunches} time(s) "
                          f"(max {self.cfg.max_pending_relaunches})",
                          inputs={"pending_s": obs.pending_s}, plan_before=plan.to_dict(), time_s=obs.time_s)]
        if obs.pending_s > 0:
            return []
        # memory: an OOM that happened, or one the trend / model predicts before the job ends
        need = self._memory_need(obs)
        if need is not None:
            events.append(need)
            assert need.plan_after is not None  # _memory_need always sets the plan it leads to
            plan = PodPlan.from_dict(need.plan_after)
        # stragglers
        times = [t for t in obs.worker_step_s if t and t > 0]
        if len(times) >= 2:
            srt = sorted(times)
            med = _median_sorted(srt, len(srt))
            # against the median of the *other* workers: with two workers the median of all is their mean,
            # which no step time can exceed twice (from the one sort: all but one occurrence of the worker's own)
            f = self.cfg.straggler_factor
            slow: list[int] = []
            verdict: dict[float, bool] = {}  # (a step time's verdict once: the workers a profiler reports mostly tie)
            for i, t in enumerate(obs.worker_step_s):
                if not t:
                    continue
                v = verdict.get(t)
                if v is None:
                    v = verdict[t] = t > f * (_median_sorted(srt, bisect.bisect_left(srt, t)) if t > 0 else med)
                if v:
                    slow.append(i)
            if slow:
                events.append(Event("instability", "replace_straggler",
                                    f"worker(s) {slow} step time > {self.cfg.straggler_factor}x the median of "
                                    f"the other workers (all: {med:.3g}s): relaunch them on other nodes",
                                    inputs={"worker_step_s": list(obs.worker_step_s), "median_s": med},
                                    prediction={"samples_per_s_recovered_fraction": len(slow) / len(times)},
                                    plan_before=plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s))
        # hot servers / shards
        hot = []
        for i, util in enumerate(obs.server_cpu_util):
            recent = list(util)[-self.cfg.hot_samples:]
            if len(recent) >= self.cfg.hot_samples and statistics.fmean(recent) >= self.cfg.hot_cpu_util:
                hot.append(i)
        loads = [x for x in obs.shard_load if x is not None]
        hot_shards = []
        if len(loads) >= 2:
            med = statistics.median(loads)
            hot_shards = [i for i, x in enumerate(obs.shard_load) if med > 0 and x > self.cfg.hot_shard_factor * med]
        paced = self.last_migration_s is not None and obs.time_s - self.last_migration_s < self.cfg.server_interval_s
        if (hot or hot_shards) and plan.servers > 0 and not paced:
            self.last_migration_s = obs.time_s
            more = min(plan.cpu_per_server * 2, self.limits.max_cpu_per_server)
            new = replace(plan, cpu_per_server=more)
            if not self.limits.fits(new):
                new = plan
            events.append(Event("instability", "migrate_hot_server",
                                f"server(s) {sorted(set(hot + hot_shards))} hot (CPU >= {self.cfg.hot_cpu_util} over "
                                f"{self.cfg.hot_samples} samples, or load > {self.cfg.hot_shard_factor}x median): "
                                f"migrate to a pod with {more:g} cores"
                                + ("" if new != plan else " (limits allow no more: migrate only)"),
                                inputs={"server_cpu_util": [list(u) for u in obs.server_cpu_util],
                                        "shard_load": list(obs.shard_load)},
                                prediction={}, plan_before=plan.to_dict(), plan_after=new.to_dict(), time_s=obs.time_s))
        elif hot_shards and not paced:
            self.last_migration_s = obs.time_s
            events.append(Event("instability", "rebalance_hot_shard",
                                f"embedding shard(s) {hot_shards} carry > {self.cfg.hot_shard_factor}x the median "
                                "load: reshard",
                                inputs={"shard_load": list(obs.shard_load)}, plan_before=plan.to_dict(),
                                plan_after=plan.to_dict(), time_s=obs.time_s))
        return events

    def _smaller(self, plan: PodPlan) -> PodPlan:
        lim, floor = self.limits, self.limits.min_memory_per_pod
        if plan.workers > 1:
            fewer = replace(plan, workers=max(1, plan.workers // 2))
            if self.job.parameter_server or not self.job.table_bytes:
                return fewer
            # sharded embeddings: half the workers hold twice the shard each; a relaunch that kept the pod
            # memory would run out of it as soon as it started
            grown = (embedding_shard_bytes(self.job.table_bytes, fewer.workers)
                     - embedding_shard_bytes(self.job.table_bytes, plan.workers)) * self.cfg.memory_margin
            mem = plan.memory_per_worker + max(grown, 0.0)
            if mem <= min(self.cfg.memory_cap_bytes, lim.max_memory_per_pod):
                return replace(fewer, memory_per_worker=mem)
            # the bigger shard does not fit a pod: keep the workers, halve the cores
            if plan.cpu_per_worker > lim.min_cpu_per_worker:
                return replace(plan, cpu_per_worker=max(lim.min_cpu_per_worker, math.floor(plan.cpu_per_worker / 2)))
            return plan
        if plan.cpu_per_worker > lim.min_cpu_per_worker:
            return replace(plan, cpu_per_worker=max(lim.min_cpu_per_worker, math.floor(plan.cpu_per_worker / 2)),
                           memory_per_worker=max(floor, plan.memory_per_worker / 2))
        return plan

    def _add_points(self, group: str, step: float, rss_list: Sequence[float]) -> None:
        """Each pod's RSS into its trend `trends[(group, i)]`. Pods that report the same RSS every time share one
        trend object (a profiler's workers mostly tie): one `add` instead of one per pod, the same points per key."""
        n = len(rss_list)
        if not n:
            return
        keys = [(group, i) for i in range(n)]
        trs = [self.trends.get(k) for k in keys]
        r0 = rss_list[0]
        if (rss_list.count(r0) == n if isinstance(rss_list, list) else all(x == r0 for x in rss_list)):
            first = trs[0]
            if first is None and all(t is None for t in trs):  # new trends: one object for all
                first = MemoryTrend()
                for k in keys:
                    self.trends[k] = first
                first.add(step, r0)
                return
            if (first is not None and all(t is first for t in trs)
                    and not any(t is first for o, t in self.trends.items() if o[0] == group and o[1] >= n)):
                first.add(step, r0)  # shared by exactly these keys: it stays shared
                return
        refs: dict[int, int] = {}  # otherwise one trend per key: a shared one is copied before it is added to
        for t in self.trends.values():
            refs[id(t)] = refs.get(id(t), 0) + 1
        for k, tr, rss in zip(keys, trs, rss_list, strict=True):
            if tr is None:
                tr = self.trends[k] = MemoryTrend()
            elif refs[id(tr)] > 1:
                refs[id(tr)] -= 1
                tr = self.trends[k] = tr.copy()
            tr.add(step, rss)

    def _memory_need(self, obs: Observation) -> Event | None:
        """Workers and servers alike: an OOM that happened, or one the trend / model predicts before the end."""
        plan, cfg = obs.plan, self.cfg
        total = obs.total_steps if obs.total_steps is not None else job_steps(self.job, plan)
        remaining = max(total - obs.step, 0.0)
        groups = [("worker", "memory_per_worker", obs.worker_memory, obs.oom_workers)]
        if plan.servers > 0:
            groups.append(("server", "memory_per_server", obs.server_memory, obs.oom_servers))
        shape = (plan.workers, plan.servers)
        if shape != self._trend_shape:  # a rescale re-shards the embeddings: each pod's memory jumps, not a trend
            self.trends.clear()
            self._trend_shape = shape
        for group, _, rss_list, _ in groups:
            self._add_points(group, obs.step, rss_list)
        for group, field_name, rss_list, oom in groups:
            limit = getattr(plan, field_name)
            reason, predicted = None, None
            hit = sorted(int(i) for i in oom)
            if hit:
                reason = f"{group}(s) {hit} ran out of memory at {limit / GiB:.2f} GiB"
                predicted = max(list(rss_list) + [limit]) * cfg.memory_margin
            else:
                prev = None
                for i in range(len(rss_list)):
                    tr = self.trends[(group, i)]
                    if prev is not None and (tr is prev or tr.points == prev.points):
                        continue  # the same points as the pod before (which did not break): the same answer
                    prev = tr
                    steps_left = tr.steps_to_exhaustion(limit)
                    if steps_left < remaining:
                        predicted = tr.predicted_at(total)
                        reason = (f"{group} {i} memory trend ({tr.slope():.3g} B/step) reaches its "
                                  f"{limit / GiB:.2f} GiB limit in {steps_left:.0f} steps, "
                                  f"before the {remaining:.0f} steps left")
                        break
                if (reason is None and group == "worker" and self.memory is not None and self.job.table_bytes
                        and not self.job.parameter_server):
                    shard = embedding_shard_bytes(self.job.table_bytes, plan.workers)
                    if self.memory.will_oom(limit, shard, total / plan.workers):
                        predicted = self.memory.predict(shard, total / plan.workers)
                        reason = (f"memory model predicts {predicted / GiB:.2f} GiB by step {total:.0f} "
                                  f"> limit {limit / GiB:.2f} GiB")
            if reason is None:
                continue
            new_mem = next_memory(limit, needed_bytes=(predicted or 0) * cfg.memory_margin,
                                  max_step_bytes=cfg.oom_step_bytes,
                                  cap_bytes=min(cfg.memory_cap_bytes, self.limits.max_memory_per_pod))
            memory_change: dict[str, Any] = {field_name: new_mem}
            new = replace(plan, **memory_change)
            inputs = {f"{group}_memory": list(rss_list), "step": obs.step, "total_steps": total, "limit_bytes": limit}
            # DLRover: an OOM relaunch is bounded per pod (+8 GiB a step, 64 GiB), not by the job's scaling limits
            if new_mem <= limit:
                return Event("instability", "memory_at_limit", reason + "; the pod is at the memory cap",
                             inputs=inputs, prediction={"peak_bytes": predicted},
                             plan_before=plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s)
            return Event("instability", f"relaunch_{group}s_more_memory",
                         reason + f": relaunch with {new_mem / GiB:.2f} GiB "
                                  f"(double, at most +{cfg.oom_step_bytes / GiB:.0f} GiB)",
                         inputs=inputs, prediction={"peak_bytes": predicted}, plan_before=plan.to_dict(),
                         plan_after=new.to_dict(), time_s=obs.time_s)
        return None


def _median_sorted(srt: list, skip: int) -> float:
    """statistics.median of the sorted list `srt` without its element at index `skip` (`len(srt)`: none left out):
    the same middle value(s), the same arithmetic, without a copy and a sort per worker."""
    n = len(srt) - (skip < len(srt))

    def at(j: int) -> float:
        return srt[j] if j < skip else srt[j + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2
