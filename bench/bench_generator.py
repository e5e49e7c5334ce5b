"""Throughput of recforge.data on one core: generator, reader (valid / with bad rows / gzip), ingest.

Side by side in one process, one thread everywhere, median of --repeats runs:
  generate_days            synthetic Criteo day file (plain and gzip)
  read_criteo              validated typed parse (all rows valid; 1% bad rows; gzip input)
  ingest                   read + Parquet shards + sha256 + manifest
  parse_line_reference     the per-row reference parser (on a subset) -- what the fast path replaces
  pyarrow.csv strings      split only, no validation or typing (a floor for the splitting work)
  pandas.read_csv          C engine, no validation, hex left as strings (a common peer)

    python bench/bench_generator.py --rows 200000
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform as py_platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)
try:
    import torch  # noqa: E402

    torch.set_num_threads(1)
except ImportError:  # torch is not needed by what is measured here
    torch = None

from recforge.config import dataset_preset  # noqa: E402
from recforge.data import Quarantine, generate_days, ingest, parse_line_reference, read_criteo  # noqa: E402
from recforge.data.schema import column_names  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def consume(path: Path, dataset, qdir: Path) -> int:
    with Quarantine(qdir / "q.jsonl") as q:
        return sum(b.num_rows for b in read_criteo(path, dataset, q))


def with_bad_rows(src: Path, dst: Path, share: float, seed: int) -> int:
    lines = src.read_bytes().split(b"\n")[:-1]
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(lines), size=max(1, int(len(lines) * share)), replace=False)
    for k, i in enumerate(idx):
        fields = lines[i].split(b"\t")
        if k % 3 == 0:
            fields[3] = b"abc"
        elif k % 3 == 1:
            fields[-3] = b"xyz"
        else:
            fields = fields[:-1]
        lines[i] = b"\t".join(fields)
    dst.write_bytes(b"\n".join(lines) + b"\n")
    return len(idx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="rows per generated day file")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dataset", default="criteo_kaggle")
    ap.add_argument("--reference-rows", type=int, default=20_000, help="rows timed for the per-row reference parser")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dataset = dataset_preset(args.dataset)
    work = Path(tempfile.mkdtemp(prefix="bench_generator_"))

    cases: list[tuple[str, int, object, dict]] = []

    def case(name: str, rows: int, fn, **extra) -> None:
        cases.append((name, rows, fn, extra))

    try:
        print(f"dataset={dataset.name} rows={args.rows} repeats={args.repeats} threads=1", flush=True)
        rep = generate_days(dataset, work / "raw", days=1, rows_per_day=args.rows, seed=args.seed)
        day = Path(rep.files[0])
        size_mb = day.stat().st_size / 1e6
        gz_rep = generate_days(dataset, work / "raw_gz", days=1, rows_per_day=args.rows, seed=args.seed, gzip=True)
        gz_day = Path(gz_rep.files[0])
        bad_day = work / "bad.tsv"
        n_bad = with_bad_rows(day, bad_day, 0.01, args.seed)
        assert consume(day, dataset, work) == args.rows
        assert consume(gz_day, dataset, work) == args.rows
        assert consume(bad_day, dataset, work) == args.rows - n_bad
        ref_lines = day.read_bytes().split(b"\n")[: args.reference_rows]
        names = column_names(dataset)

        case("generate_days", args.rows,
             lambda: generate_days(dataset, work / "gen", days=1, rows_per_day=args.rows, seed=args.seed))
        case("generate_days gzip", args.rows,
             lambda: generate_days(dataset, work / "gen_gz", days=1, rows_per_day=args.rows, seed=args.seed, gzip=True))
        case("read_criteo (valid)", args.rows, lambda: consume(day, dataset, work))
        case("read_criteo (1% bad rows)", args.rows, lambda: consume(bad_day, dataset, work), bad_rows=n_bad)
        case("read_criteo (gzip)", args.rows, lambda: consume(gz_day, dataset, work))
        case("ingest (valid, 50k rows/shard)", args.rows,
             lambda: ingest([day], dataset, work / "out", rows_per_shard=50_000, max_bad_fraction=0.0))
        case("parse_line_reference (per row)", len(ref_lines),
             lambda: [parse_line_reference(line, dataset) for line in ref_lines])
        case("pyarrow.csv strings (no checks)", args.rows, lambda: pacsv.read_csv(
            day,
            read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names}),
        ))
        try:
            import pandas as pd  # lazy: optional here, the case is skipped without pandas

            case("pandas.read_csv c engine", args.rows,
                 lambda: pd.read_csv(day, sep="\t", header=None, names=names, engine="c",
                                     dtype={n: str for n in dataset.sparse_names}))
        except ImportError:
            print("  pandas not installed: skipped")

        # round-robin over the cases so that load from other processes spreads over all of them
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for r in range(args.repeats):
            for name, _, fn, _ in cases:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            print(f"  repeat {r + 1}/{args.repeats} done", flush=True)
        results: list[dict] = []
        for name, rows, _, extra in cases:
            med = statistics.median(times[name])
            results.append({"name": name, "rows": rows, "median_s": med, "times_s": times[name],
                            "rows_per_s": rows / med, **extra})

        by = {r["name"]: r["rows_per_s"] for r in results}
        ratios = {
            "read_criteo / parse_line_reference": by["read_criteo (valid)"] / by["parse_line_reference (per row)"],
            "read_criteo / pyarrow.csv strings": by["read_criteo (valid)"] / by["pyarrow.csv strings (no checks)"],
        }
        if "pandas.read_csv c engine" in by:
            ratios["read_criteo / pandas.read_csv"] = by["read_criteo (valid)"] / by["pandas.read_csv c engine"]
        print()
        print(f"{'measurement':36s} {'rows/s':>12s} {'MB/s':>8s}  (MB of uncompressed day-file text)")
        for r in results:
            mbs = r["rows_per_s"] * size_mb / args.rows
            print(f"{r['name']:36s} {r['rows_per_s']:>12,.0f} {mbs:>8.1f}")
        print()
        for k, v in ratios.items():
            print(f"{k:44s} {v:6.2f}x")
        print(f"\nday file: {size_mb:.1f} MB, positive rate {rep.positive_rate[0]:.3f}, "
              f"bayes AUC {rep.bayes_auc[0]:.4f}")

        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = RESULTS / f"bench_generator_{stamp}.json"
        out.write_text(json.dumps({
            "bench": "bench_generator", "time_utc": stamp, "dataset": dataset.name, "rows": args.rows,
            "repeats": args.repeats, "threads": 1, "day_file_mb": size_mb,
            "positive_rate": rep.positive_rate[0], "bayes_auc": rep.bayes_auc[0],
            "python": py_platform.python_version(), "pyarrow": pa.__version__, "numpy": np.__version__,
            "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
            "results": results, "ratios": ratios,
        }, indent=2))
        print(f"wrote {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
