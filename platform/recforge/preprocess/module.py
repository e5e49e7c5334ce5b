"""PreprocessModule: a plan compiled into grouped tensor ops over stacked features, exportable with torch.export.

Features whose op chains are the same (up to per-feature scalar parameters: sigrid_hash's M, logit's eps, ...)
form one group and run as one [B, g, w] tensor op per step ("horizontal fusion" at the torch level); outputs
are put back in plan order with a fixed column permutation. No per-row Python, no data-dependent control flow.
It takes scalar columns only and needs one value per row from every feature (RECom's form); list columns and
multi-value features go through the executors (executor.make_executor).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn

from recforge.config import DatasetConfig
from recforge.preprocess.planning.plan import FeaturePlan, Plan, PlanError
from recforge.preprocess.semantics.registry import OPS, Value
from recforge.preprocess.semantics.steps import PER_COLUMN, build_step


def _chain_key(f: FeaturePlan) -> tuple:
    return tuple(
        (s.op, json.dumps({k: v for k, v in s.params.items() if k not in PER_COLUMN.get(s.op, ())}, sort_keys=True))
        for s in f.ops
    )


def _chain_values(f: FeaturePlan, source_kind: str) -> list[Value]:
    """The input value (type, width) of each op of f's chain."""
    v, out = Value("raw", 1), []
    for op, p in f.parsed_ops():
        out.append(v)
        v = OPS[op].out(p, v, source_kind)
    return out


class _Group(nn.Module):
    index: Tensor  # buffer

    def __init__(self, kind: str, source_kind: str, features: list[FeaturePlan], columns: list[int],
                 inline_hash: bool = False):
        super().__init__()
        self.kind, self.source_kind = kind, source_kind
        self.names = [f.name for f in features]
        self.register_buffer("index", torch.tensor(columns, dtype=torch.int64), persistent=False)
        values = _chain_values(features[0], source_kind)
        self.steps = nn.ModuleList(
            build_step(spec.op, spec.params, [f.ops[i].params for f in features], source_kind, values[i],
                       inline_hash=inline_hash)
            for i, spec in enumerate(features[0].ops)
        )

    def forward(self, raw: Tensor, valid: Tensor) -> Tensor:
        x = raw.index_select(1, self.index).unsqueeze(-1)  # [B, g, 1]
        v = valid.index_select(1, self.index)
        for step in self.steps:
            x = step(x, v)
        return x.squeeze(-1)


class PreprocessModule(nn.Module):
    """forward(dense int64[B, Fd_in], dense_valid bool, sparse int64[B, Fs_in], sparse_valid bool)
    -> (dense_out float32[B, plan dense], ids int64[B, plan sparse]); inputs in dataset column order."""

    scalar_sources = True  # reads one value per column and row (RECom's one-id proof relies on it)
    # set in __init__: buffers, and whether the concatenated groups need permuting
    dense_perm: Tensor
    sparse_perm: Tensor
    _dense_permute: bool
    _sparse_permute: bool

    def __init__(self, plan: Plan, dataset: DatasetConfig, inline_hash: bool = False):
        super().__init__()
        plan.validate_for(dataset)
        for f in plan.features:
            if f.width != 1:
                raise PlanError(
                    f"PreprocessModule: feature {f.name!r} gives {f.width} values per row (op chain "
                    f"{' -> '.join(s.op for s in f.ops)}); the module form needs one: use make_executor"
                )
        self.plan, self.dataset = plan, dataset
        self.num_dense_in, self.num_sparse_in = len(dataset.dense), len(dataset.sparse)
        where = {n: ("dense", j) for j, n in enumerate(dataset.dense_names)}
        where |= {n: ("sparse", j) for j, n in enumerate(dataset.sparse_names)}
        grouped: dict[tuple, list[FeaturePlan]] = {}
        for f in plan.features:
            grouped.setdefault((f.kind, where[f.source][0], _chain_key(f)), []).append(f)
        groups = [_Group(kind, src, fs, [where[f.source][1] for f in fs], inline_hash)
                  for (kind, src, _), fs in grouped.items()]
        self.groups = nn.ModuleList(groups)
        for kind, names in (("dense", plan.dense_features()), ("sparse", plan.sparse_features())):
            order = [n for g in groups if g.kind == kind for n in g.names]  # concatenation order
            perm = [order.index(n) for n in names]
            self.register_buffer(f"{kind}_perm", torch.tensor(perm, dtype=torch.int64), persistent=False)
            setattr(self, f"_{kind}_permute", perm != list(range(len(perm))))

    def forward(
        self, dense: Tensor, dense_valid: Tensor, sparse: Tensor, sparse_valid: Tensor
    ) -> tuple[Tensor, Tensor]:
        if dense.shape[1] != self.num_dense_in or sparse.shape[1] != self.num_sparse_in:
            raise ValueError(
                f"PreprocessModule: expected {self.num_dense_in} dense and {self.num_sparse_in} sparse raw columns, "
                f"got {dense.shape[1]} and {sparse.shape[1]}"
            )
        parts: dict[str, list[Tensor]] = {"dense": [], "sparse": []}
        for g in cast("Iterable[_Group]", self.groups):  # nn.ModuleList is not generic
            raw, valid = (dense, dense_valid) if g.source_kind == "dense" else (sparse, sparse_valid)
            parts[g.kind].append(g(raw, valid))
        rows = dense.shape[0]
        dense_out = self._assemble(parts["dense"], self.dense_perm, self._dense_permute, dense, rows, torch.float32)
        ids = self._assemble(parts["sparse"], self.sparse_perm, self._sparse_permute, sparse, rows, torch.int64)
        return dense_out, ids

    @staticmethod
    def _assemble(parts: list[Tensor], perm: Tensor, permute: bool, like: Tensor, rows, dtype) -> Tensor:
        if not parts:
            return like.new_zeros((rows, 0), dtype=dtype)
        out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return out.index_select(1, perm) if permute else out
