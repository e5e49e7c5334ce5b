"""Nodes with CPU and memory; a job's pods are placed all together (gang) first-fit, or not at all."""
from __future__ import annotations

from dataclasses import dataclass

GiB = float(1 << 30)


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = 100
    cpu_per_node: float = 32.0
    memory_per_node: float = 128 * GiB


class Cluster:
    def __init__(self, spec: ClusterSpec = ClusterSpec()) -> None:
        self.spec = spec
        self.free_cpu = [spec.cpu_per_node] * spec.nodes
        self.free_mem = [spec.memory_per_node] * spec.nodes

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
        order = sorted(range(len(pods)), key=lambda i: (-pods[i][0], -pods[i][1]))
        taken: list[tuple[int, float, float]] = []
        where = [0] * len(pods)
        fc, fm = self.free_cpu, self.free_mem
        n = len(fc)
        start = 0
        for i in order:
            c, m = pods[i]
            for k in range(n):
                j = (start + k) % n
                if fc[j] >= c - 1e-9 and fm[j] >= m - 1e-3:
                    fc[j] -= c
                    fm[j] -= m
                    taken.append((j, c, m))
                    where[i] = j
                    start = j  # pack: keep filling the same node before moving on
                    break
            else:
                for j, c2, m2 in taken:
                    fc[j] += c2
                    fm[j] += m2
                return None
        return where

    def release(self, pods: list[tuple[float, float]], where: list[int]) -> None:
        for (c, m), j in zip(pods, where, strict=True):
            self.free_cpu[j] += c
            self.free_mem[j] += m
