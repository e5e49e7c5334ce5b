"""Eager (torchrec KJT path) vs compiled (exported gather form) vs compiled + Inductor / AOTInductor.

One process, fixed torch thread count, medians over repeats interleaved in rounds, ratios against eager.
Every variant is first checked against eager (max abs diff <= atol) on each batch size.

    python bench/bench_compile.py                      # criteo_kaggle, both archs, B = 1, 64, 1024, 1 thread
    python bench/bench_compile.py --archs dlrm --backends export,aoti --batch-sizes 1,256

Writes bench/results/bench_compile.json (temp + rename) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import recforge.recom as recom
from recforge.config import ModelConfig, dataset_preset
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.planning.plan import criteo_plan
from recforge.recom.report import fixed_threads, measure_latency
from recforge.train.model import build_dlrm

RESULTS = Path(__file__).resolve().parent / "results"


def raw_batch(dataset, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Raw typed rows with nulls at the dataset's missing rates (dense ints, 32-bit sparse values)."""
    g = torch.Generator().manual_seed(seed)
    dmiss = torch.tensor([f.missing_rate for f in dataset.dense])
    smiss = torch.tensor([f.missing_rate for f in dataset.sparse])
    dense_valid = torch.rand(rows, len(dataset.dense), generator=g) >= dmiss
    sparse_valid = torch.rand(rows, len(dataset.sparse), generator=g) >= smiss
    dense = torch.randint(-2, 1000, (rows, len(dataset.dense)), generator=g) * dense_valid
    sparse = torch.randint(0, 1 << 32, (rows, len(dataset.sparse)), generator=g) * sparse_valid
    return dense, dense_valid, sparse, sparse_valid


def bench_arch(arch: str, args) -> dict:
    dataset = dataset_preset(args.dataset)
    plan = criteo_plan(dataset, args.table_cap)
    torch.manual_seed(0)
    dlrm = build_dlrm(ModelConfig(arch=arch), plan.tables(), len(plan.dense_features()), "cpu")
    eager = recom.InferenceModule(PreprocessModule(plan, dataset), dlrm).eval()
    variants = {"eager": eager, "lowered_eager": eager.lowered()}
    compile_info = {}
    example = raw_batch(dataset, 32, seed=0)
    for backend in args.backends:
        t0 = time.perf_counter()
        compiled = recom.compile(eager, example, backend=backend)
        compile_info[backend] = {
            "total_s": round(time.perf_counter() - t0, 2),
            **{k: v for k, v in compiled.metadata.items() if k != "op_histogram"},
        }
        variants[f"compiled_{backend}"] = compiled
        print(f"[{arch}] compiled backend={backend} in {compile_info[backend]['total_s']} s", flush=True)

    rows = []
    with fixed_threads(args.threads):
        for b in args.batch_sizes:
            inputs = raw_batch(dataset, b, seed=1000 + b)
            diffs = {name: recom.check_against_eager(fn, eager, inputs, atol=args.atol)
                     for name, fn in variants.items() if name != "eager"}
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):  # interleave variants so drift hits all of them alike
                for name, fn in variants.items():
                    samples[name].append(measure_latency(fn, inputs, args.repeats, args.warmup)["median_ms"])
            med = {name: statistics.median(v) for name, v in samples.items()}
            rows.append({
                "batch_size": b,
                "median_ms": med,
                "speedup_vs_eager": {name: med["eager"] / m for name, m in med.items()},
                "max_abs_diff_vs_eager": diffs,
                "rounds_median_ms": samples,
            })
            print(f"[{arch}] B={b:5d} " + "  ".join(f"{n}={m:.3f}ms(x{med['eager'] / m:.2f})" for n, m in med.items()),
                  flush=True)
    return {"arch": arch, "model": ModelConfig(arch=arch).model_dump(), "compile": compile_info, "results": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="criteo_kaggle")
    ap.add_argument("--table-cap", type=int, default=100_000)
    ap.add_argument("--archs", default="dlrm,dlrm_dcn")
    ap.add_argument("--backends", default="export,inductor,aoti")
    ap.add_argument("--batch-sizes", default="1,64,1024")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_compile.json")
    args = ap.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    report = {
        "bench": "compile",
        "torch": torch.__version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "threads": args.threads,
        "dataset": args.dataset,
        "table_cap": args.table_cap,
        "repeats": args.repeats, "warmup": args.warmup, "rounds": args.rounds,
        "archs": [bench_arch(a, args) for a in args.archs.split(",") if a],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=".bench_compile.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
