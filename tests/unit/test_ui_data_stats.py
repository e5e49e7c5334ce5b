"""The run page's column statistics and drift flags (ingest's `stats`), rendered from outputs written the way the
stage writes them (StageWriter): the table, drifted columns highlighted, the flags, the missing-rate chart, all
escaped; a run without statistics shows none."""
from __future__ import annotations

import base64

from fastapi.testclient import TestClient

from recforge.data.drift import compare_stats
from recforge.data.stats import ColumnStats, DatasetStats
from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.hooks.data_stats import PLOT_NAME, missing_rate_plot
from recforge.pipelines.outputs import (
    ColumnSummary,
    DataStatsOutputs,
    DriftFlagRecord,
    GenerateOutputs,
    IngestOutputs,
    SplitOutputs,
)
from recforge.pipelines.summary import summarize
from recforge.ui.app import create_app

EVIL = '<script>alert("x")</script>'


def _col(name: str, role: str, missing_rate: float, **kw) -> ColumnStats:
    return ColumnStats(name=name, role=role, arrow_type="int64", rows=100, missing=int(100 * missing_rate),
                       missing_rate=missing_rate, distinct=kw.pop("distinct", 40), distinct_exact=True, **kw)


def _stats(day: str, c1_missing: float) -> DatasetStats:
    cols = [_col("label", "label", 0.0, distinct=2, min=0.0, max=1.0, mean=0.25, std=0.4, positive_rate=0.25),
            _col("I1", "dense", 0.1, min=0.0, max=42.0, mean=3.5, std=2.0),
            _col("C1", "categorical", c1_missing), _col(EVIL, "categorical", 0.0)]
    return DatasetStats(dataset="d", manifest_dir="/x", rows=100, shards=1, day=day, computed_at="now",
                        columns={c.name: c for c in cols})


def _split() -> SplitOutputs:
    return SplitOutputs(manifest_dir="unused", rows=100, quarantined=0, shards=1)


def _run(home, key: str, with_stats: bool) -> None:
    ctx = RunContext.create(key, {}, home=home)
    StageWriter(ctx, "generate").commit(GenerateOutputs(files=["a", "b"], synthetic=True))
    w = StageWriter(ctx, "ingest")
    stats = None
    if with_stats:
        previous, current = _stats("2026-01-01", 0.02), _stats("2026-01-02", 0.6)
        flags = compare_stats(previous, current)
        (w.tmp / "train").mkdir()
        plot = missing_rate_plot(current, previous, ["C1"], w.tmp / "train" / PLOT_NAME)
        stats = DataStatsOutputs(
            split="train", day="2026-01-02", rows=100, stats_path=str(w.tmp / "train" / "stats.json"),
            drift_path=str(w.tmp / "train" / "drift.json"), plot_path=str(plot), previous_day="2026-01-01",
            previous_stats="/h/2026-01-01.json",
            columns=[ColumnSummary(name=c.name, role=c.role, missing_rate=c.missing_rate, distinct=c.distinct,
                                   min=c.min, max=c.max, mean=c.mean, positive_rate=c.positive_rate)
                     for c in current.columns.values()],
            flags=[DriftFlagRecord.model_validate(f.model_dump()) for f in flags], drifted_columns=["C1"])
    w.commit(IngestOutputs(train=_split(), holdout=_split(), rows_ingested=200, rows_quarantined=0, stats=stats))


def test_run_page_shows_column_statistics_and_highlights_drift(tmp_path):
    _run(tmp_path, "with_stats", True)
    _run(tmp_path, "without_stats", False)
    blocker = tmp_path / "no_mlflow"  # MLflow unreachable: the page still shows the recorded outputs
    blocker.write_text("")
    client = TestClient(create_app(allow_anonymous=True, home=tmp_path, mlflow_url="http://mlflow.example:5000",
                                   tracking_uri=f"sqlite:///{blocker}/mlflow.db"))
    body = client.get("/runs/with_stats", headers={"accept": "text/html"}).text
    assert "<script" not in body.lower() and "&lt;script&gt;" in body
    assert "Column statistics: train split, 2026-01-02 (100 rows)" in body
    table = body.split('id="column-stats"')[1].split("</table>")[0]
    rows = {r.split('"')[0]: r for r in table.split('<tr data-column="')[1:]}
    assert set(rows) == {"label", "I1", "C1", "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;"}
    assert 'class="bad drifted"' in rows["C1"] and "60.0 %" in rows["C1"] and "missing_rate" in rows["C1"]
    assert "drifted" not in rows["I1"] and "42" in rows["I1"] and "3.5" in rows["I1"]
    assert "positive rate 25.00 %" in rows["label"]
    flags = body.split('id="drift-flags"')[1].split("</div></div>")[0]
    assert "Drift against 2026-01-01" in flags
    assert 'data-column="C1" data-kind="missing_rate"' in flags and "missing rate 2.0% -&gt; 60.0%" in flags
    png = base64.b64decode(body.split('src="data:image/png;base64,')[-1].split('"')[0])
    assert png.startswith(b"\x89PNG")

    plain = client.get("/runs/without_stats", headers={"accept": "text/html"}).text
    assert 'id="column-stats"' not in plain and "Column statistics" not in plain
    assert client.get("/api/runs/with_stats").json()["data_stats"]["flags"][0]["column"] == "C1"
    # the CLI's summary (recforge run / demo) counts the flags too
    results = summarize(RunContext.create("with_stats", {}, home=tmp_path))["results"]
    assert (results["drift_flags"], results["drifted_columns"]) == (1, "C1")
    assert "drift_flags" not in summarize(RunContext.create("without_stats", {}, home=tmp_path))["results"]
