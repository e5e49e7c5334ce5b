"""Nodes with CPU and memory; a job's pods are placed all together (gang) first-fit, or not at all.

Free capacity lives in numpy arrays: finding the nodes a pod fits on is one vectorised comparison, and
identical pods (a job's workers) fill a node as far as it holds them before the next node is looked up,
so placing a job costs O(nodes) in C plus O(nodes used) in Python, not O(pods x nodes) in Python.
"""
from __future__ import annotations

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
    def __init__(self, spec: ClusterSpec = ClusterSpec()) -> None:
        self.spec = spec
        self.free_cpu = np.full(spec.nodes, float(spec.cpu_per_node))
        self.free_mem = np.full(spec.nodes, float(spec.memory_per_node))
        self.free_cpu_total = float(spec.cpu_per_node) * spec.nodes
        self.free_mem_total = float(spec.memory_per_node) * spec.nodes
        self._start = 0

    @property
    def capacity_cpu(self) -> float:
        return self.spec.nodes * self.spec.cpu_per_node

    @property
    def capacity_memory(self) -> float:
        return self.spec.nodes * self.spec.memory_per_node

    def fits_at_all(self, pods: list[tuple[float, float]]) -> bool:
        return all(c <= self.spec.cpu_per_node and m <= self.spec.memory_per_node for c, m in pods)

    def place(self, pods: list[tuple[float, float]]) -> list[int] | None:
        """Node index per pod (largest pods first), or None (and nothing taken) when they do not all fit."""
        groups: dict[tuple[float, float], list[int]] = {}
        if pods and pods.count(pods[0]) == len(pods):  # a workers-only job: one shape (list.count runs in C)
            groups[pods[0]] = list(range(len(pods)))
        else:
            for i, pm in enumerate(pods):
                groups.setdefault(pm, []).append(i)
        tc = sum(c * len(ix) for (c, _), ix in groups.items())
        tm = sum(m * len(ix) for (_, m), ix in groups.items())
        if tc > self.free_cpu_total + 1e-6 or tm > self.free_mem_total + 1.0:
            return None
        fc, fm = self.free_cpu, self.free_mem
        taken: list[tuple[np.ndarray, float, float, np.ndarray]] = []
        where = [0] * len(pods)
        start = self._start
        for (c, m) in sorted(groups, key=lambda k: (-k[0], -k[1])):
            idx = groups[(c, m)]
            cand = np.flatnonzero((fc >= c - 1e-9) & (fm >= m - 1e-3))
            if len(cand):
                k0 = int(np.searchsorted(cand, start))  # pack: keep filling from where the last pod went
                cand = np.concatenate([cand[k0:], cand[:k0]])
                cap = np.full(len(cand), len(idx), dtype=np.int64)  # how many of these pods each node holds
                if c > 0:
                    cap = np.minimum(cap, ((fc[cand] + 1e-9) // c).astype(np.int64))
                if m > 0:
                    cap = np.minimum(cap, ((fm[cand] + 1e-3) // m).astype(np.int64))
                cum = np.cumsum(cap)
            if not len(cand) or cum[-1] < len(idx):
                self._undo(taken)
                return None
            last = int(np.searchsorted(cum, len(idx)))  # the first nodes in order hold them all
            nodes, k = cand[: last + 1], cap[: last + 1].copy()
            k[-1] -= int(cum[last]) - len(idx)
            fc[nodes] -= c * k
            fm[nodes] -= m * k
            taken.append((nodes, c, m, k))
            for i, j in zip(idx, np.repeat(nodes, k).tolist(), strict=True):
                where[i] = j
            start = int(nodes[-1])
        self._start = start
        self.free_cpu_total -= tc
        self.free_mem_total -= tm
        return where

    def _undo(self, taken: list[tuple[np.ndarray, float, float, np.ndarray]]) -> None:
        for nodes, c, m, k in taken:
            self.free_cpu[nodes] += c * k
            self.free_mem[nodes] += m * k

    def take(self, pods: list[tuple[float, float]], where: list[int]) -> None:
        """Put pods back exactly where they were (a resize that did not fit keeps the old placement)."""
        for (c, m), j in zip(pods, where, strict=True):
            self.free_cpu[j] -= c
            self.free_mem[j] -= m
        self.free_cpu_total -= sum(c for c, _ in pods)
        self.free_mem_total -= sum(m for _, m in pods)

    def release(self, pods: list[tuple[float, float]], where: list[int]) -> None:
        for (c, m), j in zip(pods, where, strict=True):
            self.free_cpu[j] += c
            self.free_mem[j] += m
        self.free_cpu_total += sum(c for c, _ in pods)
        self.free_mem_total += sum(m for _, m in pods)
