"""The seventh session's simulator speed-ups (issue 17: Optimus at 100,000 jobs) against their references: each fast
path gives the same values / events, bit for bit (a 1k and a 10k Optimus run were checked equal by hashing every
job's result, the JCT list, the decision counts and the utilization totals; tests/unit/test_simulate_scale.py replays
120 jobs per policy)."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from recforge.elastic.optimizer import Observation, PodPlan
from recforge.elastic.optimizer.models.throughput_model import ThroughputModel
from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy, truth
from recforge.elastic.simulate import engine as engine_mod
from recforge.elastic.simulate.cluster import Cluster, GiB
from recforge.elastic.simulate.engine import Simulation
from recforge.elastic.simulate.policies import (
    TR_TERMS,
    OptimusPolicySim,
    _OptimusJob,
    _tr_coef,
    fit_convergence,
    fit_convergence_many,
)


# ---- Optimus's convergence fits, many curves at once -----------------------------------------------------------
def _curves(rng, count):
    ks, losses = [], []
    for i in range(count):
        n = 30 if i % 3 else int(rng.integers(0, 31))
        k = np.sort(rng.random(n) * rng.integers(1, 100))
        b0, b1, b2 = rng.random(3) * [2, 1, 0.5] + [0.01, 0.1, 0.05]
        loss = (1 / (b0 * k + b1) + b2) * (1 + 0.01 * rng.standard_normal(n))
        if i % 17 == 0:
            loss = loss[::-1].copy()  # rising loss: no decreasing fit (None)
        if i % 23 == 0 and n:
            k = np.full(n, 2.0)  # no spread in k (None)
        ks.append(k.tolist())
        losses.append(loss.tolist())
    return ks, losses


@pytest.mark.parametrize("grid", [32, 2, 1, 64, 100])
def test_fit_convergence_many_equals_one_curve_at_a_time(grid):
    rng = np.random.default_rng(grid)
    ks, losses = _curves(rng, 700)  # > 64 curves of length 30: several blocks of one length
    got = fit_convergence_many(ks, losses, grid)
    want = [fit_convergence(np.array(k), np.array(lo), grid) if len(k) >= 3 else None
            for k, lo in zip(ks, losses, strict=True)]
    assert got == want  # exactly: the same floats, the same Nones
    assert sum(w is None for w in want) > 20 and sum(w is not None for w in want) > 400


def test_fit_convergence_many_checks_its_input():
    assert fit_convergence_many([], []) == []
    with pytest.raises(ValueError, match="2 k sequences but 1 loss"):
        fit_convergence_many([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]])
    with pytest.raises(ValueError, match="curve 1 has 3 k values but 2 losses"):
        fit_convergence_many([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], [[3.0, 2.0, 1.5], [3.0, 2.0]])


def test_optimus_coefficients_are_reread_when_the_model_changes():
    st = _OptimusJob.__new__(_OptimusJob)
    st.coef_of, st.coef = (None, None, None), []
    m1 = ThroughputModel(("const", "log_w"), (0.1, 0.2))
    assert _tr_coef(st, m1) == [0.1, 0.0, 0.2]
    m1.coef = (0.3, 0.4)  # replaced on the same object: read again
    assert _tr_coef(st, m1) == [0.3, 0.0, 0.4]
    m2 = ThroughputModel(TR_TERMS, (0.5, 0.6, 0.7))
    assert _tr_coef(st, m2) == [0.5, 0.6, 0.7]


# ---- the engine: one event per rate change, Optimus's reports without the Observation --------------------------
def _small(policy: str, eviction: float, horizon_h: float = 24 * 60.0):
    tp = TraceParams(shape="torchrec", n_jobs=150, arrival_window_h=24.0)
    trace = generate_trace(tp, seed=2)
    return Simulation(trace, make_policy(policy), ClusterSpec(nodes=10),
                      SimParams(eviction_per_node_h=eviction, horizon_s=horizon_h * 3600.0), seed=2)


def _run_logged(sim: Simulation):
    """Run, logging every event a handler processed, and the heap's largest size."""
    log: list[tuple] = []
    biggest = [0]
    for name in ("_arrive", "_tick", "_resume", "_finish", "_oom", "_evict", "_pending_check", "_realloc"):
        fn = getattr(sim, name)

        def wrapped(key, t, fn=fn, name=name):
            log.append((t, name, key))
            biggest[0] = max(biggest[0], len(sim.heap))
            return fn(key, t)
        setattr(sim, name, wrapped)
    r = sim.run()
    return log, r, biggest[0]


@pytest.mark.parametrize("policy", ["static", "optimus", "dlrover"])
@pytest.mark.parametrize("eviction,horizon_h", [(0.0, 24 * 60.0), (0.05, 24 * 60.0), (0.05, 20.0)])
def test_one_event_per_rate_change_processes_the_same_events(policy, eviction, horizon_h):
    ref = _small(policy, eviction, horizon_h)
    ref.every_event = True  # the reference: finish, OOM and tick pushed every time (later ones skipped as stale)
    fast = _small(policy, eviction, horizon_h)
    log_ref, r_ref, heap_ref = _run_logged(ref)
    log_fast, r_fast, heap_fast = _run_logged(fast)
    assert log_fast == log_ref
    assert r_fast == r_ref or json_equal(r_fast, r_ref)
    assert ref.events == fast.events and ref.acc == fast.acc
    assert heap_fast < heap_ref  # what the change is for: the stale events are not in the heap
    if eviction:
        assert any(k == "_evict" for _, k, _ in log_ref)
    assert any(k == "_finish" for _, k, _ in log_ref) and any(k == "_tick" for _, k, _ in log_ref)


def json_equal(a, b) -> bool:
    """Equal, NaN equal to NaN (a result's metrics are NaN when nothing completed)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_optimus_rate_reports_equal_full_observations():
    full = _small("optimus", 0.02)
    full.full_reports = True  # the reference: the Observation built and passed to `on_tick`
    fast = _small("optimus", 0.02)
    log_full, r_full, _ = _run_logged(full)
    log_fast, r_fast, _ = _run_logged(fast)
    assert log_fast == log_full and json_equal(r_fast, r_full)
    assert r_full["plan_changes"] > 20  # Optimus resized jobs: its models and curves drove decisions


def test_on_rate_keeps_the_state_on_tick_keeps():
    trace = generate_trace(TraceParams(shape="torchrec", n_jobs=4), seed=1)
    a, b = OptimusPolicySim(), OptimusPolicySim()
    sim = Simulation(trace, a, ClusterSpec(nodes=4))
    for j in trace:
        sim._arrive(j.job_id, j.arrival_s)
    b.jobs = copy.deepcopy(a.jobs)
    for tick in range(12):
        for j in trace:
            plan = PodPlan(workers=1 + tick % 3, cpu_per_worker=4.0, memory_per_worker=(20 + tick) * GiB)
            rate, mem = 100.0 + tick * j.job_id, (5.0 + tick) * GiB
            a.on_tick(j, Observation(time_s=tick * 300.0, plan=plan, samples_per_s=rate, worker_memory=[mem] * 3))
            b.on_rate(j, plan, rate, mem)
    for jid in a.jobs:
        sa, sb = a.jobs[jid], b.jobs[jid]
        assert [(s.allocation, s.samples_per_s) for s in sa.model.samples] == \
               [(s.allocation, s.samples_per_s) for s in sb.model.samples]
        assert (sa.min_w, sa.memory_known) == (sb.min_w, sb.memory_known)


# ---- the cluster: histogram updates for a few nodes, the up-front refusal --------------------------------------
def test_few_node_histogram_update_equals_numpy():
    rng = np.random.default_rng(5)
    spec = ClusterSpec(nodes=40, cpu_per_node=32.0, memory_per_node=128 * GiB)
    for trial in range(300):
        fast = Cluster(spec)
        # values on and next to the bucket edges (whole cores, whole GiB) as well as random ones
        fc = rng.choice([0.0, 1e-8, 3.0, 3.0 + 2e-7, 3.0 - 2e-7, 31.5, 32.0, 33.0, -1.0]) * np.ones(40)
        fc = np.where(rng.random(40) < 0.5, fc, rng.random(40) * 34 - 1)
        fm = rng.choice([0.0, 5e-4, 1.0, 7 * GiB, 7 * GiB + 2e-3, 7 * GiB - 2e-3, 128 * GiB, 130 * GiB]) * np.ones(40)
        fm = np.where(rng.random(40) < 0.5, fm, rng.random(40) * 130 * GiB)
        every = np.arange(40)
        fast._hist(every, -1)  # (numpy path: more than a few nodes)
        fast.free_cpu[:], fast.free_mem[:] = fc, fm
        fast._hist(every, 1)
        nodes = sorted(rng.choice(40, size=int(rng.integers(1, 13)), replace=False).tolist())
        slow = copy.deepcopy(fast)
        assert fast._hist_few(nodes, -1)
        slow._hc -= np.bincount(slow._bc(slow.free_cpu[nodes]), minlength=slow._kc)
        slow._hm -= np.bincount(slow._bm(slow.free_mem[nodes]), minlength=slow._km)
        assert np.array_equal(fast._hc, slow._hc) and np.array_equal(fast._hm, slow._hm), trial
        assert np.array_equal(fast._hc + np.bincount(fast._bc(fc[nodes]), minlength=fast._kc),
                              np.bincount(fast._bc(fc), minlength=fast._kc))
    bad = Cluster(spec)
    bad.free_cpu[3] = np.inf
    hc = bad._hc.copy()
    assert not bad._hist_few([2, 3], -1) and np.array_equal(bad._hc, hc)  # not finite: nothing changed, numpy decides


def test_histograms_stay_in_step_through_placements_on_few_and_many_nodes():
    rng = np.random.default_rng(11)
    cl = Cluster(ClusterSpec(nodes=60, cpu_per_node=32.0, memory_per_node=128 * GiB))
    held = []
    for step in range(1500):
        if held and rng.random() < 0.45:
            pods, where = held.pop(int(rng.integers(len(held))))
            cl.release(pods, where)
        else:
            pod = (float(rng.choice([0.5, 1.0, 3.0, 8.0, 16.0])), float(rng.uniform(0.5, 60)) * GiB)
            pods = [pod] * int(rng.choice([1, 2, 5, 20, 40]))  # up to 40 pods: many nodes in one update
            where = cl.place(pods)
            if where is not None:
                held.append((pods, where))
        assert np.array_equal(cl._hc, np.bincount(cl._bc(cl.free_cpu), minlength=cl._kc)), step
        assert np.array_equal(cl._hm, np.bincount(cl._bm(cl.free_mem), minlength=cl._km)), step


def test_refuses_means_place_refuses_and_takes_nothing():
    rng = np.random.default_rng(2)
    refused = placed = 0
    for _ in range(400):
        cl = Cluster(ClusterSpec(nodes=8, cpu_per_node=32.0, memory_per_node=128 * GiB))
        for _ in range(int(rng.integers(0, 12))):
            cl.place([(float(rng.integers(1, 17)), float(rng.uniform(1, 64)) * GiB)] * int(rng.integers(1, 6)))
        c, m, n = float(rng.choice([1.0, 4.0, 8.0, 30.0])), float(rng.uniform(1, 100)) * GiB, int(rng.integers(1, 30))
        before = (cl.free_cpu.copy(), cl.free_mem.copy(), cl.free_cpu_total)
        if cl.refuses(c, m, n):
            refused += 1
            assert cl.place([(c, m)] * n) is None
            assert np.array_equal(cl.free_cpu, before[0]) and cl.free_cpu_total == before[2]
        else:
            placed += cl.place([(c, m)] * n) is not None
    assert refused > 50 and placed > 50


def test_schedule_pending_with_refusal_starts_the_same_jobs(monkeypatch):
    """The pass's up-front refusal against the pass trying every job through `place`."""
    runs = {}
    for name, refuses in (("fast", Cluster.refuses), ("slow", lambda self, c, m, n: False)):
        monkeypatch.setattr(Cluster, "refuses", refuses)
        sim = _small("static", 0.0)
        log, r, _ = _run_logged(sim)
        runs[name] = (log, r)
    monkeypatch.undo()
    assert runs["fast"][0] == runs["slow"][0] and json_equal(runs["fast"][1], runs["slow"][1])
    assert sum(k == "_pending_check" for _, k, _ in runs["slow"][0]) > 20  # jobs waited: passes tried and missed


@pytest.mark.parametrize("case", ["finish_first", "finish_at_tick", "tick_first", "oom_first"])
def test_set_rate_pushes_the_first_of_the_reference_events(case):
    """`_set_rate` pushes the one event of (finish, OOM, tick) that comes first in (time, push order), a finish at the
    tick's time included: the reference pushes all of them, in that order, and only that one can run."""
    heaps = []
    for every in (True, False):
        sim = _small("static", 0.0)
        sim.every_event = every
        j = sim.trace[0]
        sim._arrive(j.job_id, j.arrival_s)
        r = sim.runs[j.job_id]
        assert r.status == "running"
        t = r.resume_at + 10.0  # past the start-up pause: the rate is the job's own
        r.rate_at = (r.plan, 1.0, 1024.0, 1.0)  # (`_truth`'s cache) the rate, exactly 1024 samples/s
        seconds_left = {"finish_first": 100, "finish_at_tick": 300, "tick_first": 1000, "oom_first": 1000}[case]
        r.done = j.total_samples - 1024.0 * seconds_left  # (exact: whole numbers of samples)
        p = r.plan
        room = p.memory_per_worker - truth.tr_worker_memory(j.worker_mem, j.emb_bytes, p.workers)
        # the most loaded shard passes the pod's memory 150 s from now (oom_first) or never
        j.emb_growth_per_sample = (room / (r.done + 1024.0 * 150) * p.workers / truth.SHARD_SKEW
                                   if case == "oom_first" else 0.0)
        sim.heap.clear()
        sim._set_rate(r, t)
        heaps.append(sorted(sim.heap))
    ref, fast = heaps
    assert len(ref) == (3 if case == "oom_first" else 2) and len(fast) == 1
    assert fast[0][0] == ref[0][0] and fast[0][2:] == ref[0][2:]  # the reference's first, but for its sequence number
    kinds = {engine_mod.FINISH: "finish", engine_mod.OOM: "oom", engine_mod.TICK: "tick"}
    assert kinds[fast[0][2]] == {"finish_first": "finish", "finish_at_tick": "finish", "tick_first": "tick",
                                 "oom_first": "oom"}[case]
    if case == "finish_at_tick":
        assert ref[0][0] == ref[1][0]  # a tie in time, decided by the push order
