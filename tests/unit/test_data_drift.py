"""recforge.data.drift on crafted statistics, and the ingest stage's data statistics end to end
(recforge.pipelines.hooks.data_stats): two daily runs, the second with a column gone missing, flagged in the task
log, MLflow (real SQLite store) and the stage's outputs, without failing the run."""
from __future__ import annotations

import json
import logging
from datetime import date

import pytest

from recforge.config import PipelineConfig
from recforge.data.drift import DriftFlag, DriftThresholds, compare_stats, drifted_columns
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest as ingest_files
from recforge.data.stats import ColumnStats, DatasetStats, compute_column_stats
from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.hooks.data_stats import DRIFT_TAG, day_of, previous_stats
from recforge.pipelines.outputs import DriftFlagRecord, GenerateOutputs, IngestOutputs
from recforge.pipelines.stages.data import ingest
from recforge.tracking import TrackingStore


def col(name: str, role: str = "dense", **kw) -> ColumnStats:
    base = dict(name=name, role=role, arrow_type="int64", rows=1000, missing=0, missing_rate=0.0, distinct=500,
                distinct_exact=True)
    if role == "dense":
        base.update(min=0.0, max=100.0, mean=10.0, std=2.0)
    if role == "label":
        base.update(arrow_type="int8", distinct=2, min=0.0, max=1.0, mean=0.25, std=0.43, positive_rate=0.25)
    base.update(kw)
    return ColumnStats(**base)


def day(*columns: ColumnStats, rows: int = 1000, name: str = "2026-01-01") -> DatasetStats:
    return DatasetStats(dataset="d", manifest_dir="/x", rows=rows, shards=1, day=name, computed_at="now",
                        columns={c.name: c for c in columns})


PREV = day(col("label", "label"), col("I1"), col("C1", "categorical", distinct=1000, missing_rate=0.05))


def flags_of(current: DatasetStats, thresholds: DriftThresholds | None = None) -> list[tuple[str | None, str]]:
    return [(f.column, f.kind) for f in compare_stats(PREV, current, thresholds)]


def test_no_previous_day_or_the_same_statistics_flag_nothing():
    assert compare_stats(None, PREV) == []
    assert compare_stats(PREV, PREV) == []


@pytest.mark.parametrize("changed,expected", [
    (col("C1", "categorical", distinct=1000, missing_rate=0.2), [("C1", "missing_rate")]),
    (col("C1", "categorical", distinct=1000, missing_rate=0.14), []),  # moved 0.09 <= 0.1
    (col("C1", "categorical", distinct=2500, missing_rate=0.05), [("C1", "distinct")]),
    (col("C1", "categorical", distinct=450, missing_rate=0.05), [("C1", "distinct")]),
    (col("C1", "categorical", distinct=1900, missing_rate=0.05), []),
    (col("I1", mean=11.5), [("I1", "mean_shift")]),  # 0.75 previous std
    (col("I1", mean=10.8), []),
    (col("I1", max=600.0), [("I1", "range")]),  # width 100 -> 600
    (col("I1", max=300.0), []),
    (col("I1", arrow_type="double"), [("I1", "type")]),
])
def test_a_changed_column_is_flagged_past_its_threshold(changed, expected):
    current = day(*(changed if c.name == changed.name else c for c in PREV.columns.values()), name="2026-01-02")
    assert flags_of(current) == expected


def test_label_rate_columns_rows_and_small_counts():
    current = day(col("label", "label", positive_rate=0.35), col("C1", "categorical", distinct=1000,
                  missing_rate=0.05), col("C9", "categorical"), rows=4000)
    assert flags_of(current) == [(None, "rows"), ("label", "positive_rate"), ("C9", "appeared"),
                                 ("I1", "disappeared")]
    small = day(col("a", "categorical", distinct=3))
    assert compare_stats(small, day(col("a", "categorical", distinct=9))) == []  # both under distinct_min
    assert compare_stats(day(col("label", "label", positive_rate=0.25)),
                         day(col("label", "label", positive_rate=0.27))) == []


def test_thresholds_are_typed_and_respected():
    jump = day(col("label", "label"), col("I1"), col("C1", "categorical", distinct=1000, missing_rate=0.2))
    assert flags_of(jump, DriftThresholds(missing_rate_abs=0.5)) == []
    with pytest.raises(ValueError, match="distinct_ratio"):
        DriftThresholds(distinct_ratio=0.5)


def test_degenerate_statistics_are_reported_not_raised():
    """Zero std, zero positive rate, columns without numbers, no rows: compared without an exception."""
    prev = day(col("label", "label", positive_rate=0.0), col("I1", std=0.0, min=5.0, max=5.0, mean=5.0),
               col("E", "dense", min=None, max=None, mean=None, std=None, missing_rate=1.0), rows=0)
    cur = day(col("label", "label", positive_rate=0.1), col("I1", std=0.0, min=5.0, max=6.0, mean=5.5),
              col("E", "dense", min=None, max=None, mean=None, std=None, missing_rate=1.0), rows=10)
    flags = compare_stats(prev, cur)
    assert {(f.column, f.kind) for f in flags} == {(None, "rows"), ("label", "positive_rate"),
                                                   ("I1", "mean_shift"), ("I1", "range")}
    assert all("\n" not in f.message and f.message for f in flags)
    assert drifted_columns(flags) == ["label", "I1"]


def test_the_recorded_flag_has_the_fields_of_the_drift_flag():
    assert set(DriftFlagRecord.model_fields) == set(DriftFlag.model_fields)


# --- the ingest stage: statistics, history, drift, MLflow ---------------------------------------------------------
@pytest.fixture(scope="module")
def home(module_home):
    return module_home


def _daily_run(home, first_day: int, blank_column: int | None = None) -> IngestOutputs:
    """The ingest stage of a daily run on `first_day` (1 training day + the held-out day); `blank_column`: that
    field of the training day emptied on every other row."""
    cfg = PipelineConfig(rows_per_day=1500, train_days=1, rows_per_shard=1000)
    ctx = RunContext.create(f"scheduled__{date.fromordinal(first_day + 1)}", cfg, home=home, data_day=first_day)
    raw = home / "raw" / ctx.run_key
    report = generate_days(cfg.dataset(), raw, days=2, rows_per_day=cfg.rows_per_day, seed=1, first_day=first_day)
    if blank_column is not None:
        path = raw / report.files[0]
        lines = path.read_text().splitlines()
        for i in range(0, len(lines), 2):
            fields = lines[i].split("\t")
            fields[blank_column] = ""
            lines[i] = "\t".join(fields)
        path.write_text("\n".join(lines) + "\n")
    StageWriter(ctx, "generate").commit(GenerateOutputs(files=[str(raw / f) for f in report.files], synthetic=True))
    return ingest(ctx)


def test_ingest_records_statistics_and_flags_drift_against_the_previous_day(home, caplog):
    d0 = date(2026, 3, 1).toordinal()
    # the previous day, as an earlier run's ingest left it in the history
    history = home / "data_stats" / "criteo_kaggle" / "train"
    cfg = PipelineConfig()
    files = generate_days(cfg.dataset(), home / "raw" / "day0", days=1, rows_per_day=1500, seed=1,
                          first_day=d0).files
    ingest_files(files, cfg.dataset(), home / "day0", rows_per_shard=1000, max_bad_fraction=0.01)
    compute_column_stats(home / "day0", day="2026-03-01").save(history / "2026-03-01.json")

    with caplog.at_level(logging.WARNING, logger="recforge.pipelines"):
        second = _daily_run(home, d0 + 1, blank_column=14)  # C1 (after the label and I1..I13)
    stats = second.stats
    assert stats is not None and (stats.day, stats.previous_day) == ("2026-03-02", "2026-03-01")
    assert ("C1", "missing_rate") in [(f.column, f.kind) for f in stats.flags]
    assert "C1" in stats.drifted_columns
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("data drift" in m and "column 'C1': missing rate" in m for m in warnings)

    # beside the manifest, in its final place
    manifest_dir = second.train.manifest_dir
    assert stats.stats_path == f"{manifest_dir}/stats.json"
    drift = json.loads(open(stats.drift_path).read())
    assert drift["previous_day"] == "2026-03-01" and "C1" in drift["drifted_columns"]
    assert DatasetStats.load(stats.stats_path).columns["C1"].missing_rate >= 0.5

    store = TrackingStore()
    run = store.client.get_run(second.mlflow_run_id)
    assert run.info.status == "FINISHED"  # drift does not fail the run
    assert run.data.metrics["drift_flags"] == len(stats.flags) >= 1
    assert run.data.metrics["stats.C1.missing_rate"] >= 0.5 and "stats.I1.distinct" in run.data.metrics
    assert "C1" in run.data.tags[DRIFT_TAG].split(",")
    logged = {a.path for a in store.client.list_artifacts(run.info.run_id, "data_stats/train")}
    assert logged == {"data_stats/train/stats.json", "data_stats/train/drift.json",
                      "data_stats/train/missing_rate.png"}

    assert (history / "2026-03-02.json").is_file()  # for the next day
    # a re-run of the first day is compared with nothing earlier, not with itself or a later day
    assert previous_stats(history, "2026-03-01", "x") is None
    assert previous_stats(history, "2026-03-05", "x") == history / "2026-03-02.json"


def test_day_keys(home):
    ctx = RunContext.create("r", PipelineConfig(train_days=2), home=home, data_day=date(2026, 1, 1).toordinal())
    assert (day_of(ctx, "train"), day_of(ctx, "holdout")) == ("2026-01-02", "2026-01-03")
    assert day_of(RunContext.create("r", PipelineConfig(), home=home), "train") is None
