"""Resource-performance model: a job's throughput as a function of its resources (DLRover-RM §3).

    T_step(a) = sum_k c_k * term_k(a),  c_k >= 0      throughput(a) = workers * B / T_step(a)

`TERMS` are the candidate terms, `select_terms` picks a subset, `fit` solves NNLS on relative error, and
`OnlineThroughputModel` refits as the job runs, pulled towards a prior. Design: docs/dlrover_rm.md#the-throughput-model.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

import numpy as np
from scipy.optimize import nnls


class ModelFitError(ValueError):
    """The points cannot support a fit (too few, non-positive throughput, unknown term)."""


def _nnls_core() -> Callable | None:
    """scipy's compiled NNLS (what `scipy.optimize.nnls` calls after its checks: x, rnorm, info), when this scipy
    has it with that signature and it gives the public function's answer; None otherwise (the public one is used).
    `fit` calls NNLS six times per refit on arrays it built itself, so the wrapper's checks were a third of it."""
    try:
        from scipy.optimize._slsqplib import nnls as core  # lazy: private scipy module, may be absent (then None)
        a, b = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), np.array([2.0, 1.0, -1.0])
        x, rnorm, info = core(a, b, 6)
        px, prnorm = nnls(a, b, maxiter=6)
        if info != 1 or not np.array_equal(x, px) or rnorm != prnorm:
            return None
        return core
    except Exception:  # noqa: BLE001  # any other scipy: the public function
        return None


_NNLS_CORE = _nnls_core()


def solve_nnls(a: np.ndarray, b: np.ndarray, what: str, maxiter: int | None = None) -> np.ndarray:
    """scipy's NNLS solution; its non-convergence (a RuntimeError) and bad input as a ModelFitError naming `what`.
    C-ordered float64 2-D / 1-D inputs of matching length with finite values go to scipy's compiled solver directly
    (`_NNLS_CORE`: the same solution, without the wrapper's per-call overhead); anything else through `nnls`."""
    if (_NNLS_CORE is not None and type(a) is np.ndarray and type(b) is np.ndarray and a.dtype == np.float64
            and b.dtype == np.float64 and a.ndim == 2 and b.ndim == 1 and a.shape[0] == b.shape[0]
            and a.flags.c_contiguous and np.isfinite(a).all() and np.isfinite(b).all()):
        x, _, info = _NNLS_CORE(a, b, maxiter or 3 * a.shape[1])
        if info == 3:
            raise ModelFitError(f"{what}: NNLS did not converge (Maximum number of iterations reached.)")
        return x
    try:
        x, _ = nnls(a, b, maxiter=maxiter)
    except RuntimeError as e:  # scipy: "Maximum number of iterations reached."
        raise ModelFitError(f"{what}: NNLS did not converge ({e})") from e
    except ValueError as e:  # scipy's checks: shapes, NaN or inf in the points
        raise ModelFitError(f"{what}: NNLS refused the points ({e})") from e
    return x


@dataclass(frozen=True)
class Allocation:
    """The resources of one job: workers, CPU cores (threads) per worker, per-worker batch size, and
    for parameter-server jobs the number of servers and their cores. `host_cores`: cores of the one
    machine all workers share (None: every worker has its own cores, as pods on a cluster do)."""

    workers: int
    cpu_per_worker: float
    batch_size: int
    servers: int = 0
    cpu_per_server: float = 0.0
    host_cores: float | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"Allocation.workers must be >= 1, got {self.workers}")
        if self.cpu_per_worker <= 0:
            raise ValueError(f"Allocation.cpu_per_worker must be > 0, got {self.cpu_per_worker}")
        if self.batch_size < 1:
            raise ValueError(f"Allocation.batch_size must be >= 1, got {self.batch_size}")
        if self.servers < 0 or (self.servers > 0 and self.cpu_per_server <= 0):
            raise ValueError(f"Allocation: servers={self.servers} needs cpu_per_server > 0, got {self.cpu_per_server}")

    def replace(self, **kw) -> Allocation:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(kw)
        return Allocation(**d)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping) -> Allocation:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class Sample:
    allocation: Allocation
    samples_per_s: float
    weight: float = 1.0


def _cols(allocs: Sequence[Allocation]) -> dict[str, np.ndarray]:
    # one array built from tuples, then columns: stage 2 calls this on every report of every job
    return _cols_of_rows([(a.workers, a.cpu_per_worker, a.batch_size, max(a.servers, 0),
                           a.cpu_per_server if a.servers else 1.0, a.host_cores if a.host_cores else np.inf)
                          for a in allocs])


def _cols_of_rows(rows: Sequence[tuple]) -> dict[str, np.ndarray]:
    m = np.array(rows, dtype=float).reshape(-1, 6).T
    return {"w": m[0], "c": m[1], "b": m[2], "p": m[3], "cp": m[4], "host": m[5]}


def _oversub(v: dict[str, np.ndarray]) -> np.ndarray:
    # Threads beyond the host's cores time-share: compute slows by (threads wanted / cores), >= 1.
    return np.maximum(1.0, v["w"] * v["c"] / v["host"])


def _safe_p(v):
    return np.where(v["p"] > 0, v["p"], np.inf)


# name -> (function of the columns, description). Each is a per-step time contribution before its coefficient.
TERMS: dict[str, tuple[Callable[[dict[str, np.ndarray]], np.ndarray], str]] = {
    "const": (lambda v: np.ones_like(v["w"]), "fixed per-step overhead (launch, optimizer, python)"),
    "b_per_cpu": (lambda v: v["b"] / v["c"], "worker compute that threads parallelise"),
    "b": (lambda v: v["b"], "per-sample work that threads do not speed up"),
    "b_per_cpu_oversub": (lambda v: v["b"] / v["c"] * _oversub(v),
                          "worker compute, slowed when threads exceed the host's cores"),
    "b_oversub": (lambda v: v["b"] * _oversub(v), "serial per-sample work, slowed by oversubscription"),
    "b_threads": (lambda v: v["b"] * (v["c"] - 1),
                  "per-sample cost of extra threads contending (spin-waits on a busy host)"),
    "bw_threads": (lambda v: v["b"] * v["w"] * (v["c"] - 1), "thread contention that grows with co-located workers"),
    "w": (lambda v: v["w"], "collective / fan-out latency growing with workers"),
    "bw": (lambda v: v["b"] * v["w"], "all-to-all / gradient volume growing with global batch"),
    "log_w": (lambda v: np.log2(v["w"]), "tree/ring collective latency"),
    "ps_load": (lambda v: np.where(v["p"] > 0, v["w"] / _safe_p(v) * v["b"] / v["cp"], 0.0),
                "server compute per server: (w/p)*B/cpu_p"),
    "ps_fanin": (lambda v: np.where(v["p"] > 0, v["w"] / _safe_p(v), 0.0), "requests per server: w/p"),
    "ps_count": (lambda v: v["p"], "fan-out to p servers"),
}

# The parameter-server form of docs/dlrover_rm.md: [1, B/λw, (w/p)·B/λp, w/p, p, w].
PS_TERMS = ("const", "b_per_cpu", "ps_load", "ps_fanin", "ps_count", "w")
# Candidates for our all-reduce/all-to-all TorchRec trainer on one shared host.
LOCAL_CANDIDATES = ("const", "b_per_cpu", "b", "b_per_cpu_oversub", "b_oversub", "b_threads", "bw_threads", "w", "bw",
                    "log_w")


def _row_oversub(w: float, c: float, host: float) -> float:
    return max(1.0, w * c / host)


# The same terms on one allocation's scalars (w, c, b, p, cp, host), for the per-row path of `predict`: the same
# arithmetic in the same order as the array forms above (log2 may differ from numpy's in the last bit).
ROW_TERMS: dict[str, Callable[[float, float, float, float, float, float], float]] = {
    "const": lambda w, c, b, p, cp, h: 1.0,
    "b_per_cpu": lambda w, c, b, p, cp, h: b / c,
    "b": lambda w, c, b, p, cp, h: b,
    "b_per_cpu_oversub": lambda w, c, b, p, cp, h: b / c * _row_oversub(w, c, h),
    "b_oversub": lambda w, c, b, p, cp, h: b * _row_oversub(w, c, h),
    "b_threads": lambda w, c, b, p, cp, h: b * (c - 1),
    "bw_threads": lambda w, c, b, p, cp, h: b * w * (c - 1),
    "w": lambda w, c, b, p, cp, h: w,
    "bw": lambda w, c, b, p, cp, h: b * w,
    "log_w": lambda w, c, b, p, cp, h: math.log2(w),
    "ps_load": lambda w, c, b, p, cp, h: w / p * b / cp if p > 0 else 0.0,
    "ps_fanin": lambda w, c, b, p, cp, h: w / p if p > 0 else 0.0,
    "ps_count": lambda w, c, b, p, cp, h: p,
}
ROW_PATH_MAX = 32  # up to this many allocations `predict` evaluates row by row (numpy's per-call overhead dominates)

# ROW_TERMS's formulas as source, for `_row_evaluator`: the same operations in the same order (bit for bit, tested)
_ROW_SRC = {
    "const": "1.0",
    "b_per_cpu": "(b / c)",
    "b": "b",
    "b_per_cpu_oversub": "(b / c * max(1.0, w * c / h))",
    "b_oversub": "(b * max(1.0, w * c / h))",
    "b_threads": "(b * (c - 1))",
    "bw_threads": "(b * w * (c - 1))",
    "w": "w",
    "bw": "(b * w)",
    "log_w": "log2(w)",
    "ps_load": "(w / p * b / cp if p > 0 else 0.0)",
    "ps_fanin": "(w / p if p > 0 else 0.0)",
    "ps_count": "p",
}
_ROW_EVALUATORS: dict[tuple[str, ...], Callable] = {}


def _row_evaluator(terms: tuple[str, ...]) -> Callable:
    """f(rows, coef) -> samples/s per row for this term set, compiled once per term set: `predict_rows`'s
    arithmetic (t = 0.0; t += k_i * term_i in term order) without a Python call per term and row."""
    f = _ROW_EVALUATORS.get(terms)
    if f is None:
        ks = ", ".join(f"k{i}" for i in range(len(terms)))
        body = "".join(f"        t += k{i} * {_ROW_SRC[t]}\n" for i, t in enumerate(terms))
        src = (f"def _eval(rows, coef):\n    {ks}{',' if len(terms) == 1 else ''} = coef\n    out = []\n"
               f"    for w, c, b, p, cp, h in rows:\n        t = 0.0\n{body}"
               f"        out.append(w * b / max(t, 1e-12))\n    return out\n")
        ns: dict = {"log2": math.log2, "max": max}
        exec(compile(src, f"<row evaluator {terms}>", "exec"), ns)  # noqa: S102  # source built from _ROW_SRC only
        f = _ROW_EVALUATORS[terms] = ns["_eval"]
    return f


def row_values(a: Allocation) -> tuple[float, float, float, float, float, float]:
    """(w, c, b, p, cp, host) of one allocation, as `_cols` reads them."""
    return (float(a.workers), float(a.cpu_per_worker), float(a.batch_size), float(max(a.servers, 0)),
            float(a.cpu_per_server) if a.servers else 1.0, float(a.host_cores) if a.host_cores else math.inf)


def design_matrix(allocs: Sequence[Allocation], terms: Sequence[str]) -> np.ndarray:
    unknown = [t for t in terms if t not in TERMS]
    if unknown:
        raise ModelFitError(f"unknown model terms {unknown}; known: {sorted(TERMS)}")
    return _design(_cols(allocs), terms, len(allocs))


def _design(v: dict[str, np.ndarray], terms: Sequence[str], n: int) -> np.ndarray:
    # the columns filled into one C-ordered array: what np.column_stack builds, at a third of its overhead
    if not terms:
        return np.zeros((n, 0))
    out = np.empty((n, len(terms)))
    for i, t in enumerate(terms):
        out[:, i] = 1.0 if t == "const" else TERMS[t][0](v)  # (np.ones_like's column, without the call)
    return out


def step_time(allocs: Sequence[Allocation], samples_per_s: Sequence[float]) -> np.ndarray:
    thr = np.asarray(samples_per_s, dtype=float)
    w = np.array([a.workers for a in allocs], dtype=float)
    b = np.array([a.batch_size for a in allocs], dtype=float)
    return w * b / thr


def mape(pred: Iterable[float], actual: Iterable[float]) -> float:
    p = np.asarray(pred, float) if isinstance(pred, np.ndarray) else np.asarray(list(pred), float)
    a = np.asarray(actual, float) if isinstance(actual, np.ndarray) else np.asarray(list(actual), float)
    return float(np.mean(np.abs(p - a) / np.abs(a))) if len(a) else float("nan")


@dataclass
class ThroughputModel:
    terms: tuple[str, ...]
    coef: tuple[float, ...]
    fit_mape: float = float("nan")  # on the points it was fitted on
    n_points: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.terms = tuple(self.terms)
        self.coef = tuple(float(c) for c in self.coef)
        if len(self.terms) != len(self.coef):
            raise ModelFitError(f"{len(self.terms)} terms but {len(self.coef)} coefficients")
        unknown = [t for t in self.terms if t not in TERMS]
        if unknown:
            raise ModelFitError(f"unknown model terms {unknown}; known: {sorted(TERMS)}")
        if any(c < 0 or not math.isfinite(c) for c in self.coef):
            raise ModelFitError(f"coefficients must be finite and >= 0, got {self.coef}")

    def step_time(self, allocs: Sequence[Allocation]) -> np.ndarray:
        t = design_matrix(allocs, self.terms) @ np.asarray(self.coef)
        return np.maximum(t, 1e-12)

    @overload
    def predict(self, allocs: Allocation) -> float: ...

    @overload
    def predict(self, allocs: Sequence[Allocation]) -> np.ndarray: ...

    def predict(self, allocs: Sequence[Allocation] | Allocation) -> np.ndarray | float:
        """samples/s for each allocation (a float for a single one). Up to `ROW_PATH_MAX` allocations are evaluated
        row by row in Python (`predict_rows`), more as one matrix product: the two agree to rounding (rtol 1e-12
        in tests/unit/test_throughput_predict_paths.py), not bit for bit."""
        if isinstance(allocs, Allocation):
            return self.predict_rows([row_values(allocs)])[0]
        lst = list(allocs)
        if len(lst) <= ROW_PATH_MAX:
            return np.array(self.predict_rows([row_values(a) for a in lst]), dtype=float)
        return self.predict_matrix(lst)

    def predict_rows(self, rows: Sequence[tuple[float, float, float, float, float, float]]) -> list[float]:
        """samples/s for (w, c, b, p, cp, host) rows (`row_values`), one Python sum per row (compiled per term set:
        `_row_evaluator`; `predict_rows_reference` is the same sum through ROW_TERMS)."""
        if not self.terms:
            return self.predict_rows_reference(rows)
        return _row_evaluator(self.terms)(rows, self.coef)

    def predict_rows_reference(self, rows: Sequence[tuple[float, float, float, float, float, float]]) -> list[float]:
        """`predict_rows` through the ROW_TERMS functions, one call per term and row (the fast path's reference)."""
        fs = [(ROW_TERMS[t], k) for t, k in zip(self.terms, self.coef, strict=True)]
        out = []
        for r in rows:
            t = 0.0
            for f, k in fs:
                t += k * f(*r)
            out.append(r[0] * r[2] / max(t, 1e-12))
        return out

    def predict_matrix(self, allocs: Sequence[Allocation]) -> np.ndarray:
        """samples/s for each allocation as one design-matrix product (the reference the row path is tested on)."""
        lst = list(allocs)
        v = _cols(lst)  # (one pass over the allocations: the same values step_time and the columns below read)
        t = np.maximum(_design(v, self.terms, len(lst)) @ np.asarray(self.coef), 1e-12)
        return v["w"] * v["b"] / t

    def to_dict(self) -> dict:
        return {"terms": list(self.terms), "coef": list(self.coef), "fit_mape": self.fit_mape,
                "n_points": self.n_points, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: Mapping) -> ThroughputModel:
        try:
            return cls(terms=tuple(d["terms"]), coef=tuple(d["coef"]), fit_mape=float(d.get("fit_mape", float("nan"))),
                       n_points=int(d.get("n_points", 0)), meta=dict(d.get("meta") or {}))
        except (KeyError, TypeError) as e:
            raise ModelFitError(f"not a throughput model: missing or bad field ({e!r})") from e

    def describe(self) -> str:
        return " + ".join(f"{c:.3g}*{t}" for t, c in zip(self.terms, self.coef, strict=True))


def _check(samples: Sequence[Sample]) -> None:
    bad = [s for s in samples if not (s.samples_per_s > 0 and math.isfinite(s.samples_per_s))]
    if bad:
        raise ModelFitError("throughput must be finite and > 0; bad points: "
                            f"{[(s.allocation, s.samples_per_s) for s in bad[:3]]}")


def fit(samples: Sequence[Sample], terms: Sequence[str], *, prior: ThroughputModel | None = None,
        prior_strength: float = 0.0, irls_iters: int = 5,
        rows: Sequence[tuple[float, float, float, float, float, float]] | None = None) -> ThroughputModel:
    """NNLS fit of the step-time model.

    Each row is divided by its measured step time t, so the residual is the relative step-time error
    r = (pred - t) / t. Throughput's relative error is t / pred - 1 = -r * t / pred, so `irls_iters`
    reweighting rounds (weights (t / pred)^2, clipped to [0.01, 100]) make the solution minimise the
    relative throughput error that MAPE reports; every round is a scipy.optimize.nnls solve.
    With `prior` and `prior_strength` > 0 each coefficient is also pulled towards the prior's (rows
    `strength * (c_k - prior_k) / scale_k`), so a handful of points refines a warm-start model instead
    of replacing it. Raises ModelFitError with fewer points than terms when there is no prior. `rows`: the
    samples' `row_values` when the caller keeps them (the columns are built once per fit, from them if given).
    """
    samples = list(samples)
    terms = tuple(terms)
    _fit_checks(samples, terms, prior, prior_strength)
    allocs = [s.allocation for s in samples]
    if rows is not None and len(rows) != len(samples):
        raise ValueError(f"fit: {len(rows)} rows for {len(samples)} samples")
    # the columns once: the design matrix, the step times, the prior's scales and the fit's MAPE all read them
    v = (_cols_of_rows(rows) if rows is not None else _cols(allocs)) if samples else None
    thr = np.array([s.samples_per_s for s in samples], float)
    base_w = np.array([s.weight for s in samples], float) if samples else np.zeros(0)
    return _fit_columns(v, thr, base_w, terms, prior, prior_strength, irls_iters, allocs)


def _fit_checks(samples: Sequence[Sample], terms: tuple[str, ...], prior: ThroughputModel | None,
                prior_strength: float, thr_ok: bool = False) -> None:
    """`fit`'s refusals, in its order (`thr_ok`: the caller checked every throughput is finite and > 0)."""
    if not terms:
        raise ModelFitError("fit: no terms")
    if not thr_ok:
        _check(samples)
    if len(samples) < len(terms) and (prior is None or prior_strength <= 0):
        raise ModelFitError(f"fit: {len(samples)} points cannot determine {len(terms)} coefficients {list(terms)}")
    unknown = [k for k in terms if k not in TERMS]
    if unknown:
        raise ModelFitError(f"unknown model terms {unknown}; known: {sorted(TERMS)}")


def _fit_columns(v: dict[str, np.ndarray] | None, thr: np.ndarray, base_w: np.ndarray, terms: tuple[str, ...],
                 prior: ThroughputModel | None, prior_strength: float, irls_iters: int,
                 allocs: Sequence[Allocation]) -> ThroughputModel:
    """`fit` on checked inputs: the samples' columns (`_cols`; None without samples), throughputs and weights.
    (Means as np.add.reduce / n: np.mean's sum and division, without its per-call overhead.)"""
    n = len(thr)
    t = v["w"] * v["b"] / thr if v is not None else np.zeros(0)  # (step_time's arithmetic)
    D = _design(v, terms, n) if v is not None else np.zeros((0, len(terms)))
    X0 = D / t[:, None]
    P, q = np.zeros((0, len(terms))), np.zeros(0)
    if prior is not None and prior_strength > 0:
        pc = dict(zip(prior.terms, prior.coef, strict=True))
        pvec = np.array([pc.get(k, 0.0) for k in terms])
        ref = allocs or [Allocation(1, 1.0, 512)]
        cols = (np.add.reduce(np.abs(D), axis=0) / n if n
                else np.abs(design_matrix(ref, terms)).mean(axis=0))
        tref = float(np.add.reduce(t) / n) if n else float(ThroughputModel(terms, tuple(pvec)).step_time(ref).mean())
        # a coefficient's scale: its prior value, or what would make its term 10% of a step
        scale = np.where(pvec > 0, pvec, 0.1 * tref / np.maximum(cols, 1e-12))
        P, q = prior_strength * np.diag(1.0 / scale), prior_strength * pvec / scale
    extra = np.ones(n)
    A = np.empty((n + len(P), len(terms)))  # [X0 * w; P] and [w; q], filled in place each round
    A[n:] = P
    rhs = np.empty(n + len(q))
    rhs[n:] = q
    what = f"fit of {list(terms)}"
    for it in range(max(irls_iters, 0) + 1):
        w = np.sqrt(base_w * extra)
        np.multiply(X0, w[:, None], out=A[:n])
        rhs[:n] = w
        coef = solve_nnls(A, rhs, what, maxiter=50 * max(len(terms), 1))
        if it == irls_iters or not n:
            break
        pred = np.maximum(X0 @ coef, 1e-12)  # predicted step time / measured step time
        extra = np.minimum(np.maximum(1.0 / pred, 0.1), 10.0) ** 2  # (np.clip's values)
    model = ThroughputModel(terms, tuple(coef), n_points=n)
    if v is not None:  # (predict_matrix's arithmetic on the columns above)
        model.fit_mape = _mape_arrays(v["w"] * v["b"] / np.maximum(D @ np.asarray(model.coef), 1e-12), thr)
    return model


def _mape_arrays(p: np.ndarray, a: np.ndarray) -> float:
    """`mape` of two float64 arrays of the same length: np.mean's sum (np.add.reduce) / n, without its overhead."""
    n = len(a)
    return float(np.add.reduce(np.abs(p - a) / np.abs(a)) / n) if n else float("nan")


def _median(x: np.ndarray) -> float:
    """float(np.median(x)) of a 1-D array: the middle value, or the two middle values' sum / 2 (as np.median's mean
    of them), by a sort in python; np.median's own path (NaN) otherwise. Its overhead dominated a refit."""
    v = sorted(x.tolist())
    n = len(v)
    if not n or any(u != u for u in v):
        return float(np.median(x))
    return float(v[n // 2]) if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _config_key(a: Allocation) -> tuple:
    return (a.workers, a.cpu_per_worker, a.batch_size, a.servers, a.cpu_per_server)


def cross_validate(samples: Sequence[Sample], terms: Sequence[str]) -> float:
    """Leave-one-configuration-out MAPE of throughput (every repetition of a held-out config is held out)."""
    samples = list(samples)
    keys = sorted({_config_key(s.allocation) for s in samples})
    errs = []
    for k in keys:
        train = [s for s in samples if _config_key(s.allocation) != k]
        test = [s for s in samples if _config_key(s.allocation) == k]
        if len(train) < len(terms):
            raise ModelFitError(f"cross_validate: {len(train)} training points for {len(terms)} terms")
        m = fit(train, terms)
        errs.extend(np.abs(m.predict([s.allocation for s in test]) - np.array([s.samples_per_s for s in test]))
                    / np.array([s.samples_per_s for s in test]))
    return float(np.mean(errs))


@dataclass
class TermSelection:
    terms: tuple[str, ...]
    cv_mape: float
    ranking: list[tuple[tuple[str, ...], float]]  # every subset tried, best first


def select_terms(samples: Sequence[Sample], candidates: Sequence[str] = LOCAL_CANDIDATES, *, max_terms: int = 4,
                 tolerance: float = 0.005) -> TermSelection:
    """Every subset of up to `max_terms` candidates (always with `const`), scored by leave-one-config-out
    MAPE; the smallest subset within `tolerance` (absolute MAPE) of the best wins."""
    samples = list(samples)
    _check(samples)
    n_configs = len({_config_key(s.allocation) for s in samples})
    if n_configs < 3:
        raise ModelFitError(f"select_terms: {n_configs} distinct configurations; need at least 3 to hold one out")
    rest = [c for c in candidates if c != "const"]
    ranking = []
    for k in range(0, max_terms):
        for combo in itertools.combinations(rest, k):
            terms = ("const", *combo)
            if len(terms) > n_configs - 1:
                continue
            ranking.append((terms, cross_validate(samples, terms)))
    ranking.sort(key=lambda r: (r[1], len(r[0])))
    best = ranking[0][1]
    chosen = min((r for r in ranking if r[1] <= best + tolerance), key=lambda r: (len(r[0]), r[1]))
    return TermSelection(terms=chosen[0], cv_mape=chosen[1], ranking=ranking)


class OnlineThroughputModel:
    """Samples arrive one at a time; `refit()` every `refit_every` new ones, from the prior until
    `min_points` distinct configurations were seen (a single configuration cannot separate terms)."""

    def __init__(self, terms: Sequence[str], prior: ThroughputModel | None = None, *, min_points: int = 3,
                 prior_strength: float = 0.3, refit_every: int = 1, max_samples: int = 200) -> None:
        self.terms = tuple(terms)
        self.prior = prior
        self.min_points = min_points
        self.prior_strength = prior_strength
        self.refit_every = max(1, refit_every)
        self.max_samples = max_samples
        self.samples: list[Sample] = []
        self._configs: dict[tuple, int] = {}  # configuration -> samples of it, kept in step by `add`
        self._counted: list[Sample] | None = None  # the list (and its length) `_configs` counts
        self._counted_n = 0
        self._rows: list[tuple] = []  # each sample's `row_values`, kept with `samples` (rebuilt if changed outside)
        self._thr: list[float] = []  # each sample's samples_per_s, kept with `_rows`
        self._pp: list[float | None] = []  # the prior's prediction of each sample (None: not yet), kept with `samples`
        self._pp_for: list[Sample] | None = None
        # `_rows` with each sample's samples/s and weight as rows [lo:hi) of one float array (`_columns`): appended
        # to in place, so a refit does not convert 200 tuples to an array; mirrors the `_rows` list `_mat_for`
        self._mat = np.empty((0, 8))
        self._lo = self._hi = 0
        self._mat_for: list[tuple] | None = None
        self._row_of: tuple = (None, None, None)  # (allocation, its `row_values`, its `_config_key`): `add`'s last
        self.model: ThroughputModel | None = prior
        self.status = "prior" if prior is not None else "no model"
        self._since = 0

    @property
    def distinct_configs(self) -> int:
        if self._counted is not self.samples or self._counted_n != len(self.samples):  # changed from outside
            self._configs = {}
            for s in self.samples:
                k = _config_key(s.allocation)
                self._configs[k] = self._configs.get(k, 0) + 1
            self._counted, self._counted_n = self.samples, len(self.samples)
        return len(self._configs)

    def add(self, sample: Sample, refit: bool = True) -> bool:
        """Record a sample; True when the model was refitted (`refit=False`: the caller refits when it decides)."""
        if not (sample.samples_per_s > 0 and math.isfinite(sample.samples_per_s)):
            return False  # a stalled interval (restart, pending) says nothing about throughput
        samples = self.samples
        n = len(samples)
        in_step = self._counted is samples and self._counted_n == n
        pp_in_step = self._pp_for is samples and len(self._pp) == n
        mat_in_step = pp_in_step and self._mat_for is self._rows and self._hi - self._lo == len(self._rows)
        samples.append(sample)
        a = sample.allocation
        ro = self._row_of
        if ro[0] is not a:  # (a policy reports many samples of one frozen Allocation: its row and key read once)
            ro = self._row_of = (a, row_values(a), _config_key(a))
        if pp_in_step:
            self._pp.append(None)
            row = ro[1]
            self._rows.append(row)
            self._thr.append(sample.samples_per_s)
            if mat_in_step:
                self._push_row((*row, sample.samples_per_s, sample.weight))
        if in_step:
            k = ro[2]
            self._configs[k] = self._configs.get(k, 0) + 1
        if len(self.samples) > self.max_samples:
            dropped = self.samples[:-self.max_samples]
            self.samples = self.samples[-self.max_samples:]
            if pp_in_step:
                self._pp = self._pp[-self.max_samples:]
                self._rows = self._rows[-self.max_samples:]
                self._thr = self._thr[-self.max_samples:]
                if mat_in_step:
                    self._lo = self._hi - len(self._rows)
                    self._mat_for = self._rows
            for d in dropped if in_step else ():
                k = _config_key(d.allocation)
                self._configs[k] -= 1
                if not self._configs[k]:
                    del self._configs[k]
        if in_step:
            self._counted, self._counted_n = self.samples, len(self.samples)
        if pp_in_step:
            self._pp_for = self.samples
        self._since += 1
        if refit and self._since >= self.refit_every:
            self._since = 0
            return self.refit()
        return False

    def _push_row(self, row: tuple) -> None:
        if self._hi == len(self._mat):  # full: move the window to the front, or grow
            n = self._hi - self._lo
            if 2 * n > len(self._mat):
                mat = np.empty((max(16, 2 * len(self._mat)), 8))
                mat[:n] = self._mat[self._lo:self._hi]
                self._mat = mat
            else:
                self._mat[:n] = self._mat[self._lo:self._hi].copy()
            self._lo, self._hi = 0, n
        self._mat[self._hi] = row
        self._hi += 1

    def _columns(self) -> np.ndarray:
        """(samples, 8): each sample's `row_values`, samples/s and weight (rebuilt when `samples` changed outside)."""
        rows = self._sample_rows()
        n = len(rows)
        if self._mat_for is not rows or self._hi - self._lo != n:
            self._mat = np.empty((max(16, 2 * n, 2 * self.max_samples), 8))
            if n:
                self._mat[:n, :6] = np.array(rows, dtype=float).reshape(-1, 6)
                self._mat[:n, 6] = self._thr
                self._mat[:n, 7] = [s.weight for s in self.samples]
            self._lo, self._hi, self._mat_for = 0, n, rows
        return self._mat[self._lo:self._hi]

    def _prior_predictions(self) -> list[float]:
        """The prior's samples/s at each sample's allocation: computed once per sample (the prior does not change),
        all again when `samples` was changed from outside."""
        assert self.prior is not None
        rows = self._sample_rows()
        pp = self._pp
        i = len(pp)  # the ones not yet predicted are a suffix: `add` appends None, truncation cuts the front
        while i and pp[i - 1] is None:
            i -= 1
        if i < len(pp):
            pp[i:] = self.prior.predict_rows(rows[i:])
        return pp  # type: ignore[return-value]  # (no None left)

    def _sample_rows(self) -> list[tuple]:
        """Each sample's `row_values`, rebuilt (and the prior's predictions forgotten) when `samples` was changed
        from outside since `add` last kept them in step."""
        if self._pp_for is not self.samples or len(self._pp) != len(self.samples):
            self._pp, self._pp_for = [None] * len(self.samples), self.samples
            self._rows = [row_values(s.allocation) for s in self.samples]
            self._thr = [s.samples_per_s for s in self.samples]
        return self._rows

    def refit(self) -> bool:
        self._since = 0
        if self.distinct_configs < self.min_points:
            if self.prior is None:
                self.status = (f"too few configurations ({self.distinct_configs} < {self.min_points}) "
                               "and no prior: no model")
                return False
            # calibrate the prior's level to what we see, keep its shape
            pred = np.array(self._prior_predictions())  # (the prior's prediction of each sample, cached)
            obs = np.array(self._thr)  # (each sample's samples/s, kept with the rows above)
            k = _median(pred / obs)
            self.model = ThroughputModel(self.prior.terms, tuple(c * k for c in self.prior.coef),
                                         fit_mape=_mape_arrays(pred / k, obs), n_points=len(obs),
                                         meta={"source": "prior scaled"})
            self.status = f"prior scaled by {1 / k:.3f} ({self.distinct_configs} configuration(s) seen)"
            return True
        strength = self.prior_strength if self.prior is not None else 0.0
        m = self._columns() if self.samples else None
        if m is None:
            self.model = fit(self.samples, self.terms, prior=self.prior, prior_strength=strength)
        else:  # `fit` on the kept columns (the same arrays' values, in the same arithmetic)
            thr = m[:, 6]
            _fit_checks(self.samples, self.terms, self.prior, strength,
                        thr_ok=bool((thr > 0).all() and np.isfinite(thr).all()))
            v = {"w": m[:, 0], "c": m[:, 1], "b": m[:, 2], "p": m[:, 3], "cp": m[:, 4], "host": m[:, 5]}
            self.model = _fit_columns(v, thr, m[:, 7], self.terms, self.prior, strength, 5, ())
        self.status = f"fitted on {len(self.samples)} samples / {self.distinct_configs} configurations"
        return True

    def _scalable(self) -> bool:
        """True when `refit` would scale the prior to samples (what `refit_many` does together)."""
        return bool(self.samples) and self.prior is not None and self.distinct_configs < self.min_points

    def _batchable(self) -> bool:
        """True when `refit` would take `_fit_columns`' path with a prior (what `refit_many` batches)."""
        return (bool(self.samples) and self.prior is not None and self.prior_strength > 0 and bool(self.terms)
                and all(k in TERMS for k in self.terms) and self.distinct_configs >= self.min_points)


def _refit_one(m: OnlineThroughputModel) -> bool | ValueError:
    try:
        return m.refit()
    except ValueError as e:  # ModelFitError (and scipy's refusals, as ModelFitError)
        return e


def refit_many(models: Sequence[OnlineThroughputModel]) -> list[bool | ValueError]:
    """`[m.refit() for m in models]`, each model left as its own `refit` leaves it (model, coefficients, fit MAPE,
    status) bit for bit; a refit's ValueError (ModelFitError) is returned in its place instead of raised.

    The models whose refit is the IRLS fit with a prior on their own samples (`_fit_columns`' path) run it together,
    grouped by terms: their sample windows stacked into one array, each job followed by its prior's rows, so every
    elementwise step of a round (the weights, the weighted rows, the reweighting) is one numpy call for all of them;
    per job only what is not elementwise stays one call each (NNLS, the matrix-vector products, the sums), on
    contiguous views with the shapes and strides `_fit_columns` gives them. Optimus refits ~1,850 models a round at
    100,000 jobs, and a refit's ~100 small numpy calls were most of its cost. The rest (prior scaling, no prior)
    refit one by one. `tests/unit/test_simulate_speedups9.py` checks it against `refit` on random problems."""
    out: list[bool | ValueError] = [False] * len(models)
    groups: dict[tuple[str, ...], list[tuple[int, OnlineThroughputModel]]] = {}
    scaled: list[tuple[int, OnlineThroughputModel]] = []
    for i, m in enumerate(models):
        if m._batchable():
            groups.setdefault(m.terms, []).append((i, m))
        elif m._scalable():
            scaled.append((i, m))
        else:
            out[i] = _refit_one(m)
    if scaled:
        _rescale_batch(scaled, out)
    for terms, items in groups.items():
        _refit_batch(terms, items, out)
    return out


def _rescale_batch(items: list[tuple[int, OnlineThroughputModel]], out: list[bool | ValueError]) -> None:
    """`refit_many`'s models whose refit scales the prior (`_scalable`): `refit`'s arithmetic with each job's ratios
    and errors computed for all of them at once (one array of every job's prior predictions, one of its samples/s;
    each job's median of its own slice, as `_median`, and its MAPE's sum over its own contiguous slice, as
    `_mape_arrays`). A NaN ratio (`_median` takes np.median's path), or a scale that is not a normal positive float
    (`refit` may raise): all of them one by one, as `refit` does."""
    preds: list[float] = []
    obs: list[float] = []
    spans: list[tuple[int, int]] = []
    for _, m in items:
        m._since = 0
        p = m._prior_predictions()  # (first: it brings `_thr` in step with the samples)
        spans.append((len(preds), len(p)))
        preds += p
        obs += m._thr
    pa, oa = np.array(preds), np.array(obs)
    ra = pa / oa
    ks: list[float] = []
    if not np.isnan(ra).any():  # (a NaN ratio: `_median` takes np.median's path; samples set from outside)
        ratio = ra.tolist()
        for s, n in spans:
            v = sorted(ratio[s:s + n])
            k = float(v[n // 2]) if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
            if not 1e-300 < k < 1e300:
                break
            ks.append(k)
    if len(ks) < len(items):
        for i, m in items:  # (nothing changed yet: each as its own `refit`, in their order)
            out[i] = _refit_one(m)
        return
    ks_rows = np.repeat(np.array(ks), [n for _, n in spans])
    err = np.abs(pa / ks_rows - oa) / np.abs(oa)  # (`_mape_arrays(pred / k, obs)`'s elementwise part)
    for (i, m), (s, n), k in zip(items, spans, ks, strict=True):
        prior = m.prior
        assert prior is not None
        try:
            model = ThroughputModel(prior.terms, tuple(c * k for c in prior.coef),
                                    fit_mape=float(np.add.reduce(err[s:s + n]) / n), n_points=n,
                                    meta={"source": "prior scaled"})
        except ValueError as e:
            out[i] = e
            continue
        m.model = model
        m.status = f"prior scaled by {1 / k:.3f} ({m.distinct_configs} configuration(s) seen)"
        out[i] = True


def _refit_batch(terms: tuple[str, ...], items: list[tuple[int, OnlineThroughputModel]],
                 out: list[bool | ValueError]) -> None:
    """`refit_many`'s batch of models with these `terms` (each `_batchable`): `refit`'s `_fit_columns` path.

    Layout: the jobs by sample count (n), each one's n sample rows then its k prior rows, so that a job's [X0 * w; P]
    is a C-ordered (n + k, k) block (NNLS reads it in place) and the sample rows of the jobs of one n are a (jobs, n,
    k) view: one stacked matmul per sample count for the matrix-vector products (numpy runs the same BLAS gemv per
    job as on `_fit_columns`' (n, k) array; tested equal)."""
    k = len(terms)
    mats = []
    for _, m in items:
        m._since = 0
        mats.append(m._columns())
    order = sorted(range(len(items)), key=lambda j: len(mats[j]))
    items, mats = [items[j] for j in order], [mats[j] for j in order]
    dummy = np.array([[1.0, 1.0, 1.0, 0.0, 1.0, math.inf, 1.0, 1.0]] * k)  # a prior row's place (overwritten)
    blocks: list[np.ndarray] = []
    starts: list[int] = []
    groups: list[tuple[int, int, int, int]] = []  # (first job, end job, n, first row) per sample count
    s = 0
    for j, mat in enumerate(mats):
        n = len(mat)
        if not groups or groups[-1][2] != n:
            groups.append((j, j + 1, n, s))
        else:
            g = groups[-1]
            groups[-1] = (g[0], j + 1, n, g[3])
        blocks.append(mat)
        blocks.append(dummy)
        starts.append(s)
        s += n + k
    M = np.concatenate(blocks)  # (rows, 8): columns with `_columns`' strides
    thr = M[:, 6]
    if not bool((thr > 0).all() and np.isfinite(thr).all()):  # (not after `add`): `refit` decides those one by one
        ok = []
        for (i, m), mat in zip(items, mats, strict=True):
            t6 = mat[:, 6]
            if bool((t6 > 0).all() and np.isfinite(t6).all()):
                ok.append((i, m))
            else:
                out[i] = _refit_one(m)
        if ok:
            _refit_batch(terms, ok, out)
        return
    v = {"w": M[:, 0], "c": M[:, 1], "b": M[:, 2], "p": M[:, 3], "cp": M[:, 4], "host": M[:, 5]}
    rows = len(M)
    t = v["w"] * v["b"] / thr  # (`_fit_columns`' arithmetic, elementwise, on every row at once)
    D = _design(v, terms, rows)
    X0 = D / t[:, None]
    absD = np.abs(D)
    prow: list[int] = []  # the prior rows
    pvals: list[list[float]] = []
    qvals: list[float] = []
    live: list[int] = []  # batch positions still fitting
    for j, ((i, m), mat) in enumerate(zip(items, mats, strict=True)):
        n, s = len(mat), starts[j]
        cols = (np.add.reduce(absD[s:s + n], axis=0) / n).tolist()
        tref = float(np.add.reduce(t[s:s + n]) / n)
        prior = m.prior
        assert prior is not None
        strength = m.prior_strength
        pc = dict(zip(prior.terms, prior.coef, strict=True))
        pvec = [float(pc.get(x, 0.0)) for x in terms]
        if not (math.isfinite(tref) and all(math.isfinite(c) for c in cols)):
            out[i] = _refit_one(m)  # (`_fit_columns` on its own decides what non-finite scales give)
            continue
        # `_fit_columns`' scale, P and q in python floats: the same IEEE operations in the same order
        scale = [p if p > 0 else 0.1 * tref / max(c, 1e-12) for p, c in zip(pvec, cols, strict=True)]
        if not all(sc != 0 for sc in scale):  # (numpy's 1 / 0 is inf, python's an error)
            out[i] = _refit_one(m)
            continue
        for r in range(k):
            row = [0.0] * k
            row[r] = strength * (1.0 / scale[r])
            pvals.append(row)
            qvals.append(strength * pvec[r] / scale[r])
            prow.append(s + n + r)
        live.append(j)
    if not live:
        return
    pidx = np.array(prow, dtype=np.intp)
    X0[pidx] = np.array(pvals, dtype=float).reshape(-1, k)  # [X0; P] per job, one C-ordered block each
    rq = np.ones(rows)
    rq[pidx] = qvals  # the right-hand side's factor: w for a sample row (w * 1.0), q for a prior row (1.0 * q)
    base_w = M[:, 7].copy()
    base_w[pidx] = 1.0
    extra = np.ones(rows)
    pred = np.ones(rows)
    C = np.zeros((len(items), k, 1))  # each job's coefficients, for the stacked products
    coefs: dict[int, np.ndarray] = {}
    maxiter = 50 * max(k, 1)
    core = _NNLS_CORE
    irls_iters = 5  # (`refit`'s)
    what = f"fit of {list(terms)}"
    span = [(starts[j], starts[j] + len(mats[j]) + k) for j in range(len(items))]
    for it in range(irls_iters + 1):
        w = np.sqrt(base_w * extra)  # the prior rows' weight: sqrt(1.0 * 1.0) = 1.0, so they stay P and q exactly
        A = X0 * w[:, None]
        rhs = w * rq
        fin_job = None
        if not (np.isfinite(A).all() and np.isfinite(rhs).all()):
            fin = np.isfinite(A).all(axis=1) & np.isfinite(rhs)
            fin_job = np.logical_and.reduceat(fin, np.array([starts[j] for j in live], dtype=np.intp)).tolist()
        still: list[int] = []
        xs: list[np.ndarray] = []
        for pos, j in enumerate(live):
            s, e = span[j]
            try:
                if core is not None and (fin_job is None or fin_job[pos]):
                    x, _, info = core(A[s:e], rhs[s:e], maxiter)
                    if info == 3:
                        raise ModelFitError(f"{what}: NNLS did not converge (Maximum number of iterations reached.)")
                else:  # (a non-finite row, or no compiled core: `solve_nnls` says what `_fit_columns` would)
                    x = solve_nnls(A[s:e].copy(), rhs[s:e].copy(), what, maxiter=maxiter)
            except ModelFitError as err:
                out[items[j][0]] = err
                continue
            coefs[j] = x
            xs.append(x)
            still.append(j)
        live = still
        if it == irls_iters or not live:
            break
        C[live, :, 0] = np.array(xs).reshape(-1, k)
        _stacked_products(X0, C, pred, groups, k)  # pred = each job's X0 @ coef (its prior rows: stale)
        np.maximum(pred, 1e-12, out=pred)
        extra = np.minimum(np.maximum(1.0 / pred, 0.1), 10.0) ** 2  # (np.clip's values)
        extra[pidx] = 1.0
    if not live:
        return
    models: dict[int, ThroughputModel] = {}
    for j in live:
        try:
            models[j] = ThroughputModel(terms, tuple(coefs[j]), n_points=len(mats[j]))
        except ModelFitError as err:
            out[items[j][0]] = err
            continue
        C[j, :, 0] = models[j].coef
    dc = np.ones(rows)
    _stacked_products(D, C, dc, groups, k)
    # the fit's MAPE: `_mape_arrays(w * b / max(D @ coef, 1e-12), thr)`, its elementwise part for all rows at once
    err_rows = np.abs(v["w"] * v["b"] / np.maximum(dc, 1e-12) - thr) / np.abs(thr)
    for j, model in models.items():
        i, m = items[j]
        n, s = len(mats[j]), starts[j]
        model.fit_mape = float(np.add.reduce(err_rows[s:s + n]) / n)
        m.model = model
        m.status = f"fitted on {len(m.samples)} samples / {m.distinct_configs} configurations"
        out[i] = True


def _stacked_products(X: np.ndarray, C: np.ndarray, out: np.ndarray, groups: list[tuple[int, int, int, int]],
                      k: int) -> None:
    """out[sample rows of job j] = X[sample rows of job j] @ C[j] for `_refit_batch`'s layout: per sample count one
    stacked matmul of the (jobs, n, k) view of the sample rows (each job's (n, k) block: the gemv `_fit_columns`' own
    (n, k) array gets; its rows only, since BLAS groups rows by four: with the prior rows the grouping would differ)."""
    for j0, j1, n, r0 in groups:
        r1 = r0 + (j1 - j0) * (n + k)
        np.matmul(X[r0:r1].reshape(j1 - j0, n + k, k)[:, :n], C[j0:j1],
                  out=out[r0:r1].reshape(j1 - j0, n + k, 1)[:, :n])


# ---------------------------------------------------------------------------------------------
# profiles measured on our own trainer (bench/profile_trainer.py -> elastic/optimizer/models/profiles/*.json)
# ---------------------------------------------------------------------------------------------
PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = PROFILE_DIR / "dlrm_criteo_2core.json"


def load_profile(path=DEFAULT_PROFILE) -> tuple[list[Sample], dict]:
    """Median throughput over repetitions per configuration (failed points dropped), and the conditions."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"profile not found: {path}")
    try:
        doc = json.loads(path.read_text())
        points = doc["points"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelFitError(f"{path}: not a profile ({e!r})") from e
    host = (doc.get("conditions", {}).get("machine", {}) or {}).get("logical_cpus")
    by: dict[tuple, list[float]] = {}
    for p in points:
        if "samples_per_s" not in p or not p["samples_per_s"]:
            continue
        by.setdefault((p["workers"], p["threads_per_worker"], p["batch_size"]), []).append(float(p["samples_per_s"]))
    samples = [Sample(Allocation(w, float(t), b, host_cores=float(host) if host else None), statistics.median(v),
                      weight=float(len(v)))
               for (w, t, b), v in sorted(by.items())]
    return samples, doc.get("conditions", {})


@dataclass
class ProfileFit:
    model: ThroughputModel
    selection: TermSelection
    train: list[Sample]
    held_out: list[Sample]
    held_out_mape: float

    def summary(self) -> dict:
        return {"terms": list(self.model.terms), "coef": list(self.model.coef), "fit_mape": self.model.fit_mape,
                "cv_mape": self.selection.cv_mape, "held_out_mape": self.held_out_mape,
                "held_out": [[s.allocation.workers, s.allocation.cpu_per_worker, s.allocation.batch_size]
                             for s in self.held_out],
                "n_train": len(self.train), "top_subsets": [[list(t), m] for t, m in self.selection.ranking[:5]]}


def fit_profile(samples: Sequence[Sample], *, hold_out_every: int = 3, candidates: Sequence[str] = LOCAL_CANDIDATES,
                max_terms: int = 4) -> ProfileFit:
    """Hold out every `hold_out_every`-th configuration (sorted order), choose terms by leave-one-config-out
    error on the rest, fit them there, and report MAPE on the held-out configurations."""
    samples = sorted(samples, key=lambda s: _config_key(s.allocation))
    if hold_out_every < 2:
        raise ValueError(f"hold_out_every must be >= 2, got {hold_out_every}")
    held = samples[1::hold_out_every]
    train = [s for i, s in enumerate(samples) if (i - 1) % hold_out_every != 0]
    sel = select_terms(train, candidates, max_terms=max_terms)
    model = fit(train, sel.terms)
    model.meta = {"source": "profile", "cv_mape": sel.cv_mape}
    err = mape(model.predict([s.allocation for s in held]), [s.samples_per_s for s in held]) if held else float("nan")
    model.meta["held_out_mape"] = err
    return ProfileFit(model, sel, train, held, err)
