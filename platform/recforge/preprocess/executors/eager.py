"""The eager executor: every op of every feature is its own torch call (RAP's unfused baseline)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import BatchError, Col, SourceKind, check_batch, finish, sources
from recforge.preprocess.executors.record import EAGER, ExecutionLog, process_log
from recforge.preprocess.planning.plan import FeaturePlan, Plan
from recforge.preprocess.semantics import ops

_ELEMENTWISE = {
    "cast": lambda x, p: ops.cast(x, p["to"]),
    "logit": lambda x, p: ops.logit(x, p["eps"]),
    "log1p": lambda x, p: ops.log1p(x),
    "boxcox": lambda x, p: ops.boxcox(x, p["lambda"]),
    "bucketize": lambda x, p: ops.bucketize(x, p["borders"]),
    "sigrid_hash": lambda x, p: ops.sigrid_hash(x, p["salt"], p["M"]),
    "mapid": lambda x, p: ops.mapid(x, p["map"]),
    "clamp": lambda x, p: (ops.clamp(x, int(p["lo"]), int(p["hi"])) if x.dtype == torch.int64
                           else ops.clamp(x, float(p["lo"]), float(p["hi"]))),
}


def apply_op(feature: FeaturePlan, op: str, params: dict[str, Any], col: Col) -> Col:
    """One op (not fill_null) on one feature's values."""
    if op in _ELEMENTWISE:
        return Col(_ELEMENTWISE[op](col.values, params), col.lengths)
    if op == "firstx":
        if col.lengths is not None:
            return Col(*ops.firstx_jagged(col.values, col.lengths, params["X"]))
        return Col(ops.firstx(col.values, params["X"]))
    if op == "ngram":
        if col.lengths is not None:
            return Col(*ops.ngram_jagged(col.values, col.lengths, params["n"]))
        return Col(ops.ngram(col.values, params["n"]))
    if op == "onehot":
        if col.jagged or col.values.shape[1] != 1:
            raise BatchError(f"feature {feature.name!r}, op 'onehot': takes one value per row, but its source "
                             f"{feature.source!r} is a list column")
        return Col(ops.onehot(col.values, params["lo"], params["hi"], params["C"]))
    raise ValueError(f"feature {feature.name!r}: no eager implementation of op {op!r}")


def read_source(feature: FeaturePlan, raw: RawBatch, kind: SourceKind, index: int) -> Col:
    """fill_null (the first op) applied to the feature's raw source column."""
    value = feature.ops[0].params["value"]
    if kind == "sparse" and feature.source in raw.jagged:
        jc = raw.jagged[feature.source]
        return Col(ops.fill_null(jc.values, jc.valid, value, "sparse"), jc.lengths)
    matrix, valid = (raw.dense, raw.dense_valid) if kind == "dense" else (raw.sparse, raw.sparse_valid)
    return Col(ops.fill_null(matrix[:, index], valid[:, index], value, kind).unsqueeze(1))


class EagerExecutor:
    name = "eager"

    def __init__(self, plan: Plan, dataset: DatasetConfig):
        plan.validate_for(dataset)
        self.plan, self.dataset = plan, dataset
        self._sources = sources(dataset)
        self.executed = ExecutionLog()  # per batch (recforge.preprocess.executors.record)

    @torch.no_grad()
    def __call__(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        check_batch(raw, self.dataset, self.plan)
        outputs = {}
        for f in self.plan.features:
            src = self._sources[f.source]
            col = read_source(f, raw, src.kind, src.index)
            for spec in f.ops[1:]:
                col = apply_op(f, spec.op, spec.params, col)
            outputs[f.name] = col
        for counts in (self.executed, process_log()):
            counts.add(EAGER, native=False, reason="one torch call per op and feature (the unfused baseline)")
        return finish(self.plan, outputs, raw.rows, raw.dense.device)

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "plan": self.plan.name,
                "launches_per_batch": sum(len(f.ops) for f in self.plan.features),
                "executed": self.executed.snapshot()}
