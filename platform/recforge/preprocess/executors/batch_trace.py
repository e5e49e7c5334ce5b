"""A fused executor's whole batch as one traced TorchScript graph per batch shape: one GIL-free call.

The per-group path runs a batch as Python: one kernel call per fused group and `finish`'s ops, with the executor's
bookkeeping in between. The kernels release the GIL; the Python between them takes it back, a few dozen times per
batch. On RAP's co-run thread that Python competes with the trainer's thread for the GIL. Traced once per batch shape
(`torch.jit.trace`, check off: the row count is a constant of the trace), the same kernel calls in the same order run
as one TorchScript graph, and a ScriptFunction called from Python runs with the GIL released
(torch/csrc/jit/python). Values are the per-group path's: the same ops on the same inputs.

A shape is traced the `after`-th time it is seen (default the second), so a one-off row count (an epoch's last, short
batch) runs the per-group path instead of paying for a trace (a few hundred ms: the trace and the graph's first,
profiling run). At most `capacity` traces are kept, least recently used first out; an evicted shape must be seen
`after` times again, and after `budget` traces in all no new shape is traced, so shapes that keep rotating cannot make
every batch pay for a trace. A trace that fails is logged and its shape runs the per-group path from then on.
Design: docs/rap.md#a-whole-batch-in-one-call.
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from recforge.preprocess.batch import RawBatch

log = logging.getLogger(__name__)

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

    def __init__(self, body: Callable[[RawBatch], BatchOutputs], after: int = 2, capacity: int = 4,
                 budget: int | None = None) -> None:
        budget = 8 * capacity if budget is None else budget
        if after < 1 or capacity < 1 or budget < 0:
            raise ValueError(f"BatchTraces: after and capacity must be >= 1 and budget >= 0, got after={after}, "
                             f"capacity={capacity}, budget={budget}")
        self.body, self.after, self.capacity, self.budget = body, after, capacity, budget
        self._graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._seen: Counter[tuple] = Counter()
        self._failed: dict[tuple, str] = {}  # shape -> why its trace failed (it runs the per-group path)
        self._lock = threading.Lock()
        self.traced = 0  # traces made (evicted ones included)
        self.seconds = 0.0  # time inside traced calls (the GIL released), every batch

    @staticmethod
    def key(raw: RawBatch, variant: object = None) -> tuple:
        return (raw.rows, raw.dense.shape[1], raw.sparse.shape[1], raw.dense.dtype, raw.sparse.dtype,
                raw.dense_valid.dtype, raw.sparse_valid.dtype, variant)

    def run(self, raw: RawBatch, variant: object = None) -> BatchOutputs | None:
        """The batch through its traced graph, tracing it when its shape has been seen `after` times; None when
        the batch is not traced (yet, or ever): the caller runs the per-group path."""
        if not traceable(raw):
            return None
        key = self.key(raw, variant)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None:
                if key in self._failed or self.traced >= self.budget:
                    return None
                if len(self._seen) > 64 * self.capacity:  # many one-off shapes: forget them
                    self._seen.clear()
                self._seen[key] += 1
                if self._seen[key] < self.after:
                    return None
                try:
                    graph = self._trace(raw)
                except Exception as e:  # noqa: BLE001 (any tracer failure: the per-group path still runs the batch)
                    self._failed[key] = f"{type(e).__name__}: {e}"
                    log.warning("batch trace failed for rows=%d (%s); this shape runs group by group", raw.rows, e)
                    return None
                self._graphs[key] = graph
                self.traced += 1
                while len(self._graphs) > self.capacity:
                    evicted, _ = self._graphs.popitem(last=False)
                    self._seen.pop(evicted, None)  # seen `after` times again before it is traced again
            self._graphs.move_to_end(key)
        t0 = time.perf_counter()
        out = graph(raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
        dt = time.perf_counter() - t0
        with self._lock:
            self.seconds += dt
        return out

    def _trace(self, raw: RawBatch) -> Any:
        label = raw.label

        def batch(dense: Tensor, dense_valid: Tensor, sparse: Tensor, sparse_valid: Tensor) -> BatchOutputs:
            return self.body(RawBatch(label=label, dense=dense, dense_valid=dense_valid, sparse=sparse,
                                      sparse_valid=sparse_valid))

        inputs = (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
        with warnings.catch_warnings():
            # shapes and parameters are constants of the trace (tests/unit/test_preprocess_batch_trace.py checks that
            # no warning names anything else for every op)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            graph = torch.jit.trace(batch, inputs, check_trace=False)
        graph(*inputs)  # the graph's first run profiles it (several times a warm run): paid here, with the trace
        return graph

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"traced": self.traced, "kept": len(self._graphs), "after": self.after,
                               "capacity": self.capacity}
        if self.traced >= self.budget:
            out["stopped"] = f"{self.traced} shapes traced: the budget of {self.budget}; new shapes run group by group"
        if self._failed:
            out["failed"] = sorted(set(self._failed.values()))
        return out
