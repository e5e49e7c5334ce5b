"""The eighth simulator speed-ups (issue 17, deliverable 4b: Optimus at 100,000 jobs) against their references, bit for
bit: the garbage collector's threshold raised for a run, and the scheduling pass on per-plan numbers read once
(a 1k and a 10k Optimus run were also checked equal to the committed code by hashing every job's result, the JCT
list, the decision counts and the utilization totals)."""
from __future__ import annotations

import bisect
import gc
import math

import numpy as np
import pytest

from recforge.elastic.optimizer import PodPlan
from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy
from recforge.elastic.simulate import engine as engine_mod
from recforge.elastic.simulate.cluster import GiB
from recforge.elastic.simulate.engine import Simulation
from recforge.elastic.simulate.policies import OptimusAllocator


def _sim(policy: str, shape: str = "torchrec", n_jobs: int = 150, nodes: int = 10, eviction: float = 0.02):
    tp = TraceParams(shape=shape, n_jobs=n_jobs, arrival_window_h=24.0)
    trace = generate_trace(tp, seed=3)
    return Simulation(trace, make_policy(policy), ClusterSpec(nodes=nodes), SimParams(eviction_per_node_h=eviction),
                      seed=3)


def _run_logged(sim: Simulation, watch=None):
    """Run, logging every event a handler processed (`watch(sim)` called inside each handler, when given)."""
    log: list[tuple] = []
    for name in ("_arrive", "_tick", "_resume", "_finish", "_oom", "_evict", "_pending_check", "_realloc"):
        fn = getattr(sim, name)

        def wrapped(key, t, fn=fn, name=name):
            log.append((t, name, key))
            if watch is not None:
                watch(sim)
            return fn(key, t)
        setattr(sim, name, wrapped)
    return log, sim.run()


def _equal(a, b) -> bool:
    """Equal, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ---- the garbage collector's threshold during a run --------------------------------------------------------------
@pytest.mark.parametrize("policy", ["optimus", "static"])
def test_raised_gc_threshold_gives_the_same_run(policy):
    before = gc.get_threshold()
    seen: set = set()
    ref = _sim(policy)
    ref.gc_gen0 = None  # the reference: Python's collector as it was
    fast = _sim(policy)
    log_ref, r_ref = _run_logged(ref, lambda s: seen.add(("ref", gc.get_threshold())))
    log_fast, r_fast = _run_logged(fast, lambda s: seen.add(("fast", gc.get_threshold())))
    assert log_fast == log_ref and _equal(r_fast, r_ref) and fast.acc == ref.acc
    assert seen == {("ref", before), ("fast", (engine_mod.GC_GEN0, *before[1:]))}  # raised during the run only
    assert gc.get_threshold() == before  # and restored after it


def test_gc_threshold_restored_when_a_run_fails():
    before = gc.get_threshold()
    sim = _sim("optimus", n_jobs=20)

    def boom(key, t):
        assert gc.get_threshold()[0] == engine_mod.GC_GEN0
        raise RuntimeError("handler failed")
    sim._tick = boom
    with pytest.raises(RuntimeError, match="handler failed"):
        sim.run()
    assert gc.get_threshold() == before


def test_gc_threshold_never_lowered_nor_turned_on():
    before = gc.get_threshold()
    try:
        for setting, during in (((engine_mod.GC_GEN0 * 2, 10, 10), engine_mod.GC_GEN0 * 2), ((0, 10, 10), 0)):
            gc.set_threshold(*setting)
            seen: set = set()
            _run_logged(_sim("static", n_jobs=20), lambda s, seen=seen: seen.add(gc.get_threshold()[0]))
            assert seen == {during} and gc.get_threshold() == setting
    finally:
        gc.set_threshold(*before)


# ---- the scheduling pass ------------------------------------------------------------------------------------------
def _schedule_pending_reference(self: Simulation, t: float) -> None:
    """The committed pass (2e8a432): every plan number read from the plan on every try."""
    cl = self.cluster
    n = bisect.bisect_right(self.pending, (cl.free_cpu_total + 1e-6, math.inf))
    if not n:
        return
    big_c, big_m = float(cl.free_cpu.max()), float(cl.free_mem.max())
    failed: dict[tuple, float] = {}
    misses = 0
    runs = self.runs
    for jid in sorted([k[1] for k in self.pending[:n]]):
        r = runs[jid]
        p = r.plan
        if r.status != "pending":
            self._unpend(r)
            continue
        shape = (p.cpu_per_worker, p.memory_per_worker, p.servers, p.cpu_per_server, p.memory_per_server)
        if (p.cpu_total > cl.free_cpu_total + 1e-6 or p.cpu_per_worker > big_c + 1e-9
                or p.memory_per_worker > big_m + 1e-3 or p.workers >= failed.get(shape, math.inf)):
            continue
        if not p.servers and cl.refuses(p.cpu_per_worker, p.memory_per_worker, p.workers):
            pass
        elif self._try_start(r, t):
            self._unpend(r)
            big_c, big_m = float(cl.free_cpu.max()), float(cl.free_mem.max())
            continue
        failed[shape] = min(failed.get(shape, math.inf), p.workers)
        misses += 1
        if misses >= self.params.max_failed_placements:
            break


@pytest.mark.parametrize("policy,shape", [("optimus", "torchrec"), ("static", "torchrec"), ("dlrover", "torchrec"),
                                          ("static", "ps"), ("dlrover", "ps")])
def test_schedule_pending_equals_the_reference_pass(policy, shape, monkeypatch):
    fast = _sim(policy, shape, n_jobs=200, nodes=8)
    log_fast, r_fast = _run_logged(fast)
    with monkeypatch.context() as mp:
        mp.setattr(Simulation, "_schedule_pending", _schedule_pending_reference)
        ref = _sim(policy, shape, n_jobs=200, nodes=8)
        log_ref, r_ref = _run_logged(ref)
    assert log_fast == log_ref and _equal(r_fast, r_ref) and fast.acc == ref.acc
    started_late = sum(1 for r in fast.runs.values() if r.start is not None and r.start > r.job.arrival_s)
    assert started_late > 10  # jobs waited and were started by scheduling passes
    if policy == "optimus":
        assert r_fast["plan_changes"] > 20


def test_schedule_pending_reads_a_waiting_jobs_new_plan():
    """A waiting job whose plan changed is tried with the new plan's numbers, not the ones kept from an earlier pass."""
    sim = _sim("static", n_jobs=3, nodes=1, eviction=0.0)
    cl = sim.cluster
    node_c, node_m = cl.spec.cpu_per_node, cl.spec.memory_per_node
    blocker = cl.place([(node_c - 2.0, node_m - 2 * GiB)])  # 2 cores and 2 GiB left
    assert blocker is not None
    j = sim.trace[0]
    sim._arrive(j.job_id, 0.0)
    r = sim.runs[j.job_id]
    r.plan = PodPlan(workers=1, cpu_per_worker=2.0, memory_per_worker=4 * GiB)  # 4 GiB: does not fit
    sim._pend(r)
    sim._schedule_pending(0.0)
    assert r.status == "pending" and r.sched is not None and r.sched[0] is r.plan and r.sched[3] == 4 * GiB
    r.plan = PodPlan(workers=1, cpu_per_worker=2.0, memory_per_worker=1 * GiB)  # 1 GiB: fits
    sim._pend(r)
    sim._schedule_pending(0.0)
    assert r.status == "running" and r.where == [0] and r.sched is not None and r.sched[3] == 1 * GiB


# ---- Optimus's greedy on tuples -----------------------------------------------------------------------------------
def _allocate_reference(jobs, cpu_total, mem_total):
    """The committed greedy (2e8a432): `OptimusAllocator.gain` called with the job's dict for every worker."""
    import heapq
    free_c, free_m = cpu_total, mem_total
    out, heap = {}, []
    for i, j in enumerate(jobs):
        need_c, need_m = j["min_w"] * j["cpu"], j["min_w"] * j["mem"]
        if need_c > free_c + 1e-9 or need_m > free_m + 1e-3:
            out[j["id"]] = 0
            continue
        free_c, free_m = free_c - need_c, free_m - need_m
        out[j["id"]] = j["min_w"]
        heapq.heappush(heap, (-OptimusAllocator.gain(j, j["min_w"], cpu_total, mem_total), i, j["min_w"]))
    while heap:
        neg, i, w = heapq.heappop(heap)
        j = jobs[i]
        if -neg <= 0:
            break
        if j["cpu"] > free_c + 1e-9 or j["mem"] > free_m + 1e-3:
            continue
        free_c, free_m = free_c - j["cpu"], free_m - j["mem"]
        out[j["id"]] = w + 1
        if w + 1 < j["max_w"]:
            heapq.heappush(heap, (-OptimusAllocator.gain(j, w + 1, cpu_total, mem_total), i, w + 1))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_optimus_greedy_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    for case in range(40):
        jobs = []
        for i in range(int(rng.integers(1, 60))):
            max_w = int(rng.integers(1, 12))
            thr = (np.arange(1, max_w + 1) * rng.uniform(50, 500) / (1 + rng.uniform(0, 0.3) * np.arange(max_w)))
            if i % 7 == 3:
                thr[int(rng.integers(0, max_w))] = [0.0, -1.0, np.nan][i % 3]  # no gain through a bad value
            if i % 5 == 1:
                thr = thr[::-1].copy()  # more workers, slower: negative gains
            jobs.append({"id": 1000 * case + i, "min_w": int(rng.integers(1, max_w + 1)), "max_w": max_w,
                         "cpu": float(rng.choice([1.0, 2.0, 4.0, 3.5])), "mem": float(rng.uniform(1, 16)) * GiB,
                         "remaining": float(rng.uniform(1e5, 1e9)), "thr": thr.tolist()})
        cpu_total, mem_total = float(rng.integers(8, 400)), float(rng.integers(32, 1600)) * GiB
        got = OptimusAllocator.allocate(jobs, cpu_total, mem_total)
        want = _allocate_reference(jobs, cpu_total, mem_total)
        assert got == want and list(got) == list(want)  # the same workers, the same keys in the same order


def test_optimus_greedy_gives_workers_and_leaves_room_consistent():
    jobs = [{"id": k, "min_w": 1, "max_w": 8, "cpu": 2.0, "mem": 4 * GiB, "remaining": 1e8,
             "thr": [100.0 * w / (1 + 0.1 * w) for w in range(1, 9)]} for k in range(5)]
    got = OptimusAllocator.allocate(jobs, 20.0, 1000 * GiB)
    assert got == _allocate_reference(jobs, 20.0, 1000 * GiB)
    assert sum(got.values()) * 2.0 <= 20.0 and sum(got.values()) == 10  # the cluster's 10 workers given away
