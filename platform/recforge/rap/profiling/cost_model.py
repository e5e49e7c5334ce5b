"""Latency of one fused-kernel launch as a function of op, fusion degree, row width and rows (RAP §3.3a).

RAP fits XGBoost per op family at one batch size and scales linearly in rows; here rows are a model input. Per op:

    ms = c0 + c1 * n + c2 * n * rows + c3 * V + c4 * max(0, V - SPILL_VALUES),   V = n * rows * width, c >= 0

n = fused features (nodes of the group), width = the op's average row width (its input width; bucketize: the
number of borders; onehot: C, as RAP's featurization). Ops over list (jagged) columns run other kernels than
over fixed-width columns (the fused executor splits a group by form), so they are fitted apart: key "op[list]".
c0 is the launch, c1 the per-feature setup, c2 the per-row, c3 the per-value cost; c4 the extra per-value cost
once the values no longer fit in cache (on CPU fresh multi-MB outputs also page-fault: measured 3-10x per value
past ~1M values). Fitted by non-negative least squares on relative error (rows scaled by 1/y), so small kernels
count as much as large ones. Accuracy = share of held-out predictions within 10% (RAP's).
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import nnls

from recforge.preprocess.planning.compiler import CompiledPlan, FusedGroup
from recforge.preprocess.planning.graph import Node, OpGraph

NUM_COEF = 5
SPILL_VALUES = float(1 << 20)


@dataclass(frozen=True)
class Measurement:
    op: str
    n: int  # fused features
    rows: int
    width: float
    ms: float
    jagged: bool = False

    @property
    def key(self) -> str:
        return model_key(self.op, self.jagged)


def model_key(op: str, jagged: bool) -> str:
    return f"{op}[list]" if jagged else op


def design_row(n: int, rows: float, width: float) -> list[float]:
    return design(n, float(n) * rows, float(n) * rows * width)


def design(n: int, total_rows: float, values: float) -> list[float]:
    return [1.0, float(n), total_rows, values, max(0.0, values - SPILL_VALUES)]


@dataclass
class CostModel:
    coef: dict[str, list[float]]
    meta: dict = field(default_factory=dict)

    def predict(self, op: str, n: int, rows: float, width: float = 1.0, jagged: bool = False) -> float:
        key = model_key(op, jagged)
        if key not in self.coef:
            raise KeyError(f"cost model has no fit for op {key!r}; fitted: {sorted(self.coef)}")
        if n < 1 or rows < 0:
            raise ValueError(f"cost model: n={n} must be >= 1 and rows={rows} >= 0")
        return float(np.dot(self.coef[key], design_row(n, rows, width)))

    def accuracy(self, measurements: Sequence[Measurement], tolerance: float = 0.10) -> float:
        """Share of measurements predicted within `tolerance` relative error."""
        if not measurements:
            return float("nan")
        hits = [abs(self.predict(m.op, m.n, m.rows, m.width, m.jagged) - m.ms) <= tolerance * m.ms
                for m in measurements]
        return float(np.mean(hits))

    def to_json(self) -> str:
        return json.dumps({"coef": self.coef, "meta": self.meta}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        data = json.loads(text)
        bad = [op for op, c in data["coef"].items() if len(c) != NUM_COEF]
        if bad:
            raise ValueError(f"cost model JSON: ops {bad} need {NUM_COEF} coefficients")
        return cls(coef=data["coef"], meta=data.get("meta", {}))


def fit_op(measurements: Sequence[Measurement]) -> list[float]:
    x = np.array([design_row(m.n, m.rows, m.width) for m in measurements])
    y = np.array([m.ms for m in measurements])
    if (y <= 0).any():
        raise ValueError("cost model: measured latencies must be > 0")
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls((x / scale) / y[:, None], np.ones_like(y))
    return (c / scale).tolist()


def fit(measurements: Sequence[Measurement], holdout: float = 0.2, seed: int = 0) -> tuple[CostModel, dict]:
    """Fit per op on a random (1 - holdout) share; report held-out accuracy overall and per op, then refit on
    everything (the returned model)."""
    by_op: dict[str, list[Measurement]] = {}
    for m in measurements:
        by_op.setdefault(m.key, []).append(m)
    rng = random.Random(seed)
    held: list[tuple[Measurement, float]] = []  # (measurement, its held-out prediction)
    per_op: dict[str, float] = {}
    for op, ms in sorted(by_op.items()):
        if len(ms) < NUM_COEF + 2:
            raise ValueError(f"cost model: op {op!r} has {len(ms)} measurements, need at least {NUM_COEF + 2}")
        idx = list(range(len(ms)))
        rng.shuffle(idx)
        k = max(1, int(round(holdout * len(ms))))
        test, train = [ms[i] for i in idx[:k]], [ms[i] for i in idx[k:]]
        partial = CostModel({op: fit_op(train)})
        per_op[op] = partial.accuracy(test)
        held.extend((m, partial.predict(m.op, m.n, m.rows, m.width, m.jagged)) for m in test)
    within = [abs(p - m.ms) <= 0.10 * m.ms for m, p in held]
    report = {"heldout_within_10pct": float(np.mean(within)), "heldout_n": len(held),
              "heldout_within_10pct_by_op": per_op, "measurements": len(measurements)}
    model = CostModel({op: fit_op(ms) for op, ms in by_op.items()}, meta={"fit": report})
    return model, report


# ------------------------------------------------------------------ groups of a compiled plan


def node_widths(graph: OpGraph, source_width: Mapping[str, float] | None = None) -> dict[int, float]:
    """The width each node's op is featurized with (see the module docstring); a source is a scalar column unless
    `source_width` names it as a list column with that average length."""
    source_width = source_width or {}
    out_w: dict[int, float] = {}
    feat: dict[int, float] = {}
    for n in graph.nodes:
        w_in = float(source_width.get(n.source, 1.0)) if n.parent is None else out_w[n.parent]
        p = n.params
        w_out = w_in
        if n.op == "firstx":
            w_out = min(p["X"], w_in)
        elif n.op == "onehot":
            w_out = float(p["C"])
        elif n.op == "ngram":
            k = min(p["n"], w_in)
            w_out = (w_in - k + 1) * k
        elif n.op == "bucketize":
            w_out = w_in
        out_w[n.id] = w_out
        feat[n.id] = float(len(p["borders"])) if n.op == "bucketize" else (float(p["C"]) if n.op == "onehot" else w_in)
    return feat


def predict_group(model: CostModel, compiled: CompiledPlan, group: FusedGroup, rows: float | Callable[[Node], float],
                  source_width: Mapping[str, float] | None = None) -> float:
    """Predicted ms of `group` (or a part of it: a FusedGroup with fewer nodes): one launch per form (scalar / list
    sources), as the fused executor runs it. `rows`: rows every node processes, or a function of the node (a
    worker preprocesses its own tables over the global batch and the rest over its local batch, in one launch);
    the fused launch's total rows and values are sums over its nodes."""
    source_width = source_width or {}
    widths = node_widths(compiled.graph, source_width)
    nodes = {n.id: n for n in compiled.graph.nodes}
    rows_of = rows if callable(rows) else (lambda _node: float(rows))
    total = 0.0
    for jagged in (False, True):
        part = [nodes[i] for i in group.nodes if (nodes[i].source in source_width) == jagged]
        if part:
            key = model_key(group.op, jagged)
            if key not in model.coef:
                raise KeyError(f"cost model has no fit for op {key!r}; fitted: {sorted(model.coef)}")
            r = [float(rows_of(n)) for n in part]
            x = design(len(part), sum(r), sum(ri * widths[n.id] for ri, n in zip(r, part, strict=True)))
            total += float(np.dot(model.coef[key], x))
    return total


def as_dicts(measurements: Sequence[Measurement]) -> list[dict]:
    return [asdict(m) for m in measurements]
