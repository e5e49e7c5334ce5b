"""The DALI executor: the plan's ops that DALI can express, as one NVIDIA DALI pipeline; the rest on the fused
executor, named in the log and in describe() (which the pipeline logs to MLflow), never silently.

DALI expresses (exactly, NaN and +-inf included): fill_null of scalar columns (int64, and float64 dense columns),
cast to float, logit, clamp,
bucketize, sigrid_hash (in uint64 arithmetic: shifts as multiplications and floor divisions by powers of two,
the modulus through DALI's unsigned %) and firstx of one value per row. It cannot express onehot and ngram
(width-changing rows), mapid (no gather), boxcox (no select: a masked form turns +inf into NaN), log1p (no log1p
in DALI's math; log(1 + x) loses float32 digits for small x) and cast to id
(DALI's float->int conversion saturates NaN differently); a node after a fallback node falls back too, and a
batch with list (multi-hot) columns or no rows runs wholly on the fused executor.
CPU pipelines run with device_id=None; device="gpu" moves the inputs to GPU 0 with .gpu() (needs a GPU).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import Col, check_batch, finish, sources
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.executors.record import DALI, NATIVE, ExecutionLog, process_log
from recforge.preprocess.planning.compiler import CompileMethod, FusedGroup
from recforge.preprocess.planning.graph import Node
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.semantics.ops import logit_bounds

log = logging.getLogger(__name__)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
KMUL = 0x9DDFEA08EB382D69
# uint64 constants fed to the pipeline (DALI's constant nodes hold 32-bit values only)
U64 = {"kmul": KMUL, "ones": 2**64 - 1, "m21": 2**21, "m3": 2**3, "m8": 2**8, "m2": 2**2, "m4": 2**4, "m31": 2**31,
       "d24": 2**24, "d14": 2**14, "d28": 2**28, "d47": 2**47, "d63": 2**63}
WHY_NOT = {
    "onehot": "changes the row width (one value -> C)",
    "ngram": "changes the row width",
    "mapid": "needs a gather DALI has no op for",
    "boxcox": "needs a select; DALI's masked arithmetic turns +inf into NaN",
    "log1p": "DALI's math has no log1p (log(1 + x) loses float32 digits for small x)",
    "cast": "DALI's float -> int64 conversion differs on NaN / out of range (cast to float is expressed)",
}


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401  # lazy: optional and heavy; this probe only asks whether it imports
    except ImportError:
        return False
    return True


def _value_type(node: Node, parent_type: str | None, source_kind: str) -> str:
    """'float' or 'id': what `node` outputs."""
    if node.op == "fill_null":
        return "float" if source_kind == "dense" else "id"
    if node.op == "cast":
        return node.params["to"]
    if node.op in ("bucketize", "sigrid_hash", "mapid"):
        return "id"
    if node.op == "onehot":
        return "float"
    assert parent_type is not None  # only fill_null (above) starts a chain
    return parent_type


def _reason(node: Node, in_dali: dict[int, bool], vtype: dict[int, str]) -> str | None:
    """None when DALI can run `node` exactly (every node it runs holds one value per row), else why not."""
    if node.parent is not None and not in_dali[node.parent]:
        return "its input is computed outside DALI"
    op, p = node.op, node.params
    if op == "cast":
        return None if p["to"] == "float" else WHY_NOT["cast"]
    if op in WHY_NOT:
        return WHY_NOT[op]
    if op == "fill_null" and vtype[node.id] == "id" and not INT32_MIN <= int(p["value"]) <= INT32_MAX:
        return "fill value outside int32 (DALI constants are 32-bit)"
    if op == "clamp" and vtype[node.id] == "id" and not (INT32_MIN <= int(p["lo"]) and int(p["hi"]) <= INT32_MAX):
        return "id bounds outside int32 (DALI constants are 32-bit)"
    return None  # firstx: its input holds one value per row here (nothing DALI runs widens a row)


def plan_fallbacks(compiled, dataset: DatasetConfig) -> dict[int, str]:
    """Node id -> why DALI cannot run it, for a compiled plan (no DALI import needed: plan stages log this)."""
    src = sources(dataset)
    vtype: dict[int, str] = {}
    in_dali: dict[int, bool] = {}
    out: dict[int, str] = {}
    for n in compiled.graph.nodes:  # parents come first
        parent_type = vtype[n.parent] if n.parent is not None else None
        vtype[n.id] = _value_type(n, parent_type, src[n.source].kind)
        why = _reason(n, in_dali, vtype)
        in_dali[n.id] = why is None
        if why:
            out[n.id] = why
    return out


def fallback_summary(compiled, dataset: DatasetConfig) -> dict[str, Any]:
    """{"dali_ops": n, "fallback_ops": m, "fallback_by_op": {op: count}, "fallback_reasons": {type: why}}."""
    fb = plan_fallbacks(compiled, dataset)
    by_op: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for i, why in fb.items():
        n = compiled.graph.nodes[i]
        by_op[n.op] = by_op.get(n.op, 0) + 1
        reasons.setdefault(n.type, why)
    return {"dali_ops": len(compiled.graph.nodes) - len(fb), "fallback_ops": len(fb), "fallback_by_op": by_op,
            "fallback_reasons": reasons}


class DaliExecutor:
    name = "dali"

    def __init__(self, plan: Plan, dataset: DatasetConfig, method: CompileMethod = "milp", num_threads: int = 1,
                 device: str = "cpu", report: bool = True):
        if not dali_available():
            raise RuntimeError("the dali executor needs NVIDIA DALI: pip install nvidia-dali-cuda130==2.4.0")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"DaliExecutor: device must be 'cpu' or 'gpu', got {device!r}")
        self.fused = FusedExecutor(plan, dataset, method=method, report=False)  # this executor reports its batches
        self.report = report
        self.executed = ExecutionLog()  # per batch (recforge.preprocess.executors.record)
        self.plan, self.dataset, self.compiled = plan, dataset, self.fused.compiled
        self.device, self.num_threads = device, num_threads
        self._sources = sources(dataset)
        graph = self.compiled.graph
        self.vtype: dict[int, str] = {}
        for n in graph.nodes:
            parent_type = self.vtype[n.parent] if n.parent is not None else None
            self.vtype[n.id] = _value_type(n, parent_type, self._sources[n.source].kind)
        self.fallback = plan_fallbacks(self.compiled, dataset)
        self._fallback_by_op = fallback_summary(self.compiled, dataset)["fallback_by_op"]
        in_dali = {n.id: n.id not in self.fallback for n in graph.nodes}
        self.in_dali = in_dali
        needed = set(graph.outputs.values()) | {n.parent for n in graph.nodes if n.parent is not None}
        self._outputs = [n.id for n in graph.nodes if in_dali[n.id] and n.id in needed
                         and (n.id in graph.outputs.values()
                              or any(not in_dali[c] for c in graph.children.get(n.id, [])))]
        rest = [FusedGroup(g.layer, g.op, g.cls, tuple(i for i in g.nodes if not in_dali[i]))
                for g in self.compiled.groups]
        self._rest = [(gi, g) for gi, g in enumerate(rest) if g.nodes]
        self._hash_nodes = [n.id for n in graph.nodes if in_dali[n.id] and n.op == "sigrid_hash"]
        self._hash_params = np.array([v for i in self._hash_nodes for v in (self._salt_bits(i), self._modulus(i))],
                                     dtype=np.uint64)
        self._pipes: dict[torch.dtype, Any] = {}  # by the dense matrix's dtype (int64, or float64: float columns)
        self.whole_batch_fallbacks = 0
        if self.fallback:
            log.warning("dali executor, plan %s: %d of %d ops fall back to the fused executor: %s",
                        plan.name, len(self.fallback), len(graph.nodes), self._fallback_summary())

    def _salt_bits(self, node: int) -> int:
        return self.compiled.graph.nodes[node].params["salt"] & (2**64 - 1)

    def _modulus(self, node: int) -> int:
        return self.compiled.graph.nodes[node].params["M"]

    def _fallback_summary(self) -> dict[str, str]:
        return fallback_summary(self.compiled, self.dataset)["fallback_reasons"]

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "dali_device": self.device, "dali_threads": self.num_threads,
                **fallback_summary(self.compiled, self.dataset),
                "whole_batch_fallbacks": self.whole_batch_fallbacks, "executed": self.executed.snapshot(),
                **self.compiled.summary()}

    def _count(self, path: str, native: bool, reason: str) -> None:
        self.executed.add(path, native=native, reason=reason)
        if self.report:
            process_log().add(path, native=native, reason=reason)

    # ------------------------------------------------------------------ pipeline

    def _pipe(self, dense_dtype: torch.dtype):
        """The pipeline for raw dense matrices of `dense_dtype`, built on first use (None: nothing runs in DALI)."""
        if not self._outputs:
            return None
        if dense_dtype not in self._pipes:
            self._pipes[dense_dtype] = self._build(dense_dtype == torch.float64)
        return self._pipes[dense_dtype]

    def _build(self, float_dense=False):  # untyped, as before: DALI's stubs type device_id as int only
        import nvidia.dali.math as dmath  # lazy: DALI is optional and heavy; only a DALI pipeline build needs it
        from nvidia.dali import fn, pipeline_def, types  # lazy: as above

        graph = self.compiled.graph
        gpu = self.device == "gpu"

        @pipeline_def(batch_size=1, num_threads=self.num_threads, device_id=0 if gpu else None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipeline():
            dtypes = {"dense": types.FLOAT64 if float_dense else types.INT64, "sparse": types.INT64}
            raw = {k: fn.external_source(name=k, dtype=dtypes.get(k, types.BOOL), ndim=2)
                   for k in ("dense", "dense_valid", "sparse", "sparse_valid")}
            u64 = fn.external_source(name="u64", dtype=types.UINT64, ndim=1)
            hp = fn.external_source(name="hash_params", dtype=types.UINT64, ndim=1)
            if gpu:
                raw = {k: v.gpu() for k, v in raw.items()}
                u64, hp = u64.gpu(), hp.gpu()
            c = {k: u64[i:i + 1] for i, k in enumerate(U64)}
            hash_slot = {n: i for i, n in enumerate(self._hash_nodes)}
            out: dict[int, Any] = {}
            for n in graph.nodes:
                if not self.in_dali[n.id]:
                    continue
                if n.parent is None:
                    src = self._sources[n.source]
                    x, v = raw[src.kind][:, src.index], raw[f"{src.kind}_valid"][:, src.index]
                    out[n.id] = self._fill_null(fn, types, n, src.kind, x, v)
                else:
                    out[n.id] = self._op(fn, types, dmath, n, out[n.parent], c, hp, hash_slot)
            return tuple(out[i] for i in self._outputs)

        pipe = pipeline()
        pipe.build()
        return pipe

    @staticmethod
    def _fill_null(fn, types, n: Node, kind: str, x, v):
        # x * valid + value * missing is exact: raw values are integers or floats whose null slots the caller zeroed
        # (inf * 0 would be NaN), value is finite
        missing = v == 0
        value = n.params["value"]
        if kind == "dense":
            return fn.cast(x, dtype=types.FLOAT) * v + float(value) * missing
        return x * v + int(value) * missing

    def _op(self, fn, types, dmath, n: Node, x, c, hp, hash_slot):
        p = n.params
        if n.op == "cast":
            return fn.cast(x, dtype=types.FLOAT)
        if n.op == "logit":
            lo, hi = logit_bounds(p["eps"])
            t = fn.cast(dmath.clamp(x, lo, hi), dtype=types.FLOAT64)
            return fn.cast(dmath.log(t / (1.0 - t)), dtype=types.FLOAT)
        if n.op == "clamp":
            if self.vtype[n.id] == "id":
                return dmath.clamp(x, int(p["lo"]), int(p["hi"]))
            return dmath.clamp(x, float(np.float32(p["lo"])), float(np.float32(p["hi"])))
        if n.op == "bucketize":
            y = None
            for b in p["borders"]:
                term = fn.cast(x > float(np.float32(b)), dtype=types.INT64)
                y = term if y is None else y + term
            return y
        if n.op == "firstx":
            return x
        if n.op == "sigrid_hash":
            i = hash_slot[n.id]
            salt, mod = hp[2 * i:2 * i + 1], hp[2 * i + 1:2 * i + 2]
            key = fn.reinterpret(x, dtype=types.UINT64)
            key = (key ^ c["ones"]) + key * c["m21"]  # ~key + (key << 21)
            key = key ^ (key // c["d24"])
            key = key + key * c["m3"] + key * c["m8"]
            key = key ^ (key // c["d14"])
            key = key + key * c["m2"] + key * c["m4"]
            key = key ^ (key // c["d28"])
            key = key + key * c["m31"]  # twang_mix64 done
            a = (key ^ salt) * c["kmul"]  # hash_128_to_64(upper = salt, lower = key)
            a = a ^ (a // c["d47"])
            b = (salt ^ a) * c["kmul"]
            b = b ^ (b // c["d47"])
            h = b * c["kmul"]
            s = h // c["d63"]  # 1 when the signed hash is negative
            r = (h ^ (s * c["ones"])) % mod  # |h| - s lies in [0, 2^63)
            y = r + s * (mod - r - r - s)  # s ? mod - 1 - r : r, in wrapping uint64
            return fn.cast(y, dtype=types.INT64)
        raise ValueError(f"DaliExecutor: op {n.op!r} is not expressed in DALI")

    # ------------------------------------------------------------------ run

    def _uses_lists(self, raw: RawBatch) -> bool:
        return any(s in raw.jagged for s in self.plan.sources())

    @torch.no_grad()
    def __call__(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        check_batch(raw, self.dataset, self.plan)
        if raw.rows == 0 or self._uses_lists(raw) or raw.dense.device.type != "cpu":
            why = "no rows" if raw.rows == 0 else "list columns" if self._uses_lists(raw) else "device data"
            if self.whole_batch_fallbacks == 0:
                log.warning("dali executor: batch with %s runs on the fused executor", why)
            self.whole_batch_fallbacks += 1
            out = self.fused(raw)
            path = self.fused.last_path or "torch_fallback"
            self._count(path, path in NATIVE, f"dali: a batch with {why} ran wholly on the fused executor")
            return out
        vals: dict[int, Col] = {}
        pipe = self._pipe(raw.dense.dtype)
        if pipe is not None:
            dense = raw.dense
            if dense.is_floating_point():  # a null slot holding inf / NaN would poison x * valid
                dense = torch.where(raw.dense_valid, dense, torch.zeros((), dtype=dense.dtype))
            feeds = {"dense": dense, "dense_valid": raw.dense_valid, "sparse": raw.sparse,
                     "sparse_valid": raw.sparse_valid}
            for k, t in feeds.items():
                pipe.feed_input(k, [np.ascontiguousarray(t.numpy())])
            pipe.feed_input("u64", [np.array(list(U64.values()), dtype=np.uint64)])
            pipe.feed_input("hash_params", [self._hash_params])
            outs = pipe.run()
            for node, o in zip(self._outputs, outs, strict=True):
                if self.device == "gpu":
                    o = o.as_cpu()
                vals[node] = Col(torch.from_numpy(np.array(o.as_tensor())).reshape(raw.rows, 1))
        for gi, group in self._rest:
            self.fused.run_group(gi, group, raw, vals)
        if self._rest:
            path, native, problem = self.fused.group_path(raw.dense.device)
            self._count(DALI, native, f"ops DALI cannot express {self._fallback_by_op} ran {path}"
                        + (f" ({problem})" if problem else ""))
        else:
            self._count(DALI, False, "every op in DALI (recforge_kernels not used)")
        outputs = {f: vals[n] for f, n in self.compiled.graph.outputs.items()}
        return finish(self.plan, outputs, raw.rows, raw.dense.device)
