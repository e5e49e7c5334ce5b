"""A fused executor's whole batch as one traced TorchScript graph per batch shape: one GIL-free call.

The per-group path runs a batch as Python: one kernel call per fused group and `finish`'s ops, with the executor's
bookkeeping in between. The kernels release the GIL; the Python between them takes it back, a few dozen times per
batch. On RAP's co-run thread that Python competes with the trainer's thread for the GIL. Traced once per batch shape
(`torch.jit.trace`, check off: the row count is a constant of the trace), the same kernel calls in the same order run
as one TorchScript graph, and a ScriptFunction called from Python runs with the GIL released
(torch/csrc/jit/python). Values are the per-group path's: the same ops on the same inputs.

A shape is traced the `after`-th time it is seen (default the second), so a one-off row count (an epoch's last, short
batch) runs the per-group path instead of paying for a trace. At most `capacity` traces are kept, least recently used
first out. Design: docs/rap.md#a-whole-batch-in-one-call.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from recforge.preprocess.batch import RawBatch

# (dense, KJT values, KJT lengths) of a batch
BatchOutputs = tuple[Tensor, Tensor, Tensor]


def traceable(raw: RawBatch) -> bool:
    """Whether a batch can run as a traced graph: on CPU, with rows, and without list columns (whose value counts
    vary per batch, so no trace of one batch fits the next)."""
    return raw.rows > 0 and not raw.jagged and raw.dense.device.type == "cpu"


class BatchTraces:
    """Traced whole-batch graphs of one executor, keyed by the batch's shape and dtypes (and `variant`, e.g. which
    kernels the executor's groups call). `body(raw)` is the per-group path to trace; it must give (dense, values,
    lengths) and use only the raw batch's tensors as inputs."""

    def __init__(self, body: Callable[[RawBatch], BatchOutputs], after: int = 2, capacity: int = 4) -> None:
        if after < 1 or capacity < 1:
            raise ValueError(f"BatchTraces: after and capacity must be >= 1, got after={after}, capacity={capacity}")
        self.body, self.after, self.capacity = body, after, capacity
        self._graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._seen: Counter[tuple] = Counter()
        self._lock = threading.Lock()
        self.traced = 0  # traces made (evicted ones included)
        self.seconds = 0.0  # time inside traced calls (the GIL released), every batch

    @staticmethod
    def key(raw: RawBatch, variant: object = None) -> tuple:
        return (raw.rows, raw.dense.shape[1], raw.sparse.shape[1], raw.dense.dtype, raw.sparse.dtype,
                raw.dense_valid.dtype, raw.sparse_valid.dtype, variant)

    def run(self, raw: RawBatch, variant: object = None) -> BatchOutputs | None:
        """The batch through its traced graph, tracing it when its shape has been seen `after` times; None when
        the batch is not traced (yet): the caller runs the per-group path."""
        if not traceable(raw):
            return None
        key = self.key(raw, variant)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None:
                if len(self._seen) > 64 * self.capacity:  # many one-off shapes: forget them
                    self._seen.clear()
                self._seen[key] += 1
                if self._seen[key] < self.after:
                    return None
                graph = self._trace(raw)
                self._graphs[key] = graph
                self.traced += 1
                while len(self._graphs) > self.capacity:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
        t0 = time.perf_counter()
        out = graph(raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
        self.seconds += time.perf_counter() - t0
        return out

    def _trace(self, raw: RawBatch) -> Any:
        label = raw.label

        def batch(dense: Tensor, dense_valid: Tensor, sparse: Tensor, sparse_valid: Tensor) -> BatchOutputs:
            return self.body(RawBatch(label=label, dense=dense, dense_valid=dense_valid, sparse=sparse,
                                      sparse_valid=sparse_valid))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the row count is a constant: traced per count
            return torch.jit.trace(batch, (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid),
                                   check_trace=False)

    def describe(self) -> dict[str, Any]:
        return {"traced": self.traced, "kept": len(self._graphs), "after": self.after, "capacity": self.capacity}
