"""Stage 2 of DLRover-RM, runtime scaling: after `profile_samples` throughput samples at the current plan,
refit the online model and take the unit actions (add a worker, a core per worker, a server, a core per
server) with the largest predicted gain per unit of added cost, up to `max_units_per_step`, while the
marginal gain ratio (dTheta/dcost) / (Theta/cost) stays >= `min_gain_ratio` (DLRover: 0.2) and the plan
fits the limits; shrink when a unit's removal loses less than `shrink_ratio`; right-size pods to what
they use; never change more often than `interval_s` (servers: `server_interval_s`). Each decision is
an `Event`; nothing here executes a plan."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from recforge.elastic.optimizer.errors import MODEL_ERRORS, describe
from recforge.elastic.optimizer.events import Event
from recforge.elastic.optimizer.models.memory_model import GiB, MemoryModel, MemoryTrend
from recforge.elastic.optimizer.models.throughput_model import PS_TERMS, OnlineThroughputModel, Sample, ThroughputModel
from recforge.elastic.optimizer.observation import Observation
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, OptimizerConfig, PodPlan
from recforge.elastic.optimizer.search import best_moves, job_steps, plan_cost, pod_memory_at, search


class RuntimeStage:
    """Stage 2: model-driven scaling, paced, within limits."""

    def __init__(self, job: JobDescription, limits: JobLimits, cfg: OptimizerConfig = OptimizerConfig(),
                 prior: ThroughputModel | None = None, memory: MemoryModel | None = None,
                 terms: Sequence[str] | None = None) -> None:
        self.job, self.limits, self.cfg = job, limits, cfg
        terms = tuple(terms or (prior.terms if prior is not None else PS_TERMS))
        self.model = OnlineThroughputModel(terms, prior, min_points=3)
        self.memory = memory
        self.last_change_s: float | None = None
        self.last_server_change_s: float | None = None
        self.samples_at_plan = 0
        self._plan: PodPlan | None = None
        self._last_hold = ""
        self._last_refit_error = ""
        self._server_mem = MemoryTrend()
        self._worker_mem = MemoryTrend()  # the largest worker RSS reported at each tick of the current plan

    def observe(self, obs: Observation) -> list[Event]:
        if obs.plan != self._plan:
            self._plan, self.samples_at_plan = obs.plan, 0
            self._worker_mem = MemoryTrend()  # a new plan is new processes (and another shard): a new trend
        if obs.worker_memory and obs.pending_s <= 0:
            self._worker_mem.add(obs.step, max(obs.worker_memory))
        if obs.server_memory:
            self._server_mem.add(obs.step, max(obs.server_memory))
        if obs.samples_per_s is not None and obs.samples_per_s > 0 and obs.pending_s <= 0:
            self.model.add(Sample(obs.plan.allocation(self.job.host_cores), float(obs.samples_per_s)), refit=False)
            self.samples_at_plan += 1
        if self.samples_at_plan < self.cfg.profile_samples:
            return self._hold(f"profiling: {self.samples_at_plan} of {self.cfg.profile_samples} samples at this plan",
                              obs)
        if self.last_change_s is not None and obs.time_s - self.last_change_s < self.cfg.interval_s:
            return self._hold(f"pacing: {obs.time_s - self.last_change_s:.0f}s since the last change "
                              f"< {self.cfg.interval_s:.0f}s", obs)
        refit_failed: list[Event] = []
        if self.model.samples:
            try:
                self.model.refit()
                self._last_refit_error = ""
            except MODEL_ERRORS as e:  # keep the previous model; say why (once per error type until a refit works)
                self.model.status = f"refit failed ({e!r}): previous model kept"
                if type(e).__name__ != self._last_refit_error:
                    self._last_refit_error = type(e).__name__
                    refit_failed.append(Event(
                        "runtime", "fallback", f"refit on {len(self.model.samples)} samples failed ({describe(e)}): "
                        "previous model kept", inputs={"observed_samples_per_s": obs.samples_per_s,
                                                       "samples": len(self.model.samples)},
                        plan_before=obs.plan.to_dict(), time_s=obs.time_s))
        model = self.model.model
        if model is None:
            return refit_failed + self._hold(f"no model yet ({self.model.status})", obs, action="fallback")
        return refit_failed + self._decide(obs, model)

    def _decide(self, obs: Observation, model: ThroughputModel) -> list[Event]:
        """The search on `model` from the (right-sized) plan: the events of one tick past profiling and pacing."""
        allow_servers = (self.last_server_change_s is None
                         or obs.time_s - self.last_server_change_s >= self.cfg.server_interval_s)
        start, notes = self._rightsize(obs, allow_servers, model) if self.cfg.rightsize else (obs.plan, [])
        frozen = self._idle_groups(obs)
        first = None  # the search's first scoring; from the current plan it also explains a hold (computed once)
        try:
            if start == obs.plan:
                first = best_moves(start, model, self.limits, self.cfg, self.job, self.memory,
                                   allow_servers=allow_servers, frozen=frozen)
            plan, moves = search(start, model, self.limits, self.cfg, self.job, self.memory,
                                 max_units=self.cfg.max_units_per_step, allow_servers=allow_servers,
                                 frozen=frozen, first=first)
        except MODEL_ERRORS as e:  # a degenerate model must not take the job down: keep the plan
            return self._hold(f"search failed ({describe(e)}): keeping the plan", obs, action="fallback")
        if moves and self.memory is None and plan.workers != start.workers:
            # without a memory model the search keeps the pod memory: move it with the shard the new count holds
            mem = pod_memory_at(start.memory_per_worker, self.job, start.workers, plan.workers,
                                margin=self.cfg.worker_memory_margin)
            sized = replace(plan, memory_per_worker=max(self.limits.min_memory_per_pod, mem))
            if sized.memory_per_worker != plan.memory_per_worker and self.limits.fits(sized):
                plan = sized
        if plan == obs.plan:
            moves, notes = [], []
        payoff = ""
        if moves and self.cfg.relaunch_s > 0:
            saved = self._time_saved(obs, model.predict(start.allocation(self.job.host_cores)),
                                     model.predict(plan.allocation(self.job.host_cores)))
            if saved is not None and saved <= self.cfg.relaunch_s:  # not worth its relaunch: right-size alone
                payoff = (f"payoff: {len(moves)} unit move(s) would save {saved:.0f}s of the samples left, not "
                          f"more than the {self.cfg.relaunch_s:.0f}s a relaunch costs")
                moves, plan = [], start
                if notes and plan != obs.plan:
                    notes.append(payoff)
        if not moves and notes and plan != obs.plan:
            self.last_change_s = obs.time_s
            if plan.servers != obs.plan.servers or plan.cpu_per_server != obs.plan.cpu_per_server:
                self.last_server_change_s = obs.time_s
            self._last_hold = ""
            return [Event("runtime", "rightsize", "; ".join(notes),
                          inputs={"worker_cpu_util": list(obs.worker_cpu_util),
                                  "server_cpu_util": [list(u) for u in obs.server_cpu_util],
                                  "worker_memory": list(obs.worker_memory), "server_memory": list(obs.server_memory)},
                          prediction={"samples_per_s_now": model.predict(obs.plan.allocation(self.job.host_cores)),
                                      "samples_per_s_after": model.predict(plan.allocation(self.job.host_cores))},
                          plan_before=obs.plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s)]
        if payoff:
            return self._hold(payoff, obs,
                              prediction={"samples_per_s": model.predict(obs.plan.allocation(self.job.host_cores))})
        if not moves:
            grow, shrink = first if first is not None else best_moves(
                obs.plan, model, self.limits, self.cfg, self.job, self.memory, allow_servers=allow_servers,
                frozen=frozen)
            why = (f"best growth {grow.action} has marginal ratio {grow.ratio:.2f} < {self.cfg.min_gain_ratio}"
                   if grow is not None else "no growth fits the limits")
            return self._hold(why, obs,
                              prediction={"samples_per_s": model.predict(obs.plan.allocation(self.job.host_cores))})
        pred_now = model.predict(obs.plan.allocation(self.job.host_cores))
        pred_new = model.predict(plan.allocation(self.job.host_cores))
        self.last_change_s = obs.time_s
        if any("server" in m.action for m in moves):
            self.last_server_change_s = obs.time_s
        self._last_hold = ""
        return [Event("runtime", "+".join((["rightsize"] if notes else []) + [m.action for m in moves]),
                      ("; ".join(notes) + "; then " if notes else "")
                      + f"{len(moves)} unit move(s), marginal ratios {[round(m.ratio, 3) for m in moves]} "
                      f"(threshold {self.cfg.min_gain_ratio} to grow, {self.cfg.shrink_ratio} to shrink)",
                      inputs={"observed_samples_per_s": obs.samples_per_s, "model_status": self.model.status,
                              "model": model.to_dict(), "samples": len(self.model.samples)},
                      prediction={"samples_per_s_now": pred_now, "samples_per_s_after": pred_new,
                                  "cost_now": plan_cost(obs.plan, self.cfg), "cost_after": plan_cost(plan, self.cfg)},
                      plan_before=obs.plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s)]

    def _time_saved(self, obs: Observation, pred_now: float, pred_new: float) -> float | None:
        """Predicted seconds a scaling saves on the job's samples left (None: the rule is off or cannot tell)."""
        if self.cfg.relaunch_s <= 0 or obs.total_steps is None or not (pred_now > 0 and pred_new > 0):
            return None
        left = max(obs.total_steps - obs.step, 0.0) * obs.plan.batch_size
        return left / pred_now - left / pred_new

    def _idle_groups(self, obs: Observation) -> frozenset[str]:
        """Measured utilization beats the model: no more cores for pods that leave theirs idle."""
        out = set()
        if obs.worker_cpu_util and max(obs.worker_cpu_util) < self.cfg.low_util:
            out.add("add_cpu_per_worker")
        if any(len(x) for x in obs.server_cpu_util):
            if max(statistics.fmean(x) for x in obs.server_cpu_util if len(x)) < self.cfg.low_util:
                out.add("add_cpu_per_server")
        return frozenset(out)

    def _rightsize(self, obs: Observation, allow_servers: bool,
                   model: ThroughputModel | None = None) -> tuple[PodPlan, list[str]]:
        """DLRover's utilization rules: CPU to what the pods use (+25%) when their peak use is low (taken to
        where the rule would stop, `_worker_cpu_target`); worker memory to 1.5x the peak; server memory to 1.2x
        what the trend predicts at the end."""
        plan, cfg, lim, notes = obs.plan, self.cfg, self.limits, []
        if obs.worker_cpu_util:
            u = max(obs.worker_cpu_util)
            target, steps = self._worker_cpu_target(plan, u, model)
            if u < cfg.low_util and target < plan.cpu_per_worker:
                notes.append(f"workers use at most {u:.0%} of {plan.cpu_per_worker:g} cores: {target:g} cores each"
                             + (f" (the rule applied {steps} times on the model's step times)" if steps > 1 else ""))
                plan = replace(plan, cpu_per_worker=float(target))
        if allow_servers and plan.servers > 0 and obs.server_cpu_util:
            used = [statistics.fmean(x) for x in obs.server_cpu_util if len(x)]
            u = max(used) if used else 1.0
            target = max(1.0, math.ceil(u * plan.cpu_per_server * cfg.cpu_headroom))
            if u < cfg.low_util and target < plan.cpu_per_server:
                notes.append(f"servers use at most {u:.0%} of {plan.cpu_per_server:g} cores: {target:g} cores each")
                plan = replace(plan, cpu_per_server=float(target))
        if obs.worker_memory:
            peak = max(obs.worker_memory)
            need = max(lim.min_memory_per_pod, peak * cfg.worker_memory_margin)
            why = f"workers peak at {peak / GiB:.2f} GiB"
            if len(self._worker_mem.points) >= 3 and obs.total_steps is not None:
                # measured growth at this plan: the peak it predicts at the end x the memory margin (as servers),
                # never below what the workers hold now x that margin
                end = max(self._worker_mem.predicted_at(obs.total_steps), peak)
                need = max(lim.min_memory_per_pod, end * cfg.memory_margin)
                why = f"workers peak at {peak / GiB:.2f} GiB, {end / GiB:.2f} GiB predicted by the end"
            if plan.memory_per_worker > 1.3 * need:
                notes.append(f"{why}: {need / GiB:.2f} GiB each")
                plan = replace(plan, memory_per_worker=need)
        if plan.servers > 0 and obs.server_memory and len(self._server_mem.points) >= 3:
            total = obs.total_steps if obs.total_steps is not None else job_steps(self.job, plan)
            need = max(lim.min_memory_per_pod, self._server_mem.predicted_at(total) * cfg.memory_margin)
            if plan.memory_per_server > 1.3 * need:
                notes.append(f"servers predicted to peak at {need / cfg.memory_margin / GiB:.2f} GiB by the end: "
                             f"{need / GiB:.2f} GiB each")
                plan = replace(plan, memory_per_server=need)
        return plan, notes

    def _worker_cpu_target(self, plan: PodPlan, u: float, model: ThroughputModel | None) -> tuple[float, int]:
        """DLRover's CPU right-sizing target, ceil(used cores x 1.25), taken to its fixed point in one decision.
        With fewer cores a worker's compute takes longer, so its utilization rises and the rule would fire again at
        the next report, each time a checkpoint-stop-relaunch: instead the rule is applied again on the predicted
        step time (the model's step time at the new cores, scaled to the measured one; the busy core-seconds per
        step held constant) until the predicted utilization reaches `low_util` or the target stops falling.
        Returns (cores per worker, how many times the rule was applied)."""
        cfg, lim, c = self.cfg, self.limits, plan.cpu_per_worker
        target = max(lim.min_cpu_per_worker, math.ceil(u * c * cfg.cpu_headroom))
        if not (u < cfg.low_util and target < c) or model is None:
            return float(target), 1
        host = self.job.host_cores
        thr_now = model.predict(plan.allocation(host))
        if not (thr_now > 0 and math.isfinite(thr_now)):
            return float(target), 1
        busy = u * c  # cores busy per worker; step time T ~ 1 / throughput at the same workers and batch
        steps = 1
        for _ in range(16):
            thr = model.predict(replace(plan, cpu_per_worker=float(target)).allocation(host))
            if not (thr > 0 and math.isfinite(thr)):
                break
            busy_new = busy * thr / thr_now  # the same core-seconds per step over a longer step
            u_new = busy_new / target
            nxt = max(lim.min_cpu_per_worker, math.ceil(busy_new * cfg.cpu_headroom))
            if u_new >= cfg.low_util or nxt >= target:
                break
            target, steps = nxt, steps + 1
        return float(target), steps

    def _hold(self, reason: str, obs: Observation, action: str = "hold", prediction: dict | None = None) -> list[Event]:
        key = reason.split(":")[0] + action
        if key == self._last_hold:
            return []  # one event per kind of wait, not one per tick
        self._last_hold = key
        return [Event("runtime", action, reason, inputs={"observed_samples_per_s": obs.samples_per_s,
                                                         "model_status": self.model.status},
                      prediction=prediction or {}, plan_before=obs.plan.to_dict(), plan_after=None, time_s=obs.time_s)]
