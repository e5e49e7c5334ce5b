"""Reader throughput per core for every input format (`recforge bench ingest`), one thread everywhere.

Cases, interleaved round-robin, median of --repeats rounds:
  criteo tsv (fast path)       the Criteo day file through read_source (is_criteo_layout -> read_criteo)
  criteo tsv (generic reader)  the same file through reader_text.read_text, the reader of any other schema
  csv header + strings         a realistic click-log CSV (~20 columns: string site/app/device ids, int
                               categoricals, an hour timestamp "%y%m%d%H", two floats, a multi-hot tag list)
  parquet (same rows)          that CSV's rows as a Parquet export (strings, ints, floats, a list column)

Goal (issue 15): every format within 1.5x of the Criteo fast path's rows/s on Criteo. The report gives each
case's rows/s and `slowdown_vs_criteo_fast` (fast rows/s / case rows/s; <= 1.5 meets the goal).

    python bench/bench_ingest.py                 # ~1 min: 200k rows per file, 5 rounds
    python bench/bench_ingest.py --rows 1000000  # bigger
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform as py_platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_report  # noqa: E402  # bench/_results.py
from recforge.config import DatasetConfig, dataset_preset  # noqa: E402
from recforge.data import Quarantine, generate_days, read_source  # noqa: E402
from recforge.data.reader_text import read_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ingest.json"
GOAL = 1.5

# (name, encoding or dtype, distinct values): an Avazu-like click log
STRING_COLS = [("site_id", 4700), ("site_domain", 7700), ("site_category", 26), ("app_id", 8500),
               ("app_domain", 560), ("app_category", 36), ("device_id", 200_000), ("device_ip", 500_000),
               ("device_model", 8200)]
INT_COLS = [("C1", 7), ("banner_pos", 7), ("device_type", 5), ("device_conn_type", 4), ("C14", 2600),
            ("C15", 8), ("C16", 9), ("C17", 435)]


def csv_dataset(fmt: str) -> DatasetConfig:
    cols: list[dict] = [{"name": "id", "role": "ignore"}, {"name": "click", "role": "label"},
                        {"name": "hour", "role": "timestamp", "format": "%y%m%d%H"}]
    cols += [{"name": n, "role": "categorical", "encoding": "int", "cardinality": k} for n, k in INT_COLS]
    cols += [{"name": n, "role": "categorical", "encoding": "string", "cardinality": k} for n, k in STRING_COLS]
    cols += [{"name": "price", "role": "dense", "dtype": "float"}, {"name": "bid", "role": "dense", "dtype": "float"},
             {"name": "tags", "role": "multi_hot", "encoding": "string", "max_length": 5}]
    extra = {"header": True} if fmt == "csv" else {}
    return DatasetConfig.model_validate({"name": f"clicks_{fmt}", "format": fmt, "columns": cols, **extra})


def zipf_pick(rng: np.random.Generator, pool: np.ndarray, n: int) -> np.ndarray:
    ranks = np.minimum(rng.zipf(1.3, n) - 1, len(pool) - 1)
    return pool[ranks]


def click_table(rows: int, seed: int) -> pa.Table:
    """Raw click-log rows as strings/ints/floats, as a warehouse would export them."""
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {
        "id": pa.array(rng.integers(0, 2**62, rows).astype(str)),
        "click": pa.array((rng.random(rows) < 0.17).astype(np.int8)),
        "hour": pa.array(np.char.add("141021", np.char.zfill((np.arange(rows) * 24 // rows).astype(str), 2))),
    }
    for name, k in INT_COLS:
        cols[name] = pa.array(zipf_pick(rng, rng.integers(0, 10**6, k), rows))
    for name, k in STRING_COLS:
        pool = np.array([f"{v:08x}" for v in rng.integers(0, 2**32, k)])
        vals = zipf_pick(rng, pool, rows)
        cols[name] = pa.array(vals, mask=rng.random(rows) < 0.02)
    cols["price"] = pa.array(np.round(rng.lognormal(0, 1, rows), 4), mask=rng.random(rows) < 0.1)
    cols["bid"] = pa.array(np.round(rng.random(rows) * 3, 3))
    tag_pool = np.array(["sports", "news", "games", "music", "travel", "finance", "kids", "auto"])
    n_tags = rng.integers(0, 4, rows)
    flat = tag_pool[rng.integers(0, len(tag_pool), int(n_tags.sum()))]
    offsets = np.concatenate(([0], np.cumsum(n_tags))).astype(np.int32)
    cols["tags"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    return pa.table(cols)


def write_csv(table: pa.Table, path: Path) -> None:
    tags = table.column("tags").combine_chunks()
    joined = pa.array(["|".join(t) for t in tags.to_pylist()])
    pacsv.write_csv(table.set_column(table.column_names.index("tags"), "tags", joined), path,
                    write_options=pacsv.WriteOptions(quoting_style="needed"))


def consume(reader, path: Path, dataset: DatasetConfig, work: Path) -> int:
    with Quarantine(work / "q.jsonl") as q:
        n = sum(b.num_rows for b in reader(path, dataset, q))
        if q.count:
            raise RuntimeError(f"bench: {q.count} rows quarantined from {path}: {q.last}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="rows per input file")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_ingest_"))
    try:
        criteo = dataset_preset("criteo_kaggle")
        day = Path(generate_days(criteo, work / "raw", days=1, rows_per_day=args.rows, seed=args.seed).files[0])
        raw = click_table(args.rows, args.seed)
        csv_path, pq_path = work / "clicks.csv", work / "clicks.parquet"
        write_csv(raw, csv_path)
        pq.write_table(raw, pq_path, row_group_size=65536, compression="snappy")
        csv_ds, pq_ds = csv_dataset("csv"), csv_dataset("parquet")
        cases = [
            ("criteo tsv (fast path)", day, lambda: consume(read_source, day, criteo, work)),
            ("criteo tsv (generic reader)", day, lambda: consume(read_text, day, criteo, work)),
            ("csv header + strings", csv_path, lambda: consume(read_source, csv_path, csv_ds, work)),
            ("parquet (same rows)", pq_path, lambda: consume(read_source, pq_path, pq_ds, work)),
        ]
        print(f"rows={args.rows} repeats={args.repeats} threads=1", flush=True)
        for name, _, fn in cases:
            got = fn()
            if got != args.rows:
                raise RuntimeError(f"bench: {name} read {got} rows, expected {args.rows}")
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for k in range(args.repeats):
            for name, _, fn in cases:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            print(f"  round {k + 1}/{args.repeats} done", flush=True)
        results = []
        for name, path, _ in cases:
            med = statistics.median(times[name])
            results.append({"name": name, "rows": args.rows, "file_mb": path.stat().st_size / 1e6,
                            "median_s": med, "times_s": times[name], "rows_per_s": args.rows / med})
        fast = results[0]["rows_per_s"]
        print(f"\n{'case':30s} {'rows/s':>12s} {'MB':>7s} {'slowdown':>9s}  (goal <= {GOAL}x of the fast path)")
        for r in results:
            r["slowdown_vs_criteo_fast"] = fast / r["rows_per_s"]
            r["meets_goal"] = r["slowdown_vs_criteo_fast"] <= GOAL
            print(f"{r['name']:30s} {r['rows_per_s']:>12,.0f} {r['file_mb']:>7.1f} "
                  f"{r['slowdown_vs_criteo_fast']:>8.2f}x  {'ok' if r['meets_goal'] else 'MISSES the goal'}")
        write_report(args.out, {
            "bench": "bench_ingest", "time_utc": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
            "rows": args.rows, "repeats": args.repeats, "threads": 1, "goal_slowdown": GOAL,
            "csv_columns": csv_ds.field_names,
            "python": py_platform.python_version(), "pyarrow": pa.__version__, "numpy": np.__version__,
            "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "results": results,
        })
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
