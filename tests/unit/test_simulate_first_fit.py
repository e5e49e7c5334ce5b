"""The cluster's windowed first-fit scan (issue 17, sixth session) against the whole-cluster scan it replaces: the
same nodes in the same packing order and the same pods per node, as far as a placement reads them, and the same
placements (`Cluster.place` with the windowed scan against a copy of the cluster placing with the reference)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from recforge.elastic.simulate import cluster as cluster_mod
from recforge.elastic.simulate.cluster import Cluster, ClusterSpec, GiB, _first_fit_reference


def _random_cluster(nodes: int, rng: np.random.Generator, full: float) -> Cluster:
    cl = Cluster(ClusterSpec(nodes=nodes))
    busy = rng.random(nodes) < full  # a share of the nodes (nearly) full, the rest random
    fc = np.where(busy, rng.integers(0, 2, nodes), rng.integers(0, 33, nodes)).astype(float)
    fm = np.where(busy, rng.integers(0, 3, nodes), rng.integers(0, 129, nodes)) * GiB
    every = np.arange(nodes)
    cl._hist(every, -1)
    cl.free_cpu[:], cl.free_mem[:] = fc, fm
    cl._hist(every, 1)
    cl.free_cpu_total, cl.free_mem_total = float(fc.sum()), float(fm.sum())
    return cl


def _cut(cand: np.ndarray, cap: np.ndarray, n: int) -> tuple[list[int], list[int]]:
    """What a placement reads: the nodes and counts up to the first prefix that holds `n` (all when none does)."""
    cum = np.cumsum(cap)
    if not len(cum) or cum[-1] < n:
        return cand.tolist(), cap.tolist()
    last = int(np.searchsorted(cum, n))
    return cand[: last + 1].tolist(), cap[: last + 1].tolist()


@pytest.mark.parametrize("nodes", [1, 100, 256, 257, 1000, 5000])
def test_windowed_first_fit_reads_what_the_whole_scan_gives(nodes):
    rng = np.random.default_rng(nodes)
    for trial in range(300):
        cl = _random_cluster(nodes, rng, full=[0.0, 0.5, 0.9, 0.99][trial % 4])
        c = float(rng.choice([0.0, 0.5, 1.0, 2.0, 4.0, 7.0, 16.0, 32.0, 33.0]))
        m = float(rng.choice([0.0, 1.0, 4.0, 16.0, 100.0, 129.0])) * GiB
        if c == 0 and m == 0:
            c = 1.0
        n = int(rng.choice([1, 2, 3, 8, 64, 1000, 10**6]))
        start = int(rng.integers(0, nodes))
        got = cl._first_fit(c, m, n, start)
        want = _first_fit_reference(cl.free_cpu, cl.free_mem, c, m, n, start)
        assert _cut(*got, n) == _cut(*want, n), (nodes, trial, c, m, n, start)
        if np.cumsum(want[1])[-1:].tolist() < [n]:  # the pods do not fit: the windowed scan saw every node
            assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_place_equals_placing_with_the_whole_scan(monkeypatch):
    rng = np.random.default_rng(7)
    fast = _random_cluster(3000, rng, full=0.6)
    slow = copy.deepcopy(fast)
    slow_ff = lambda self, c, m, n, start: _first_fit_reference(self.free_cpu, self.free_mem, c, m, n, start)  # noqa: E731
    live: list[tuple[list, list]] = []
    for step in range(2000):
        if live and rng.random() < 0.45:
            pods, where = live.pop(int(rng.integers(0, len(live))))
            fast.release(pods, where)
            slow.release(pods, where)
            continue
        shape = (float(rng.choice([1.0, 2.0, 4.0, 8.0])), float(rng.choice([2.0, 8.0, 32.0])) * GiB)
        pods = [shape] * int(rng.integers(1, 40))
        if rng.random() < 0.3:  # a parameter-server job: two shapes
            pods = pods + [(2.0, 16.0 * GiB)] * int(rng.integers(1, 4))
        got = fast.place(pods)
        with monkeypatch.context() as mp:
            mp.setattr(cluster_mod.Cluster, "_first_fit", slow_ff)
            want = slow.place(pods)
        assert got == want, step
        assert np.array_equal(fast.free_cpu, slow.free_cpu) and np.array_equal(fast.free_mem, slow.free_mem)
        assert fast._start == slow._start
        if got is not None:
            live.append((pods, got))
    assert len(live) > 10  # placements succeeded as well as failed
