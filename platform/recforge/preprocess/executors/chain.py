"""The single-pass CPU form of a plan: every feature's whole op chain per row tile, in one call
(recforge::fused_chain, csrc/fused_cpu.cpp).

RAP fuses horizontally: one kernel per op type and layer, so a chain of k ops is k passes over [F, B] values. On a
CPU a pass (allocate, write, read back) costs more than the arithmetic of most ops (fill_null, clamp, firstx), so
when every feature of a plan gives one value per row from a scalar column, the whole plan runs as one pass: each
tile of raw rows is read once, each feature's chain runs on it in L1, and the results go straight into the dense
matrix and the KJT's values. The per-value code is the grouped kernels' own, so the outputs are the same.

A feature fits when its chain keeps one value per row (Plan feature width 1): firstx / ngram on one value are
identities, and an onehot whose row is cut back to its first value is that value (1.0 when the class is 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import sources
from recforge.preprocess.planning.plan import FeaturePlan, Plan
from recforge.preprocess.semantics.ops import logit_bounds
from recforge.preprocess.semantics.registry import OPS, Value
from recforge_kernels.fused import eager_impl, fused_chain

# step codes: the ChainCode enum of csrc/fused_cpu.cpp
FILL_FLOAT, FILL_ID, LOGIT, BOXCOX, CLAMP_FLOAT, CLAMP_ID, SIGRID_HASH, BUCKETIZE, MAPID, CAST_FLOAT, CAST_ID, \
    ONEHOT_FIRST, LOG1P = range(13)


def _f32(x: float) -> float:
    return float(torch.tensor(float(x), dtype=torch.float32))


class NotChainable(ValueError):
    """The plan has a feature the single-pass form cannot run (the message names it)."""


@dataclass
class ChainProgram:
    """Flat arrays the C++ kernel reads: per feature its source and output slot and a run of steps."""

    src_kind: list[int]
    src_col: list[int]
    out_kind: list[int]
    out_slot: list[int]
    step_offsets: list[int]
    codes: list[int]
    f0: list[float]
    f1: list[float]
    i0: list[int]
    i1: list[int]
    borders: Tensor
    table: Tensor
    num_dense: int
    num_sparse: int
    source_names: frozenset[str]

    def run(self, raw: RawBatch) -> tuple[Tensor, Tensor]:
        """(dense float32 [B, num_dense], ids int64 [num_sparse * B], key-major)."""
        return tuple(eager_impl(fused_chain)(
            raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid, self.src_kind, self.src_col, self.out_kind,
            self.out_slot, self.step_offsets, self.codes, self.f0, self.f1, self.i0, self.i1, self.borders,
            self.table, self.num_dense, self.num_sparse))


def _steps(f: FeaturePlan, source_kind: str, borders: list[float], table: list[int]) -> list[tuple]:
    """(code, f0, f1, i0, i1) for each step of f's chain that does something to a row's one value."""
    if f.width != 1:
        raise NotChainable(f"feature {f.name!r} gives {f.width} values per row")
    v, out = Value("raw", 1), []
    for op, p in f.parsed_ops():
        nxt = OPS[op].out(p, v, source_kind)
        if op == "fill_null":
            out.append((FILL_FLOAT if nxt.type == "float" else FILL_ID, float(p.value), 0.0, 0, 0))
        elif op == "logit":
            lo, hi = logit_bounds(p.eps)
            out.append((LOGIT, lo, hi, 0, 0))
        elif op == "boxcox":
            out.append((BOXCOX, _f32(p.lmbda), 0.0, 0, 0))
        elif op == "log1p":
            out.append((LOG1P, 0.0, 0.0, 0, 0))
        elif op == "clamp":
            if v.type == "id":
                out.append((CLAMP_ID, 0.0, 0.0, int(p.lo), int(p.hi)))
            else:
                out.append((CLAMP_FLOAT, float(p.lo), float(p.hi), 0, 0))
        elif op == "sigrid_hash":
            out.append((SIGRID_HASH, 0.0, 0.0, p.salt, p.M))
        elif op == "bucketize":
            out.append((BUCKETIZE, 0.0, 0.0, len(borders), len(borders) + len(p.borders)))
            borders.extend(p.borders)
        elif op == "mapid":
            out.append((MAPID, 0.0, 0.0, len(table), len(table) + len(p.map)))
            table.extend(p.map)
        elif op == "cast":
            if v.type != nxt.type:
                out.append((CAST_FLOAT if nxt.type == "float" else CAST_ID, 0.0, 0.0, 0, 0))
        elif op == "onehot":
            if v.type == "id":  # the grouped kernel converts ids to float32 first, the same way
                out.append((CAST_FLOAT, 0.0, 0.0, 0, 0))
            out.append((ONEHOT_FIRST, float(p.lo), float(p.hi), p.C, 0))
        elif op not in ("firstx", "ngram"):  # on one value per row these keep it
            raise NotChainable(f"feature {f.name!r}: op {op!r} has no single-pass step")
        v = nxt
    if v.type != ("float" if f.kind == "dense" else "id"):
        raise NotChainable(f"feature {f.name!r} ({f.kind}) ends with {v.type} values")
    return out


def chain_program(plan: Plan, dataset: DatasetConfig) -> ChainProgram:
    """The single-pass program of a plan validated for `dataset`; NotChainable names a feature that does not fit."""
    where = sources(dataset)
    dense_slot = {n: i for i, n in enumerate(plan.dense_features())}
    sparse_slot = {n: i for i, n in enumerate(plan.sparse_features())}
    borders: list[float] = []
    table: list[int] = []
    prog = ChainProgram([], [], [], [], [0], [], [], [], [], [], torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                        len(dense_slot), len(sparse_slot), frozenset(f.source for f in plan.features))
    for f in plan.features:
        src = where[f.source]
        for code, f0, f1, i0, i1 in _steps(f, src.kind, borders, table):
            prog.codes.append(code)
            prog.f0.append(f0)
            prog.f1.append(f1)
            prog.i0.append(i0)
            prog.i1.append(i1)
        prog.src_kind.append(0 if src.kind == "dense" else 1)
        prog.src_col.append(src.index)
        prog.out_kind.append(0 if f.kind == "dense" else 1)
        prog.out_slot.append(dense_slot[f.name] if f.kind == "dense" else sparse_slot[f.name])
        prog.step_offsets.append(len(prog.codes))
    prog.borders = torch.tensor(borders, dtype=torch.float32)
    prog.table = torch.tensor(table, dtype=torch.int64)
    return prog
