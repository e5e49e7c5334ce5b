"""Measure fused-kernel latencies on our real fused executor, for the cost model (recforge.rap.profiling.cost_model).

For each (op, n, rows, width) a synthetic plan of n features whose chains contain the op is compiled; the
fused executor runs the whole plan once, then the op's group alone `repeats` times (see time_group). width > 1 on a
sparse op means list (multi-hot) columns of exactly `width` ids per row; dense ops read scalars (onehot's
width is its C, bucketize's its number of borders).
"""
from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterable

import torch

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.jagged import JaggedColumn, JaggedColumns
from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.planning.plan import Plan
from recforge.rap.profiling.cost_model import Measurement

SPARSE_OPS = ("fill_null", "sigrid_hash", "clamp", "firstx", "ngram")
DENSE_OPS = ("logit", "boxcox", "onehot", "bucketize")
OPS = SPARSE_OPS + DENSE_OPS

FILL = {"op": "fill_null", "params": {"value": 0}}
HASH = {"op": "sigrid_hash", "params": {"salt": 0, "M": 1000}}


def _chain(op: str, width: int) -> tuple[str, list[dict]]:
    """(feature kind, ops) of one probe feature."""
    if op in ("fill_null", "sigrid_hash"):
        return "sparse", [FILL, HASH]
    if op == "clamp":
        return "sparse", [FILL, {"op": "clamp", "params": {"lo": 0, "hi": 1000}}]
    if op == "firstx":
        return "sparse", [FILL, HASH, {"op": "firstx", "params": {"X": max(1, width // 2)}}]
    if op == "ngram":
        return "sparse", [FILL, HASH, {"op": "ngram", "params": {"n": 2}}]
    if op == "logit":
        return "dense", [FILL, {"op": "logit", "params": {"eps": 1e-5}}]
    if op == "boxcox":
        return "dense", [FILL, {"op": "boxcox", "params": {"lambda": 0.5}}]
    if op == "onehot":
        return "dense", [FILL, {"op": "onehot", "params": {"lo": 0, "hi": 16, "C": width}},
                         {"op": "firstx", "params": {"X": 1}}]
    if op == "bucketize":
        return "sparse", [FILL, {"op": "bucketize", "params": {"borders": [float(b) for b in range(width)]}}]
    raise ValueError(f"cost probe: no probe chain for op {op!r}; probed ops: {list(OPS)}")


def probe_case(op: str, n: int, rows: int, width: int, seed: int = 0) -> tuple[FusedExecutor, RawBatch, int]:
    """(executor, raw batch, index of the op's group) for one probe."""
    kind, ops = _chain(op, width)
    dense_source = op in DENSE_OPS
    lists = not dense_source and width > 1
    ds = DatasetConfig.criteo_order(name="probe", dense=[DenseFeature(name=f"D{i}") for i in range(n)],
                       sparse=[SparseFeature(name=f"S{i}", cardinality=1000) for i in range(n)])
    feats = [{"name": f"f{i}", "kind": kind, "source": f"{'D' if dense_source else 'S'}{i}", "ops": ops}
             for i in range(n)]
    plan = Plan.model_validate({"name": f"probe_{op}", "features": feats})
    compiled = compile_plan(plan, method="greedy")
    g = torch.Generator().manual_seed(seed)
    jagged = {}
    if lists:
        for i in range(n):
            total = rows * width
            jagged[f"S{i}"] = JaggedColumn(torch.randint(0, 2**32, (total,), generator=g),
                                           torch.full((rows,), width, dtype=torch.int64),
                                           torch.rand(total, generator=g) > 0.1)
    raw = RawBatch(label=torch.zeros(rows), dense=torch.randint(-3, 60, (rows, n), generator=g),
                   dense_valid=torch.rand(rows, n, generator=g) > 0.1,
                   sparse=torch.randint(0, 2**32, (rows, n), generator=g),
                   sparse_valid=torch.rand(rows, n, generator=g) > 0.1, jagged=JaggedColumns(jagged))
    executor = FusedExecutor(plan, ds, compiled=compiled, prune=False)
    gi = next(i for i, grp in enumerate(compiled.groups) if grp.op == op)
    return executor, raw, gi


def time_group(executor: FusedExecutor, raw: RawBatch, gi: int, repeats: int, min_sample_ms: float = 0.2,
               stat: str = "min") -> float:
    """ms of one launch of the group alone, its inputs computed beforehand by one full run: the fastest ("min",
    default) or the median of `repeats` samples. The minimum is the kernel's own latency; on a shared machine the
    rest is other processes' load, which the model should not learn (held-out accuracy: ~94% with min, ~80% with
    the median on 2 shared cores). Each sample averages enough back-to-back launches to last `min_sample_ms`."""
    if stat not in ("min", "median"):
        raise ValueError(f"time_group: stat must be 'min' or 'median', got {stat!r}")
    vals: dict = {}
    with torch.no_grad():
        for i, grp in enumerate(executor.compiled.groups):
            executor.run_group(i, grp, raw, vals)
        group = executor.compiled.groups[gi]
        t0 = time.perf_counter()
        executor.run_group(gi, group, raw, vals)
        first = (time.perf_counter() - t0) * 1e3
        inner = max(1, min(100, int(min_sample_ms / max(first, 1e-3))))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                executor.run_group(gi, group, raw, vals)
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return min(times) if stat == "min" else statistics.median(times)


def measure(ops: Iterable[str] = OPS, degrees: Iterable[int] = (1, 4, 16), rows: Iterable[int] = (512, 4096),
            widths: Iterable[int] = (1, 4), repeats: int = 5, threads: int = 1) -> list[Measurement]:
    """Every combination; widths apply to list-capable sparse ops and to onehot / bucketize, others use 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = []
    try:
        for op, n, r in itertools.product(list(ops), list(degrees), list(rows)):
            ws = list(widths) if op in SPARSE_OPS + ("onehot", "bucketize") else [1]
            for w in ws:
                ex, raw, gi = probe_case(op, n, r, w)
                out.append(Measurement(op=op, n=n, rows=r, width=float(w), ms=time_group(ex, raw, gi, repeats),
                                       jagged=op in SPARSE_OPS and w > 1))
    finally:
        torch.set_num_threads(before)
    return out
