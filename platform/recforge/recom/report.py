"""Compile report: sizes, op counts, numeric agreement with eager, and eager vs compiled latency."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from recforge.recom.compile import CompiledModel, batch_size_of, check_against_eager, max_abs_diff, tile_rows
from recforge.recom.family import batch_of, select_rows
from recforge.recom.inference import select_raw_rows


@contextmanager
def fixed_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` and restore the previous count after."""
    if n < 1:
        raise ValueError(f"threads: must be >= 1, got {n}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def measure_latency(fn: Callable[..., Any], inputs: Sequence[Any], repeats: int = 30,
                    warmup: int = 5) -> dict[str, float]:
    """Call ``fn(*inputs)`` ``warmup`` times untimed, then ``repeats`` times timed; return the spread in ms."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats} warmup={warmup}")
    times = []
    with torch.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p10_ms": times[int(0.1 * (len(times) - 1))],
        "p90_ms": times[int(0.9 * (len(times) - 1))],
        "min_ms": times[0],
        "repeats": repeats,
        "warmup": warmup,
    }


def take_rows(inputs: Sequence[Any], n: int) -> tuple:
    """The first ``n`` rows of a batch of inputs (rows repeat cyclically when it has fewer); a request dict
    with jagged columns (``<name>`` + ``<name>_lengths``) keeps each row's values, and so do the raw inputs of an
    InferenceModule over list columns (four matrices + a jagged dict)."""
    inputs = tuple(inputs)
    if len(inputs) == 1 and isinstance(inputs[0], dict) and any(k.endswith("_lengths") for k in inputs[0]):
        batch = batch_of(inputs[0])
        return (select_rows(inputs[0], [i % batch for i in range(n)]),)
    if len(inputs) == 5 and isinstance(inputs[4], dict):
        batch = int(inputs[0].shape[0])
        return select_raw_rows(inputs, [i % batch for i in range(n)])
    return tile_rows(inputs, n)


def compile_report(eager: Callable[..., torch.Tensor], compiled: CompiledModel, heldout_inputs: Sequence[Any], *,
                   batch_size: int = 64, repeats: int = 30, warmup: int = 5, threads: int = 1,
                   atol: float = 1e-5, strict: bool = True) -> dict[str, Any]:
    """A JSON-able report of one compile.

    ``heldout_inputs`` is a batch of raw rows not used as the export example. Numeric agreement is
    checked on all of it (``strict`` raises CompileMismatchError above ``atol``); latency medians use
    its first ``batch_size`` rows with torch's thread count fixed to ``threads``.
    """
    heldout = tuple(heldout_inputs)
    if strict:
        diff = check_against_eager(compiled, eager, heldout, atol=atol)
    else:
        with torch.no_grad():
            diff = max_abs_diff(compiled(*heldout), eager(*heldout))
    meta = compiled.metadata
    cols = getattr(eager, "columns", None)
    batch = take_rows(heldout, batch_size)
    with fixed_threads(threads):
        eager_lat = measure_latency(eager, batch, repeats=repeats, warmup=warmup)
        compiled_lat = measure_latency(compiled, batch, repeats=repeats, warmup=warmup)
    return {
        "backend": compiled.backend,  # what runs; the requested one and why it differs, when it does:
        "requested_backend": meta.get("requested_backend", compiled.backend),
        **({"backend_fallback": meta["backend_fallback"]} if meta.get("backend_fallback") else {}),
        "num_columns": meta.get("num_columns", len(cols) if cols else None),
        "num_tables": meta.get("num_tables", len({c.table for c in cols}) if cols else None),
        "ops_eager": meta.get("ops_before"),
        "ops_compiled": meta.get("ops_after"),
        "graph_nodes": meta.get("graph_nodes"),
        "lookups_eager": meta.get("lookups_before"),
        "lookups_compiled": meta.get("num_embedding_lookups"),
        "heldout_rows": batch_size_of(heldout),
        "max_abs_diff": diff,
        "atol": atol,
        "within_tolerance": diff <= atol,
        "latency": {
            "batch_size": batch_size,
            "threads": threads,
            "eager": eager_lat,
            "compiled": compiled_lat,
        },
        "eager_median_ms": eager_lat["median_ms"],
        "compiled_median_ms": compiled_lat["median_ms"],
        "speedup": eager_lat["median_ms"] / compiled_lat["median_ms"],
    }
