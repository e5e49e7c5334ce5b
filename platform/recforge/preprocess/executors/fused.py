"""The fused executor: the compiled plan's groups in layer order, one `recforge::fused_*` call per group.

A group whose members differ in form is split into one call per form. `prune=True` skips values no consumer
reads; `single_pass=True` (CPU, C++ kernels) runs every feature's whole chain in one call when each keeps one
value per row; `trace_batches=True` runs the groups of a CPU batch without list columns as one traced TorchScript
graph (recforge.preprocess.executors.batch_trace: one call without the GIL). All give the grouped kernels' values.
`native=False` runs the ops' torch fallback instead of the C++ / Triton kernels. Each batch is counted under the
path that ran it (recforge.preprocess.executors.record).
Design: docs/rap.md#the-fusion-milp-and-the-fused-executor.
"""
from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recforge_kernels  # noqa: F401  (registers recforge::fused_*)
from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import BatchError, Col, check_batch, finish, sources
from recforge.preprocess.executors.batch_trace import BatchOutputs, BatchTraces
from recforge.preprocess.executors.chain import ChainProgram, NotChainable, chain_program
from recforge.preprocess.executors.record import (
    CPP_PER_GROUP,
    CPP_SINGLE_PASS,
    TORCH_FALLBACK,
    TRITON_PER_GROUP,
    ExecutionLog,
    process_log,
)
from recforge.preprocess.planning.compiler import CompiledPlan, CompileMethod, FusedGroup, compile_plan
from recforge.preprocess.planning.graph import Node
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.semantics.ops import logit_bounds
from recforge_kernels import cpu_ext, fused_torch
from recforge_kernels import fused as fused_ops
from recforge_kernels.fused import eager_impl


class _Kernels:
    """recforge::fused_* by name, called through their Python bodies (recforge_kernels.fused.eager_impl): the same
    kernels without the per-call dispatcher layers; torch.compile / export of the ops themselves is unaffected."""

    def __getattr__(self, name: str):
        op = eager_impl(getattr(fused_ops, name))
        setattr(self, name, op)
        return op


F = _Kernels()


class _TorchKernels:
    """The same ops on their torch fallback (recforge_kernels.fused_torch), for FusedExecutor(native=False)."""

    def __getattr__(self, name: str):
        base = name.removeprefix("fused_")
        if base in ("cast_float", "cast_id"):
            op = partial(fused_torch.cast, to_float=base == "cast_float")
        else:
            op = getattr(fused_torch, base)
        setattr(self, name, op)
        return op


_TRITON: list[bool] = []


def _triton() -> bool:
    if not _TRITON:
        _TRITON.append(importlib.util.find_spec("triton") is not None)
    return _TRITON[0]


def cpu_kernels_problem() -> str | None:
    """Why the fused ops run their torch fallback on CPU in this process (None: the C++ kernels run)."""
    if fused_ops.use_cpp():
        return None
    if cpu_ext.load():
        return "the C++ kernels loaded, but recforge_kernels.fused.set_cpu_backend('torch') switched them off"
    return f"the C++ kernels did not load: {cpu_ext.status()}"


def _flat_lists(lists: list[list], dtype: torch.dtype) -> tuple[Tensor, list[int]]:
    """Per-feature lists back to back, with offsets (len = features + 1)."""
    offsets = [0]
    for x in lists:
        offsets.append(offsets[-1] + len(x))
    return torch.tensor([v for x in lists for v in x], dtype=dtype), offsets


class FusedExecutor:
    name = "fused"

    def __init__(self, plan: Plan, dataset: DatasetConfig, method: CompileMethod = "milp",
                 compiled: CompiledPlan | None = None, prune: bool = True, single_pass: bool = True,
                 native: bool = True, report: bool = True, trace_batches: bool = True):
        """`native=False`: the torch fallback of every op, never the C++ / Triton kernels. `report=False`: count
        batches in `executed` only, not in the process's log (an executor inside another one). `trace_batches=False`:
        every batch that takes the groups runs them from Python."""
        plan.validate_for(dataset)
        self.plan, self.dataset, self.prune = plan, dataset, prune
        self.native, self.report = native, report
        self._k: Any = F if native else _TorchKernels()
        self.executed = ExecutionLog()  # what this executor ran, per batch (recforge.preprocess.executors.record)
        self.last_path: str | None = None
        self.compiled = compiled if compiled is not None else compile_plan(plan, method=method)
        self._nodes = {n.id: n for n in self.compiled.graph.nodes}
        self._width, self.demand = self._demands()
        self._sources = sources(dataset)
        self._tables: dict[tuple[int, str], Tensor] = {}  # (group index, device) -> flat borders / map table
        self._plans: dict[tuple, list] = {}  # (group, device) -> [(member indices, call)] of an elementwise group
        self._local = threading.local()  # `calls` per thread: an executor may run on the trainer and a co-run thread
        self.traces = BatchTraces(self._grouped_outputs) if trace_batches else None
        self._traced_calls = 0
        self._chain: ChainProgram | None = None
        self.single_pass_reason = "off (single_pass=False)"
        if not native:
            self.single_pass_reason = "off (native=False: fused_chain exists in C++ only)"
        elif single_pass:
            try:
                self._chain = chain_program(plan, dataset)
                self.single_pass_reason = "every feature keeps one value per row from a scalar column"
            except NotChainable as e:
                self.single_pass_reason = f"off: {e}"

    @property
    def calls(self) -> int:
        """Kernel calls made by this thread's last batch (a traced batch: the calls its graph makes)."""
        return getattr(self._local, "calls", 0)

    @calls.setter
    def calls(self, n: int) -> None:
        self._local.calls = n

    @torch.no_grad()
    def __call__(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        check_batch(raw, self.dataset, self.plan)
        why_not = self._no_single_pass(raw)
        if why_not is None and self._chain is not None:
            self.calls = 1
            dense, ids = self._chain.run(raw)
            self._count(CPP_SINGLE_PASS, True, None)
            keys = self.plan.sparse_features()
            lengths = torch.ones(len(keys) * raw.rows, dtype=torch.int32, device=ids.device)
            return dense, KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths, stride=raw.rows)
        path, native, reason = self.group_path(raw.dense.device)
        traced = self.traces.run(raw, variant=path) if self.traces is not None else None
        if traced is not None:
            dense, values, lengths = traced
            self.calls = self._traced_calls
            reason = "; ".join(r for r in (reason, "whole batch traced: one TorchScript call") if r)
            self._count(path, native, f"{reason}; single pass {why_not}")
            return dense, KeyedJaggedTensor(keys=self.plan.sparse_features(), values=values, lengths=lengths,
                                            stride=raw.rows)
        self.calls = 0
        dense, kjt = self._grouped(raw)
        self._count(path, native, f"{reason}; single pass {why_not}" if reason else f"single pass {why_not}")
        return dense, kjt

    def _grouped(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        """The batch group by group, then `finish`: the per-group path."""
        vals: dict[int, Col] = {}
        for gi, group in enumerate(self.compiled.groups):
            self._run_group(gi, group, raw, vals)
        outputs = {f: vals[n] for f, n in self.compiled.graph.outputs.items()}
        return finish(self.plan, outputs, raw.rows, raw.dense.device)

    def _grouped_outputs(self, raw: RawBatch) -> BatchOutputs:
        """The per-group path as plain tensors, what `BatchTraces` traces."""
        self.calls = 0
        dense, kjt = self._grouped(raw)
        self._traced_calls = self.calls  # the graph makes the same kernel calls
        return dense, kjt.values(), kjt.lengths()

    def _no_single_pass(self, raw: RawBatch) -> str | None:
        """Why this batch cannot take the single pass (None: it can)."""
        if self._chain is None:
            return self.single_pass_reason
        if raw.dense.device.type != "cpu":
            return f"off: the batch is on {raw.dense.device.type}, fused_chain runs on CPU"
        if not fused_ops.use_cpp():
            return "off: no C++ kernels"
        lists = sorted(k for k in raw.jagged if k in self._chain.source_names)  # over the batch's few list columns
        return f"off: list columns {lists} in the batch" if lists else None

    def group_path(self, device: torch.device) -> tuple[str, bool, str | None]:
        """(path, native, why a fallback) of one call per group on `device`."""
        if not self.native:
            return TORCH_FALLBACK, False, "native=False (FusedExecutor)"
        if device.type == "cpu":
            problem = cpu_kernels_problem()
            return (CPP_PER_GROUP, True, None) if problem is None else (TORCH_FALLBACK, False, problem)
        if device.type == "cuda" and _triton():
            return TRITON_PER_GROUP, True, None
        return TORCH_FALLBACK, False, f"no Triton kernels for {device.type} tensors"

    def _count(self, path: str, native: bool, reason: str | None, group: bool = False) -> None:
        self.last_path = path
        self.executed.add(path, native=native, reason=reason, group=group)
        if self.report:
            process_log().add(path, native=native, reason=reason, group=group)

    def describe(self) -> dict[str, Any]:
        pruned = sum(1 for d in self.demand.values() if d is not None) if self.prune else 0
        return {"executor": self.name, "pruned_nodes": pruned, "single_pass": self.single_pass_reason,
                "native": self.native, "executed": self.executed.snapshot(),
                "batch_traces": self.traces.describe() if self.traces is not None else "off",
                **self.compiled.summary()}

    def _demands(self) -> tuple[dict[int, int], dict[int, int | None]]:
        """Static row widths (scalar sources) and the row prefix each node's consumers read (None: all)."""
        graph = self.compiled.graph
        width: dict[int, int] = {}
        for n in graph.nodes:
            w = 1 if n.parent is None else width[n.parent]
            p = n.params
            if n.op == "onehot":
                w = p["C"]
            elif n.op == "firstx":
                w = min(p["X"], w)
            elif n.op == "ngram":
                w = (w - min(p["n"], w) + 1) * min(p["n"], w)
            width[n.id] = w
        outputs = set(graph.outputs.values())
        demand: dict[int, int | None] = {}
        for n in reversed(graph.nodes):  # consumers first
            reads: list[int | None] = [None] if n.id in outputs else []
            for c in graph.children.get(n.id, []):
                reads.append(self._input_demand(self._nodes[c], demand[c], width[n.id]))
            known = [r for r in reads if r is not None]
            demand[n.id] = max(known) if reads and len(known) == len(reads) else None
        return width, demand

    @staticmethod
    def _input_demand(node: Node, d_out: int | None, w_in: int) -> int | None:
        if node.op == "firstx":
            return node.params["X"] if d_out is None else min(node.params["X"], d_out)
        if node.op == "onehot":
            return 1
        if node.op == "ngram":
            return d_out if d_out is not None and d_out <= min(node.params["n"], w_in) else None
        return d_out

    # ------------------------------------------------------------------ one group

    def run_group(self, gi: int, group: FusedGroup, raw: RawBatch, vals: dict[int, Col]) -> None:
        """One (part of a) group, called from outside a batch (RAP's co-run, DALI's fallback ops): counted as a
        group call under its path."""
        self._run_group(gi, group, raw, vals)
        path, native, reason = self.group_path(raw.dense.device)
        self._count(path, native, reason, group=True)

    def _run_group(self, gi: int, group: FusedGroup, raw: RawBatch, vals: dict[int, Col]) -> None:
        nodes = [self._nodes[i] for i in group.nodes]
        if group.op == "fill_null":
            self._fill_null(nodes, raw, vals)
            return
        cols = [vals[n.input_id] for n in nodes]
        if group.op in ("firstx", "ngram"):
            self._rows_op(group.op, nodes, cols, vals)
        elif group.op == "onehot":
            for n, c in zip(nodes, cols, strict=True):
                if c.jagged or c.values.shape[1] != 1:
                    feats = ", ".join(repr(f) for f in self.compiled.graph.features_of(n.id))
                    raise BatchError(f"feature {feats}, op 'onehot': takes one value per row, got a list column "
                                     f"{n.source!r}")
            keep = [n.params["C"] if not self.prune or self.demand[n.id] is None else self.demand[n.id]
                    for n in nodes]
            outs = self._call(self._k.fused_onehot, [c.values for c in cols], [float(n.params["lo"]) for n in nodes],
                              [float(n.params["hi"]) for n in nodes], [n.params["C"] for n in nodes], keep)
            for n, o in zip(nodes, outs, strict=True):
                vals[n.id] = Col(o)
        else:
            key = (gi, str(cols[0].values.device))
            if key not in self._plans:  # value types are static: the split and the parameters are built once
                self._plans[key] = self._elementwise(gi, group.op, nodes, cols)
            for part, fn in self._plans[key]:
                outs = fn([cols[i].values for i in part])
                for i, o in zip(part, outs, strict=True):
                    vals[nodes[i].id] = Col(o, cols[i].lengths)

    def _call(self, op: Callable, *args):
        self.calls += 1
        return op(*args)

    def _fill_null(self, nodes: list[Node], raw: RawBatch, vals: dict[int, Col]) -> None:
        parts: dict[str, list[Node]] = {"dense": [], "sparse": [], "list": []}
        for n in nodes:
            kind = self._sources[n.source].kind
            parts["list" if kind == "sparse" and n.source in raw.jagged else kind].append(n)
        for kind in ("dense", "sparse"):
            if parts[kind]:
                matrix, valid = (raw.dense, raw.dense_valid) if kind == "dense" else (raw.sparse, raw.sparse_valid)
                outs = self._call(self._k.fused_fill_null_columns, matrix, valid,
                                  [self._sources[n.source].index for n in parts[kind]],
                                  [float(n.params["value"]) for n in parts[kind]], kind == "dense")
                for n, o in zip(parts[kind], outs, strict=True):
                    vals[n.id] = Col(o.unsqueeze(1))
        if parts["list"]:
            jcs = [raw.jagged[n.source] for n in parts["list"]]
            outs = self._call(self._k.fused_fill_null, [j.values for j in jcs], [j.valid for j in jcs],
                              [float(n.params["value"]) for n in parts["list"]], False)
            for n, o, j in zip(parts["list"], outs, jcs, strict=True):
                vals[n.id] = Col(o, j.lengths)

    def _rows_op(self, op: str, nodes: list[Node], cols: list[Col], vals: dict[int, Col]) -> None:
        key = "X" if op == "firstx" else "n"
        fixed = []
        for i, c in enumerate(cols):
            if c.jagged:
                continue
            w, k = c.values.shape[1], nodes[i].params[key]
            d = self.demand[nodes[i].id] if self.prune else None
            if op == "ngram" and d is not None and d <= min(k, self._width[nodes[i].input_id]):
                vals[nodes[i].id] = Col(c.values[:, :d])  # the first window's prefix is all anyone reads
                continue
            if op == "firstx" or k >= w:
                # fixed-width rows: firstx is a column slice and ngram with n >= w the identity; a view, no copy
                # (eager's x[:, :X] is a view too); the kernels and stack_columns read strided columns
                vals[nodes[i].id] = Col(c.values[:, :k] if op == "firstx" else c.values)
            else:
                fixed.append(i)
        lists = [i for i, c in enumerate(cols) if c.jagged]
        if fixed:
            fn = self._k.fused_firstx if op == "firstx" else self._k.fused_ngram
            outs = self._call(fn, [cols[i].values for i in fixed], [nodes[i].params[key] for i in fixed])
            for i, o in zip(fixed, outs, strict=True):
                vals[nodes[i].id] = Col(o)
        if lists:
            fn = self._k.fused_firstx_jagged if op == "firstx" else self._k.fused_ngram_jagged
            outs = self._call(fn, [cols[i].values for i in lists], [cols[i].lengths for i in lists],
                              [nodes[i].params[key] for i in lists])
            k = len(lists)
            for j, i in enumerate(lists):
                vals[nodes[i].id] = Col(outs[j], outs[k + j])

    def _table(self, gi: int, lists: list[list], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[int]]:
        flat, offsets = _flat_lists(lists, dtype)
        key = (gi, str(device))
        if key not in self._tables:
            self._tables[key] = flat.to(device)
        return self._tables[key], offsets

    def _elementwise(self, gi: int, op: str, nodes: list[Node], cols: list[Col]):
        """[(member indices, fn(values list) -> outputs)] for an elementwise group, split by input dtype where the
        op's kernel depends on it."""
        every = list(range(len(nodes)))
        p = [n.params for n in nodes]
        device = cols[0].values.device
        call, kern = self._call, self._k
        if op == "sigrid_hash":
            salts, moduli = [q["salt"] for q in p], [q["M"] for q in p]
            return [(every, lambda xs: call(kern.fused_sigrid_hash, xs, salts, moduli))]
        if op == "logit":
            bounds = [logit_bounds(q["eps"]) for q in p]
            lo, hi = [b[0] for b in bounds], [b[1] for b in bounds]
            return [(every, lambda xs: call(kern.fused_logit, xs, lo, hi))]
        if op == "log1p":
            return [(every, lambda xs: call(kern.fused_log1p, xs))]
        if op == "boxcox":
            lambdas = [float(q["lambda"]) for q in p]
            return [(every, lambda xs: call(kern.fused_boxcox, xs, lambdas))]
        if op == "bucketize":
            table, off = self._table(gi, [q["borders"] for q in p], torch.float32, device)
            return [(every, lambda xs: call(kern.fused_bucketize, xs, table, off))]
        if op == "mapid":
            table, off = self._table(gi, [q["map"] for q in p], torch.int64, device)
            return [(every, lambda xs: call(kern.fused_mapid, xs, table, off))]
        if op == "clamp":
            ids = [i for i in every if cols[i].values.dtype == torch.int64]
            fl = [i for i in every if i not in ids]
            out: list[tuple[list[int], Callable[[list[Tensor]], list[Tensor]]]] = []
            if ids:
                lo_i, hi_i = [int(p[i]["lo"]) for i in ids], [int(p[i]["hi"]) for i in ids]
                out.append((ids, lambda xs: call(kern.fused_clamp_id, xs, lo_i, hi_i)))
            if fl:
                lo_f, hi_f = [float(p[i]["lo"]) for i in fl], [float(p[i]["hi"]) for i in fl]
                out.append((fl, lambda xs: call(kern.fused_clamp_float, xs, lo_f, hi_f)))
            return out
        if op == "cast":
            out = []
            for target, fn in (("float", kern.fused_cast_float), ("id", kern.fused_cast_id)):
                idx = [i for i in every if p[i]["to"] == target]
                if idx:
                    # a cast to the type the values already have is a copy; the kernels take the other type only
                    same = [i for i in idx if (cols[i].values.dtype == torch.float32) == (target == "float")]
                    conv = [i for i in idx if i not in same]
                    if same:
                        out.append((same, lambda xs: [x.clone() for x in xs]))
                    if conv:
                        out.append((conv, partial(call, fn)))  # call(fn, xs), this iteration's fn
            return out
        raise ValueError(f"FusedExecutor: no fused kernel for op {op!r}")
