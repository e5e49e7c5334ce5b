"""RECom benchmark: massive-column models, embedding layer alone and whole model, side by side in one run.

Variants (each checked against eager on every batch before it is timed):
  eager          the model as written: one submodule per column
  torch_compile  torch.compile(model, dynamic=True) (Inductor; embedding lookups fall back to ATen)
  torchrec_ebc   grouped preprocessing (torch.compile'd separately) + torchrec's unsharded EmbeddingBagCollection
  tbe            the same preprocessing + fbgemm's table-batched embedding (one fused kernel for all tables)
  recom          recforge.recom.compile: one fused embedding-layer op + the residual dense program
Whole-model baselines run the dense net as written (eager) after their lookup.

Fixed torch thread count; variants interleaved in rounds so drift hits all alike; p50 / p99 latency over all
timed calls, throughput = batch / mean latency; ratios against eager. The machine may be shared: the load
average is recorded at the start and end of every configuration.

    recforge bench recom                                          # E mix: 10, 100, 1000 columns; B 32, 256, 2048
    recforge bench recom --columns 1000 --batch-sizes 256 --variants eager,tbe,recom --parts layer

Writes bench/results/bench_recom_<UTC time>.json (temp + rename) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import recforge.recom as recom
from recforge.recom.baselines import DenseNet, EBCLayer, GroupedPreprocess, Pipeline, TBELayer
from recforge.recom.family import build_model, make_features, preset, scaled

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("eager", "torch_compile", "torchrec_ebc", "tbe", "recom")


def load_avg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def time_calls(fn, x, n: int) -> list[float]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            t0 = time.perf_counter()
            fn(x)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def first_call(fn, x) -> float:
    """Seconds of the first call (where torch.compile compiles)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(x)
    return time.perf_counter() - t0


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def percentile(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def build_variants(model, part: str, example: dict, args) -> tuple[dict, dict]:
    """{name: callable} and {name: compile info} for one model part ("layer" or "model")."""
    target = model.embedding if part == "layer" else model
    variants, info = {}, {}
    if "eager" in args.variants:
        variants["eager"] = target
    if "recom" in args.variants:
        t0, cpu0 = time.perf_counter(), time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = recom.compile(target, (example,), backend=args.recom_backend)
        meta = c.metadata
        info["recom"] = {
            "compile_s": round(time.perf_counter() - t0, 2), "export_s": meta["export_s"],
            "compile_cpu_s": round(time.process_time() - cpu0, 2),  # this process's CPU time: a shared box's
            # load stretches the wall clock, not this
            "column_compile_s": meta.get("column_compile_s"), "backend_compile_s": meta.get("backend_compile_s"),
            "backend": c.backend, "status": meta.get("recom_status"),
            "passes": (meta.get("recom") or {}).get("passes"),
            "shape_computations_removed": (meta.get("recom") or {}).get("shape_computations_removed"),
            "column_ops_replaced": (meta.get("recom") or {}).get("column_ops_replaced"),
            "signature_groups": len(((meta.get("recom") or {}).get("plan") or {}).get("signature_groups", {})),
            "ops_eager": meta.get("ops_before"), "ops_compiled": meta.get("ops_compiled"),
        }
        variants["recom"] = c
    if "torch_compile" in args.variants:
        tc = torch.compile(target, dynamic=True)
        info["torch_compile"] = {"compile_s": round(first_call(tc, example), 2)}
        variants["torch_compile"] = tc
    for name, lookup_cls in (("torchrec_ebc", EBCLayer), ("tbe", TBELayer)):
        if name not in args.variants:
            continue
        pre = torch.compile(GroupedPreprocess(model), dynamic=True)
        dense = DenseNet(model) if part == "model" else None
        pipe = Pipeline(pre, lookup_cls(model), dense)
        info[name] = {"preprocess_compile_s": round(first_call(pipe, example), 2)}
        variants[name] = pipe
    return variants, info


def bench_config(n: int, args) -> dict:
    spec = scaled(preset(args.preset, large_rows=args.large_rows, seed=args.seed), n)
    torch.manual_seed(args.seed)
    model = build_model(spec)
    batches = {b: make_features(model, b, seed=1000 + b) for b in args.batch_sizes}
    example = make_features(model, args.example_batch, seed=7)
    out = {"columns": n, "spec": {k: v for k, v in spec.__dict__.items()}, "parts": {}}
    for part in args.parts:
        load0 = load_avg()
        t0 = time.perf_counter()
        variants, info = build_variants(model, part, example, args)
        print(f"[{n} cols / {part}] built variants in {time.perf_counter() - t0:.0f} s: "
              + ", ".join(f"{k}={v.get('compile_s', v.get('preprocess_compile_s'))}s" for k, v in info.items()),
              flush=True)
        rows = []
        for b, x in batches.items():
            with torch.no_grad():
                want = model.embedding(x) if part == "layer" else model(x)
                for v in variants.values():  # first call at this batch size (torch.compile may recompile)
                    v(x)
                diffs = {name: max_diff(v(x), want) for name, v in variants.items() if name != "eager"}
            bad = {k: d for k, d in diffs.items() if not d <= args.atol}
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, v in variants.items():
                    time_calls(v, x, args.warmup)
                    samples[name] += time_calls(v, x, args.repeats)
            stats = {}
            for name, s in samples.items():
                mean = statistics.fmean(s)
                stats[name] = {"p50_ms": statistics.median(s), "p99_ms": percentile(s, 0.99), "mean_ms": mean,
                               "throughput_per_s": b / mean * 1e3}
            base = stats.get("eager", {}).get("p50_ms")
            for st in stats.values():
                st["speedup_p50_vs_eager"] = base / st["p50_ms"] if base else None
            rows.append({"batch_size": b, "stats": stats, "max_abs_diff_vs_eager": diffs, "over_atol": bad})
            print(f"[{n} cols / {part}] B={b:5d} " + "  ".join(
                f"{k}={st['p50_ms']:.3f}ms(x{st['speedup_p50_vs_eager']:.2f})" if st['speedup_p50_vs_eager']
                else f"{k}={st['p50_ms']:.3f}ms" for k, st in stats.items())
                + (f"  MISMATCH {bad}" if bad else ""), flush=True)
        out["parts"][part] = {"compile": info, "results": rows, "load_avg_start": load0, "load_avg_end": load_avg()}
        del variants
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="E")
    ap.add_argument("--columns", default="10,100,1000")
    ap.add_argument("--batch-sizes", default="32,256,2048")
    ap.add_argument("--parts", default="layer,model")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--large-rows", type=int, default=1 << 20,
                    help="rows of each large table (the paper's 2**23 x 32 is 1 GiB each; 2**20 fits a shared box)")
    ap.add_argument("--example-batch", type=int, default=16)
    ap.add_argument("--recom-backend", default="export", choices=recom.BACKENDS)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.columns = [int(c) for c in args.columns.split(",") if c]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.parts = [p for p in args.parts.split(",") if p]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS) | set(args.parts) - {"layer", "model"}
    if unknown:
        raise SystemExit(f"unknown variants / parts: {sorted(unknown)}; variants: {VARIANTS}, parts: layer, model")
    torch.set_num_threads(args.threads)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_path = args.out or RESULTS / f"bench_recom_{stamp}.json"
    report = {
        "bench": "recom", "torch": torch.__version__, "threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "configs": [],
    }
    for n in args.columns:
        report["configs"].append(bench_config(n, args))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=".bench_recom.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, out_path)  # written after every configuration: a long run keeps what it measured
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
