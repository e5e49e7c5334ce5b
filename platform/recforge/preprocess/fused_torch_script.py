"""The fused groups' torch fallback as TorchScript functions: RAP's unfused baseline without Python dispatch.

`recforge_kernels.fused_torch` runs each fused op as a chain of torch ops called from Python: one torch kernel per
op (unfused), but each op's argument parsing and the Python between ops hold the GIL. Here every fused op is the
same chain of the same torch ops compiled with `torch.jit.script`: still one kernel per op, but a whole group's
chain runs in the TorchScript interpreter, which releases the GIL for the call (torch/csrc/jit/python: a
ScriptFunction called from Python runs under `gil_scoped_release`). A thread running these (RAP's co-run thread)
then leaves the GIL to the trainer while it works. Values equal `fused_torch`'s (the same ops in the same order, no
fuser: the CPU fuser is off by default) and so the C++ kernels'.

    executor = ScriptedFusedExecutor(plan, dataset)   # FusedExecutor(native=False) with these kernels

A whole batch without list columns runs as one traced TorchScript graph (the groups and `finish`'s ops: the fused
executor's batch traces); only `check_batch` and the KJT's Python wrapper then take the GIL. Group by group
(`run_group`, RAP's spread co-run schedules, and batches with list columns) FusedExecutor's per-group Python takes it
between the scripted calls: a few times per batch instead of once per op. `script_s` counts the time inside
TorchScript calls.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from recforge.config import DatasetConfig
from recforge.preprocess.executors.batch_trace import BatchTraces
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.executors.record import TORCH_FALLBACK
from recforge.preprocess.planning.compiler import CompiledPlan, CompileMethod
from recforge.preprocess.planning.plan import Plan

# constants are literals below (TorchScript reads no module globals): -7070675565921424023 is
# recforge_kernels.reference.KMUL (0x9DDFEA08EB382D69) as a signed int64, the same bits, so products wrap the same;
# 9223372036854775807 and -9223372036854775807 - 1 are int64's bounds


def _lsr(x: Tensor, k: int) -> Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _sigrid_hash_raw(x: Tensor, salt: int) -> Tensor:
    key = (~x) + (x << 21)  # twang_mix64
    key = key ^ _lsr(key, 24)
    key = key + (key << 3) + (key << 8)
    key = key ^ _lsr(key, 14)
    key = key + (key << 2) + (key << 4)
    key = key ^ _lsr(key, 28)
    key = key + (key << 31)
    a = (key ^ salt) * -7070675565921424023  # hash_128_to_64(salt, key)
    a = a ^ _lsr(a, 47)
    b = (a ^ salt) * -7070675565921424023
    b = b ^ _lsr(b, 47)
    return b * -7070675565921424023


def fill_null(xs: list[Tensor], valids: list[Tensor], values: list[float], dense: bool) -> list[Tensor]:
    out: list[Tensor] = []
    for i in range(len(xs)):
        x, v = xs[i], valids[i]
        if dense:
            y = torch.where(v, x.to(torch.float32), torch.tensor(values[i], dtype=torch.float32, device=x.device))
        else:
            y = torch.where(v, x.to(torch.int64), torch.tensor(int(values[i]), dtype=torch.int64, device=x.device))
        out.append(y.contiguous())
    return out


def fill_null_columns(x: Tensor, valid: Tensor, cols: list[int], values: list[float], dense: bool) -> list[Tensor]:
    return fill_null([x[:, c] for c in cols], [valid[:, c] for c in cols], values, dense)


def cast_float(xs: list[Tensor]) -> list[Tensor]:
    return [x.to(torch.float32) for x in xs]


def cast_id(xs: list[Tensor]) -> list[Tensor]:
    out: list[Tensor] = []
    for x in xs:
        big, small = x >= 2.0**63, x < -(2.0**63)
        safe = torch.where(big | small | torch.isnan(x), torch.zeros_like(x), x)
        y = torch.trunc(safe).to(torch.int64)
        y = torch.where(big, torch.full_like(y, 9223372036854775807), y)
        out.append(torch.where(small, torch.full_like(y, -9223372036854775807 - 1), y))
    return out


def clamp_float(xs: list[Tensor], lo: list[float], hi: list[float]) -> list[Tensor]:
    return [torch.clamp(xs[i], lo[i], hi[i]) for i in range(len(xs))]


def clamp_id(xs: list[Tensor], lo: list[int], hi: list[int]) -> list[Tensor]:
    return [torch.clamp(xs[i], lo[i], hi[i]) for i in range(len(xs))]


def bucketize(xs: list[Tensor], borders: Tensor, offsets: list[int]) -> list[Tensor]:
    b = borders.to(torch.float32)
    out: list[Tensor] = []
    for f in range(len(xs)):
        x = xs[f]
        out.append((x.unsqueeze(-1) > b[offsets[f]:offsets[f + 1]].to(x.device)).sum(-1, dtype=torch.int64))
    return out


def mapid(xs: list[Tensor], table: Tensor, offsets: list[int]) -> list[Tensor]:
    out: list[Tensor] = []
    for f in range(len(xs)):
        x = xs[f]
        t = table[offsets[f]:offsets[f + 1]].to(device=x.device, dtype=torch.int64)
        if t.numel() == 0:
            out.append(torch.zeros_like(x))
        else:
            inside = (x >= 0) & (x < t.numel())
            out.append(torch.where(inside, t[torch.where(inside, x, torch.zeros_like(x))], torch.zeros_like(x)))
    return out


def sigrid_hash(xs: list[Tensor], salts: list[int], moduli: list[int]) -> list[Tensor]:
    return [torch.remainder(_sigrid_hash_raw(xs[i], salts[i]), moduli[i]) for i in range(len(xs))]


def logit(xs: list[Tensor], lo: list[float], hi: list[float]) -> list[Tensor]:
    out: list[Tensor] = []
    for i in range(len(xs)):
        t = torch.clamp(xs[i], lo[i], hi[i]).to(torch.float64)
        out.append(torch.log(t / (1.0 - t)).to(torch.float32))
    return out


def log1p(xs: list[Tensor]) -> list[Tensor]:
    return [torch.log1p(torch.clamp(x.to(torch.float64), min=0.0)).to(torch.float32) for x in xs]


def boxcox(xs: list[Tensor], lambdas: list[float]) -> list[Tensor]:
    out: list[Tensor] = []
    for i in range(len(xs)):
        x = xs[i]
        lam = float(torch.tensor(lambdas[i], dtype=torch.float32).item())  # the C++ kernels' float32 lambda
        pos = x > 0
        safe = torch.where(pos, x, torch.ones_like(x)).to(torch.float64)
        if lam == 0:
            y = torch.log(safe)
        else:
            y = (torch.pow(safe, lam) - 1.0) / lam
        out.append(torch.where(pos, y.to(torch.float32), x))
    return out


def onehot(xs: list[Tensor], lo: list[float], hi: list[float], classes: list[int], keep: list[int]) -> list[Tensor]:
    out: list[Tensor] = []
    for i in range(len(xs)):
        x, c = xs[i], classes[i]
        xf = x.reshape(-1).to(torch.float32)
        l32 = torch.tensor(lo[i], dtype=torch.float32, device=xf.device)
        h32 = torch.tensor(hi[i], dtype=torch.float32, device=xf.device)
        q = (xf - l32) / ((h32 - l32) / float(c))
        idx = torch.where((q >= 0) & (q < c), q, torch.zeros_like(q)).to(torch.int64)
        out.append((idx.unsqueeze(1) == torch.arange(min(c, keep[i]), device=x.device)).to(torch.float32))
    return out


def _ngram_index(w: int, n: int, device: torch.device) -> Tensor:
    k = min(n, w)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return (torch.arange(w - k + 1, device=device)[:, None] + torch.arange(k, device=device)[None, :]).reshape(-1)


def firstx(xs: list[Tensor], X: list[int]) -> list[Tensor]:
    return [xs[i][:, :X[i]].contiguous() for i in range(len(xs))]


def ngram(xs: list[Tensor], n: list[int]) -> list[Tensor]:
    return [xs[i].index_select(1, _ngram_index(xs[i].shape[1], n[i], xs[i].device)) for i in range(len(xs))]


def _positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(rows.numel(), device=lengths.device) - starts[rows]


def firstx_jagged(values: list[Tensor], lengths: list[Tensor], X: list[int]) -> list[Tensor]:
    vs: list[Tensor] = []
    ls: list[Tensor] = []
    for i in range(len(values)):
        ln = lengths[i].to(torch.int64)
        pos = _positions(ln)[1]
        vs.append(values[i][pos < X[i]])
        ls.append(torch.clamp(ln, max=X[i]))
    return vs + ls


def ngram_jagged(values: list[Tensor], lengths: list[Tensor], n: list[int]) -> list[Tensor]:
    vs: list[Tensor] = []
    ls: list[Tensor] = []
    for i in range(len(values)):
        ln = lengths[i].to(torch.int64)
        k = torch.clamp(ln, max=n[i])
        out_len = (ln - k + 1) * k
        rows, pos = _positions(out_len)
        starts = torch.cumsum(ln, 0) - ln
        kr = k[rows].clamp(min=1)
        vs.append(values[i][starts[rows] + torch.div(pos, kr, rounding_mode="floor") + pos % kr])
        ls.append(out_len)
    return vs + ls


OPS = ("fill_null", "fill_null_columns", "cast_float", "cast_id", "clamp_float", "clamp_id", "bucketize", "mapid",
       "sigrid_hash", "logit", "log1p", "boxcox", "onehot", "firstx", "ngram", "firstx_jagged", "ngram_jagged")
_SCRIPTED: dict[str, Any] = {}


def scripted(name: str) -> Any:
    """The TorchScript function of fused op `name` (without the `fused_` prefix), compiled once per process."""
    if name not in OPS:
        raise ValueError(f"fused_torch_script: no TorchScript fallback for op {name!r}; ops: {list(OPS)}")
    if name not in _SCRIPTED:
        _SCRIPTED[name] = torch.jit.script(globals()[name])
    return _SCRIPTED[name]


class ScriptKernels:
    """`recforge::fused_*` by name as the TorchScript fallback (FusedExecutor's kernel table, `_k`)."""

    def __getattr__(self, name: str) -> Any:
        fn = scripted(name.removeprefix("fused_"))
        if name.removeprefix("fused_") == "onehot":
            inner = fn

            def fn(xs, lo, hi, classes, keep=None):  # fused_torch.onehot's optional keep
                return inner(xs, lo, hi, classes, list(classes) if keep is None else list(keep))
        setattr(self, name, fn)
        return fn


class ScriptedFusedExecutor(FusedExecutor):
    """FusedExecutor(native=False) whose groups run the TorchScript fallback (`ScriptKernels`): the same groups,
    values and per-op kernels as the torch fallback, each group one GIL-free interpreter call.

    `whole_batch=True` (default): a whole CPU batch without list columns runs as one traced TorchScript graph from its
    first call (every group's scripted calls and `finish`'s ops: FusedExecutor's `trace_batches`), so the executor's
    Python between groups does not take the GIL either; only the KJT's Python wrapper does. Still one kernel per op.
    `run_group` (RAP's co-run of single groups) runs group by group as above."""

    name = "fused"

    def __init__(self, plan: Plan, dataset: DatasetConfig, method: CompileMethod = "milp",
                 compiled: CompiledPlan | None = None, prune: bool = True, report: bool = True,
                 whole_batch: bool = True) -> None:
        super().__init__(plan, dataset, method=method, compiled=compiled, prune=prune, single_pass=False,
                         native=False, report=report, trace_batches=False)
        self._k = ScriptKernels()
        self.whole_batch = whole_batch
        # the per-group path here is slow (the torch ops' fallback): trace a shape the first time it is seen
        self.traces = BatchTraces(self._grouped_outputs, after=1) if whole_batch else None
        self.single_pass_reason = "off (TorchScript fallback: fused_chain exists in C++ only)"
        self._group_s = 0.0  # seconds inside the per-group scripted calls

    @property
    def script_s(self) -> float:
        """Seconds spent inside TorchScript calls (the GIL released), all batches and groups."""
        return self._group_s + (self.traces.seconds if self.traces is not None else 0.0)

    def _call(self, op: Callable, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super()._call(op, *args)
        finally:
            self._group_s += time.perf_counter() - t0

    def group_path(self, device: torch.device) -> tuple[str, bool, str | None]:
        return TORCH_FALLBACK, False, "native=False, TorchScript (ScriptedFusedExecutor)"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "torchscript": "whole batch traced" if self.whole_batch else "per group"}
