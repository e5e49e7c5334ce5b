"""PreprocessModule: a plan compiled into grouped tensor ops over stacked features, exportable with torch.export.

Features whose op chains are the same (up to per-feature scalar parameters: sigrid_hash's M, logit's eps, ...)
form one group and run as one [B, g, w] tensor op per step ("horizontal fusion" at the torch level); outputs
are put back in plan order with a fixed column permutation. No per-row Python, no data-dependent control flow.
Scalar columns give one value per row and feature. A sparse feature over a multi-hot (list) column reads that
column's values int64[N] + lengths int64[B] (the `jagged` input: "<name>" and "<name>_lengths"); its elementwise
ops run over the values, and firstx(X) becomes a keep mask (no data-dependent sizes, so it exports with dynamic N
and B). Multi-value outputs of scalar columns (firstx(X > 1), ngram, onehot) go through the executors
(executor.make_executor). Serving inputs: docs/recom.md#multi-hot-columns.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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


LENGTHS_SUFFIX = "_lengths"  # a list column's lengths input: "<name>_lengths"
# ops that map each value of a list to one value (run over values[N]); firstx is the keep mask
_LIST_ELEMENTWISE = frozenset({"cast", "logit", "log1p", "boxcox", "bucketize", "clamp", "mapid", "sigrid_hash"})


def keep_first(lengths: Tensor, num_values: int, X: int) -> Tensor:
    """bool[N]: True for the first X values of each row (firstx over values[N] of rows with `lengths`), computed
    without data-dependent sizes (repeat_interleave with output_size N)."""
    starts = torch.cumsum(lengths, 0) - lengths
    rows = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                   output_size=num_values)
    pos = torch.arange(num_values, device=lengths.device) - starts.index_select(0, rows)
    return pos < X


class _ListFeature(nn.Module):
    """A sparse feature over a list column: fill_null (the values are all valid: ingest quarantines null elements),
    elementwise steps over values[N] as [N, 1, 1], firstx(X) as a keep mask. forward(values, lengths) ->
    (ids int64[N], lengths int64[B], keep bool[N] or None, kept lengths int64[B])."""

    def __init__(self, f: FeaturePlan, inline_hash: bool = False):
        super().__init__()
        self.name, self.source = f.name, f.source
        values = _chain_values(f, "sparse")
        steps, firstx = [], []
        for i, spec in enumerate(f.ops):
            if spec.op == "fill_null" and i == 0:
                continue
            if spec.op == "firstx":
                firstx.append(int(spec.params["X"]))
            elif spec.op in _LIST_ELEMENTWISE:
                steps.append(build_step(spec.op, spec.params, [spec.params], "sparse", values[i],
                                        inline_hash=inline_hash))
            else:
                raise PlanError(
                    f"PreprocessModule: feature {f.name!r}, op #{i} {spec.op!r} over multi_hot column {f.source!r}: "
                    f"the module form runs fill_null, firstx and elementwise ops ({sorted(_LIST_ELEMENTWISE)}) "
                    "on list columns: use make_executor"
                )
        self.steps = nn.ModuleList(steps)
        self.keep_x: int | None = min(firstx) if firstx else None

    def forward(self, values: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        x = values.to(torch.int64).view(-1, 1, 1)
        valid = torch.ones_like(x, dtype=torch.bool).view(-1, 1)  # the steps after fill_null do not read it
        for step in self.steps:
            x = step(x, valid)
        ids = x.reshape(-1)
        if self.keep_x is None:
            return ids, lengths, None, lengths
        return ids, lengths, keep_first(lengths, values.shape[0], self.keep_x), torch.clamp(lengths, max=self.keep_x)


def module_kjt(keys: list[str], ids: Tensor, lists: dict[str, tuple]) -> KeyedJaggedTensor:
    """PreprocessModule's outputs as the trainer's KeyedJaggedTensor over `keys` (the plan's sparse features),
    feature-major: a scalar feature one id per row, a list feature the ids its keep mask keeps."""
    batch = ids.shape[0]
    scalar = iter(ids.unbind(1))
    values, lengths = [], []
    for name in keys:
        if name in lists:
            v, _, keep, kept = lists[name]
            values.append(v if keep is None else v[keep])
            lengths.append(kept.to(torch.int32))
        else:
            values.append(next(scalar))
            lengths.append(torch.ones(batch, dtype=torch.int32, device=ids.device))
    return KeyedJaggedTensor(keys=list(keys), values=torch.cat(values), lengths=torch.cat(lengths), stride=batch)


class PreprocessModule(nn.Module):
    """forward(dense int64[B, Fd_in] (or float64), dense_valid bool, sparse int64[B, Fs_in], sparse_valid bool
    [, jagged]) -> (dense_out float32[B, plan dense], ids int64[B, scalar sparse features]); inputs in dataset
    column order (a list column's slot in `sparse` is not read).

    With list features (sparse features over multi_hot columns, `list_features`, in plan order) the plan needs
    `jagged`: {"<column>": values int64[N], "<column>_lengths": int64[B]} for each of `list_columns`, and the
    output gains a third item: {feature: (ids int64[N], lengths int64[B], keep bool[N] or None, kept lengths
    int64[B])} (the row's ids are those of its values with keep True; keep None = all). `ids` then holds the
    other sparse features, in plan order. Without list features, inputs and outputs are the four / two above."""

    scalar_sources = True  # `ids` holds one value per column and row (RECom's one-id proof relies on it)
    # set in __init__: buffers, and whether the concatenated groups need permuting
    dense_perm: Tensor
    sparse_perm: Tensor
    _dense_permute: bool
    _sparse_permute: bool

    def __init__(self, plan: Plan, dataset: DatasetConfig, inline_hash: bool = False):
        super().__init__()
        plan.validate_for(dataset)
        lists = [c.name for c in dataset.sparse if c.multi_hot]
        list_features = []
        for f in plan.features:
            if f.source in lists:
                if f.kind != "sparse":
                    raise PlanError(
                        f"PreprocessModule: {f.kind} feature {f.name!r} reads multi_hot column {f.source!r} (a list "
                        "per row); the module form reads list columns into sparse features only: use make_executor"
                    )
                list_features.append(f)
            elif f.width != 1:
                raise PlanError(
                    f"PreprocessModule: feature {f.name!r} gives {f.width} values per row (op chain "
                    f"{' -> '.join(s.op for s in f.ops)}); the module form needs one: use make_executor"
                )
        read = {f.source for f in list_features}
        self.list_columns: list[str] = [n for n in lists if n in read]  # dataset order
        clash = sorted(n for n in self.list_columns if n.endswith(LENGTHS_SUFFIX) and
                       n[:-len(LENGTHS_SUFFIX)] in self.list_columns)
        if clash:
            raise PlanError(f"PreprocessModule: multi_hot columns {clash} clash with the lengths inputs of "
                            f"{[n[:-len(LENGTHS_SUFFIX)] for n in clash]}; rename one")
        self.lists = nn.ModuleList(_ListFeature(f, inline_hash) for f in list_features)
        self.list_features: list[str] = [f.name for f in list_features]
        scalar = [f for f in plan.features if f.source not in read]
        self.plan, self.dataset = plan, dataset
        self.num_dense_in, self.num_sparse_in = len(dataset.dense), len(dataset.sparse)
        where = {n: ("dense", j) for j, n in enumerate(dataset.dense_names)}
        where |= {n: ("sparse", j) for j, n in enumerate(dataset.sparse_names)}
        grouped: dict[tuple, list[FeaturePlan]] = {}
        for f in scalar:
            grouped.setdefault((f.kind, where[f.source][0], _chain_key(f)), []).append(f)
        groups = [_Group(kind, src, fs, [where[f.source][1] for f in fs], inline_hash)
                  for (kind, src, _), fs in grouped.items()]
        self.groups = nn.ModuleList(groups)
        in_lists = set(self.list_features)
        self.scalar_sparse: list[str] = [n for n in plan.sparse_features() if n not in in_lists]
        for kind, names in (("dense", plan.dense_features()), ("sparse", self.scalar_sparse)):
            order = [n for g in groups if g.kind == kind for n in g.names]  # concatenation order
            perm = [order.index(n) for n in names]
            self.register_buffer(f"{kind}_perm", torch.tensor(perm, dtype=torch.int64), persistent=False)
            setattr(self, f"_{kind}_permute", perm != list(range(len(perm))))

    def jagged_input_names(self) -> list[str]:
        """The keys of the `jagged` input: "<column>", "<column>_lengths" per list column, in dataset order."""
        return [k for n in self.list_columns for k in (n, n + LENGTHS_SUFFIX)]

    def forward(
        self, dense: Tensor, dense_valid: Tensor, sparse: Tensor, sparse_valid: Tensor,
        jagged: dict[str, Tensor] | None = None,
    ):
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
        if not self.list_features:
            return dense_out, ids
        missing = [k for k in self.jagged_input_names() if jagged is None or k not in jagged]
        if missing:
            raise ValueError(f"PreprocessModule: the jagged input lacks {missing} (list columns {self.list_columns}: "
                             f"values int64[N] as \"<name>\", lengths int64[B] as \"<name>{LENGTHS_SUFFIX}\")")
        assert jagged is not None  # checked above
        for n in self.list_columns:
            values, lengths = jagged[n], jagged[n + LENGTHS_SUFFIX]
            if values.dim() != 1 or lengths.dim() != 1 or lengths.shape[0] != rows:
                raise ValueError(f"PreprocessModule: list column {n!r} needs values[N] and lengths[{rows}], got "
                                 f"{list(values.shape)} and {list(lengths.shape)}")
        lists = {}
        for lf in cast("Iterable[_ListFeature]", self.lists):
            lists[lf.name] = lf(jagged[lf.source], jagged[lf.source + LENGTHS_SUFFIX])
        return dense_out, ids, lists

    @staticmethod
    def _assemble(parts: list[Tensor], perm: Tensor, permute: bool, like: Tensor, rows, dtype) -> Tensor:
        if not parts:
            return like.new_zeros((rows, 0), dtype=dtype)
        out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return out.index_select(1, perm) if permute else out
