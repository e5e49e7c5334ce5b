"""Nodes with CPU and memory; a job's pods are placed all together (gang) first-fit, or not at all.

Free capacity lives in numpy arrays: finding the nodes a pod fits on is a vectorised comparison over
windows of nodes in packing order (256, then doubling, until the nodes found hold the pods), and identical
pods (a job's workers) fill a node as far as it holds them before the next node is looked up, so placing a
job costs O(nodes scanned) in C plus O(nodes used) in Python, not O(pods x nodes) in Python, nor a scan of
the whole cluster when the first nodes from where the last pod went have room.
Most placements a scheduling pass tries fail; histograms of the nodes' free cores (whole cores) and free
memory (whole GiB) bound how many pods of a shape the cluster holds in O(node size), so a placement that
cannot succeed is refused before the O(nodes) scan (an upper bound: it never refuses one that fits).
A scheduling pass tries many jobs against an unchanged cluster: the bound per pod size is cached until the
free capacity changes (`version`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GiB = float(1 << 30)


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = 100
    cpu_per_node: float = 32.0
    memory_per_node: float = 128 * GiB

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.cpu_per_node <= 0 or self.memory_per_node <= 0:
            raise ValueError(f"ClusterSpec needs nodes >= 1 and positive capacities, got {self}")


class Cluster:
    def __init__(self, spec: ClusterSpec = ClusterSpec(), bound: bool = True) -> None:
        self.spec = spec
        self.free_cpu = np.full(spec.nodes, float(spec.cpu_per_node))
        self.free_mem = np.full(spec.nodes, float(spec.memory_per_node))
        self.free_cpu_total = float(spec.cpu_per_node) * spec.nodes
        self.free_mem_total = float(spec.memory_per_node) * spec.nodes
        self._start = 0
        self.bound = bound
        # nodes per free-capacity bucket, rounded up (whole cores, whole GiB): the bound in `_may_fit`
        self._kc, self._km = int(np.ceil(spec.cpu_per_node)) + 2, int(np.ceil(spec.memory_per_node / GiB)) + 2
        self._hc = np.bincount(self._bc(self.free_cpu), minlength=self._kc)
        self._hm = np.bincount(self._bm(self.free_mem), minlength=self._km)
        self._vc = np.arange(self._kc, dtype=float) + 1e-6
        self._vm = np.arange(self._km, dtype=float) * GiB + 1.0
        self.version = 0  # bumped on every change of free capacity: the bounds below are valid for one version
        self._limc = _Bound(self._hc, self._vc, spec.nodes)  # the bound per pod size (`fit_limit`)
        self._limm = _Bound(self._hm, self._vm, spec.nodes)

    def _bc(self, fc: np.ndarray) -> np.ndarray:
        # (np.minimum / np.maximum: np.clip's values, at a fraction of its per-call overhead)
        return np.minimum(np.maximum(np.ceil(fc - 1e-7), 0), self._kc - 1).astype(np.int64)

    def _bm(self, fm: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(np.ceil((fm - 1e-3) / GiB), 0), self._km - 1).astype(np.int64)

    def _hist(self, nodes, sign: int) -> None:
        """Take `nodes` (distinct) out of the bucket histograms (sign -1) or put them back (+1)."""
        self.version += 1
        if self.bound:
            if len(nodes) <= _FEW_NODES and self._hist_few(nodes, sign):
                return
            self._hc += sign * np.bincount(self._bc(self.free_cpu[nodes]), minlength=self._kc)
            self._hm += sign * np.bincount(self._bm(self.free_mem[nodes]), minlength=self._km)

    def _hist_few(self, nodes, sign: int) -> bool:
        """`_hist`'s update for a few nodes (a job's pods sit on one to a few) in python: `_bc` / `_bm`'s buckets by
        the same float arithmetic (ceil of the same differences / quotients, clamped), without ~20 numpy calls.
        False (nothing changed) when a value is not finite: the numpy path decides those."""
        try:
            kc, km = self._kc - 1, self._km - 1
            bc = [min(max(math.ceil(f - 1e-7), 0), kc) for f in self.free_cpu[nodes].tolist()]
            bm = [min(max(math.ceil((f - 1e-3) / GiB), 0), km) for f in self.free_mem[nodes].tolist()]
        except (OverflowError, ValueError):  # inf / nan
            return False
        hc, hm = self._hc, self._hm
        for b in bc:
            hc[b] += sign
        for b in bm:
            hm[b] += sign
        return True

    def _set_few(self, nodes, oc: list[float], om: list[float], nc: list[float], nm: list[float]) -> bool:
        """free[nodes] = (nc, nm) for a few distinct nodes now at (oc, om), the bucket histograms moved in python:
        what `_hist(nodes, -1)`, the change and `_hist(nodes, 1)` leave (`_hist_few`'s buckets of the old and the new
        values; a node whose buckets did not change is not touched). False (nothing changed) when a value is not
        finite: the numpy path decides those."""
        try:
            kc, km = self._kc - 1, self._km - 1
            boc = [min(max(math.ceil(f - 1e-7), 0), kc) for f in oc]
            bnc = [min(max(math.ceil(f - 1e-7), 0), kc) for f in nc]
            bom = [min(max(math.ceil((f - 1e-3) / GiB), 0), km) for f in om]
            bnm = [min(max(math.ceil((f - 1e-3) / GiB), 0), km) for f in nm]
        except (OverflowError, ValueError):  # inf / nan
            return False
        self.version += 2  # (as the two `_hist` calls)
        hc, hm = self._hc, self._hm
        for a, b in zip(boc, bnc, strict=True):
            if a != b:
                hc[a] -= 1
                hc[b] += 1
        for a, b in zip(bom, bnm, strict=True):
            if a != b:
                hm[a] -= 1
                hm[b] += 1
        self.free_cpu[nodes] = nc
        self.free_mem[nodes] = nm
        return True

    def _change(self, nodes, dc, dm) -> None:
        """free[nodes] += (dc, dm) for distinct nodes, keeping the bucket histograms in step (a few nodes: the same
        float sums in python, `_set_few`)."""
        if (self.bound and len(nodes) <= _FEW_NODES and type(dc) is np.ndarray and type(dm) is np.ndarray
                and dc.shape == dm.shape == (len(nodes),)):
            oc, om = self.free_cpu[nodes].tolist(), self.free_mem[nodes].tolist()
            nc = [a + b for a, b in zip(oc, dc.tolist(), strict=True)]
            nm = [a + b for a, b in zip(om, dm.tolist(), strict=True)]
            if self._set_few(nodes, oc, om, nc, nm):
                return
        self._hist(nodes, -1)
        self.free_cpu[nodes] += dc
        self.free_mem[nodes] += dm
        self._hist(nodes, 1)

    def _per_pod(self, pods: list[tuple[float, float]], where: list[int], sign: int) -> None:
        nodes = sorted(set(where))
        if self.bound and len(nodes) <= _FEW_NODES:  # python floats: the same sums, pod by pod, in the same order
            oc, om = self.free_cpu[nodes].tolist(), self.free_mem[nodes].tolist()
            at = {j: i for i, j in enumerate(nodes)}
            nc, nm = oc[:], om[:]
            for (c, m), j in zip(pods, where, strict=True):
                i = at[j]
                nc[i] += sign * c
                nm[i] += sign * m
            if self._set_few(nodes, oc, om, nc, nm):
                return
        self._hist(nodes, -1)
        for (c, m), j in zip(pods, where, strict=True):  # one pod at a time: the same float sums as ever
            self.free_cpu[j] += sign * c
            self.free_mem[j] += sign * m
        self._hist(nodes, 1)

    def _may_fit(self, c: float, m: float, n: int) -> bool:
        """False when `n` pods of (c cores, m bytes) cannot fit, by the buckets (rounded up: a bound)."""
        return n <= self.fit_limit(c, m)

    def fit_limit(self, c: float, m: float) -> float:
        """The most identical pods of (c cores, m bytes) the bucket bound lets through (the sum over the nodes of how
        many such pods each node's buckets hold, the smaller of the core and memory counts; inf without the bound, or
        for a pod of neither): per pod size, evaluated once per version (`_Bound`); a scheduling pass reads it once
        per pod shape and version, `_may_fit` is `n <= fit_limit(c, m)`."""
        if not self.bound:
            return math.inf
        lim = math.inf
        if c > 0:
            lim = self._limc.limit(c, self.version)
        if m > 0:
            lim = min(lim, self._limm.limit(m, self.version))
        return lim

    def over_limit(self, c: float, m: float, n: int) -> bool:
        """`n > fit_limit(c, m)`, the memory bound read only when the core bound lets `n` through (a scheduling
        pass's waiting jobs share a few core sizes, each bound once per version, but have distinct memory sizes)."""
        if not self.bound:
            return False
        if c > 0 and n > self._limc.limit(c, self.version):
            return True
        return m > 0 and n > self._limm.limit(m, self.version)

    @property
    def capacity_cpu(self) -> float:
        return self.spec.nodes * self.spec.cpu_per_node

    @property
    def capacity_memory(self) -> float:
        return self.spec.nodes * self.spec.memory_per_node

    def fits_at_all(self, pods: list[tuple[float, float]]) -> bool:
        return all(c <= self.spec.cpu_per_node and m <= self.spec.memory_per_node for c, m in pods)

    def refuses(self, c: float, m: float, n: int) -> bool:
        """True when `place` refuses `n` identical pods of (c cores, m bytes) before looking for nodes (more than
        the free totals, or more than the bucket bound holds): `place([(c, m)] * n)` is then None, nothing taken."""
        return (c * n > self.free_cpu_total + 1e-6 or m * n > self.free_mem_total + 1.0
                or (self.bound and not self._may_fit(c, m, n)))

    def place(self, pods: list[tuple[float, float]]) -> list[int] | None:
        """Node index per pod (largest pods first), or None (and nothing taken) when they do not all fit."""
        groups: dict[tuple[float, float], list[int]] = {}
        if pods and pods.count(pods[0]) == len(pods):  # a workers-only job: one shape (list.count runs in C)
            (c0, m0), n0 = pods[0], len(pods)
            if self.refuses(c0, m0, n0):
                return None  # (the checks below, without building the groups: most placements tried fail here)
            return self._place_one_shape(c0, m0, n0)
        else:
            for i, pm in enumerate(pods):
                groups.setdefault(pm, []).append(i)
        tc = sum(c * len(ix) for (c, _), ix in groups.items())
        tm = sum(m * len(ix) for (_, m), ix in groups.items())
        if tc > self.free_cpu_total + 1e-6 or tm > self.free_mem_total + 1.0:
            return None
        if self.bound and not all(self._may_fit(c, m, len(ix)) for (c, m), ix in groups.items()):
            return None
        taken: list[tuple[np.ndarray, float, float, np.ndarray]] = []
        where = [0] * len(pods)
        start = self._start
        for (c, m) in sorted(groups, key=lambda k: (-k[0], -k[1])):
            idx = groups[(c, m)]
            cand, cap = self._first_fit(c, m, len(idx), start)
            if len(cand):
                cum = np.cumsum(cap)
            if not len(cand) or cum[-1] < len(idx):
                self._undo(taken)
                return None
            last = int(np.searchsorted(cum, len(idx)))  # the first nodes in order hold them all
            nodes, k = cand[: last + 1], cap[: last + 1].copy()
            k[-1] -= int(cum[last]) - len(idx)
            self._change(nodes, -c * k, -m * k)
            taken.append((nodes, c, m, k))
            for i, j in zip(idx, np.repeat(nodes, k).tolist(), strict=True):
                where[i] = j
            start = int(nodes[-1])
        self._start = start
        self.free_cpu_total -= tc
        self.free_mem_total -= tm
        return where

    def _place_one_shape(self, c: float, m: float, n: int) -> list[int] | None:
        """`place`'s loop for `n` identical pods that `refuses` let through (so its totals and bound checks pass: they
        are the same comparisons): one group, the same nodes, counts, updates and totals."""
        cand, cap = self._first_fit(c, m, n, self._start)
        if not len(cand):
            return None
        cum = np.cumsum(cap)
        if cum[-1] < n:
            return None
        last = int(np.searchsorted(cum, n))  # the first nodes in order hold them all
        nodes, k = cand[: last + 1], cap[: last + 1].copy()
        k[-1] -= int(cum[last]) - n
        self._change(nodes, -c * k, -m * k)
        where = np.repeat(nodes, k).tolist()
        self._start = int(nodes[-1])
        self.free_cpu_total -= 0.0 + c * n  # (what `sum` of the one group's c * n gives: 0.0 + c * n)
        self.free_mem_total -= 0.0 + m * n
        return where

    def _first_fit(self, c: float, m: float, n: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """The nodes a (c cores, m bytes) pod fits on, in packing order (from `start` round to it), and how many of
        `n` such pods each holds, far enough along that order to hold all `n` (or every such node when they
        cannot): scanned in growing windows from `start`, not the whole cluster per placement. The nodes and
        counts of `_first_fit_reference`, cut where the remaining ones cannot be needed."""
        fc, fm = self.free_cpu, self.free_mem
        total = len(fc)
        if total <= _FIRST_WINDOW:
            return _first_fit_reference(fc, fm, c, m, n, start)
        cands: list[np.ndarray] = []
        caps: list[np.ndarray] = []
        held, size = 0, _FIRST_WINDOW
        # the packing order as ranges: [start, total), then [0, start)
        for lo0, hi0 in ((start, total), (0, start)):
            lo = lo0
            while lo < hi0 and held < n:
                hi = min(lo + size, hi0)
                size *= 2
                sc, sm = fc[lo:hi], fm[lo:hi]
                cand = ((sc >= c - 1e-9) & (sm >= m - 1e-3)).nonzero()[0]  # (np.flatnonzero of a 1-d array)
                if len(cand):
                    # min(n, cores' count, memory's count): the same integers, fewer numpy calls
                    if c > 0:
                        cap = ((sc[cand] + 1e-9) // c).astype(np.int64)
                        if m > 0:
                            np.minimum(cap, ((sm[cand] + 1e-3) // m).astype(np.int64), out=cap)
                        np.minimum(cap, n, out=cap)
                    elif m > 0:
                        cap = ((sm[cand] + 1e-3) // m).astype(np.int64)
                        np.minimum(cap, n, out=cap)
                    else:
                        cap = np.full(len(cand), n, dtype=np.int64)
                    cands.append(cand + lo)
                    caps.append(cap)
                    held += int(cap.sum())
                lo = hi
        if not cands:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if len(cands) == 1:
            return cands[0], caps[0]
        return np.concatenate(cands), np.concatenate(caps)

    def _undo(self, taken: list[tuple[np.ndarray, float, float, np.ndarray]]) -> None:
        for nodes, c, m, k in taken:
            self._change(nodes, c * k, m * k)

    def take(self, pods: list[tuple[float, float]], where: list[int]) -> None:
        """Put pods back exactly where they were (a resize that did not fit keeps the old placement)."""
        self._per_pod(pods, where, -1)
        self.free_cpu_total -= sum(c for c, _ in pods)
        self.free_mem_total -= sum(m for _, m in pods)

    def release(self, pods: list[tuple[float, float]], where: list[int]) -> None:
        self._per_pod(pods, where, 1)
        self.free_cpu_total += sum(c for c, _ in pods)
        self.free_mem_total += sum(m for _, m in pods)


class _Bound:
    """One resource's bucket bound per pod size x: sum over the buckets b of hist[b] * floor(vals[b] / x) (`hist`:
    the cluster's histogram of the nodes' free amounts rounded up, updated in place; `vals`: each bucket's amount with
    the bound's margin), the value `int(hist @ np.floor(vals / x))` gives.

    Each size's per-bucket counts are kept as an int64 array, so a new version costs one integer dot product
    (`ndarray.dot`: ~0.6 us, where the float evaluation's four numpy calls cost ~8 us; a scheduling pass after every
    resize asks the bound of ~40 waiting jobs' sizes, each at a new version). Exact: kept only when every partial sum
    stays below 2**53 (the largest count times the nodes), where the float64 dot product is exact as well; other sizes
    are evaluated as before, every time."""

    __slots__ = ("hist", "vals", "nodes", "cache")

    def __init__(self, hist: np.ndarray, vals: np.ndarray, nodes: int) -> None:
        self.hist, self.vals, self.nodes = hist, vals, nodes
        self.cache: dict[float, list] = {}  # x -> [bound, the version it is for, per-bucket counts (int64)]

    def limit(self, x: float, version: int) -> int:
        e = self.cache.get(x)
        if e is not None:
            if e[1] != version:
                e[0], e[1] = int(self.hist.dot(e[2])), version
            return e[0]
        fl = np.floor(self.vals / x)
        cnt = int(self.hist @ fl)
        if fl[-1] * self.nodes < 2.0 ** 53:  # (vals ascend: fl[-1] is the largest count)
            if len(self.cache) >= _CACHE_MAX:
                self.cache.clear()
            self.cache[x] = [cnt, version, fl.astype(np.int64)]
        return cnt


_CACHE_MAX = 1 << 14  # pod sizes a `_Bound` keeps (then forgotten)
_FEW_NODES = 12  # `_hist` updates at most this many nodes in python (`_hist_few`), more with numpy
_FIRST_WINDOW = 256  # nodes in `_first_fit`'s first window (doubled per window); a smaller cluster is one scan


def _first_fit_reference(fc: np.ndarray, fm: np.ndarray, c: float, m: float, n: int,
                         start: int) -> tuple[np.ndarray, np.ndarray]:
    """Every node a (c cores, m bytes) pod fits on, in packing order (the first at or after `start`, round to it),
    and how many of `n` such pods each holds: one scan of the whole cluster (`Cluster._first_fit` cuts it short)."""
    cand = np.flatnonzero((fc >= c - 1e-9) & (fm >= m - 1e-3))
    if not len(cand):
        return cand, np.zeros(0, dtype=np.int64)
    k0 = int(np.searchsorted(cand, start))  # pack: keep filling from where the last pod went
    cand = np.concatenate([cand[k0:], cand[:k0]])
    cap = np.full(len(cand), n, dtype=np.int64)  # how many of these pods each node holds
    if c > 0:
        cap = np.minimum(cap, ((fc[cand] + 1e-9) // c).astype(np.int64))
    if m > 0:
        cap = np.minimum(cap, ((fm[cand] + 1e-3) // m).astype(np.int64))
    return cand, cap
