"""recforge.data.generator: determinism, layout from the config, realistic shape, learnable labels."""
from __future__ import annotations

import gzip
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from sklearn.metrics import roc_auc_score

from recforge.config import (
    DatasetConfig,
    DenseFeature,
    PipelineConfig,
    SparseFeature,
    criteo_kaggle_dataset,
    wide_dataset,
)
from recforge.data import Quarantine, auc, generate_days, ingest, read_criteo
from recforge.data.generator import default_cardinality_scale, id_space
from recforge.data.schema import arrow_schema
from recforge.pipelines.dag_tasks import data_day_of

DS = criteo_kaggle_dataset()
SMALL = DatasetConfig(
    name="small", label="click", positive_rate=0.1,
    dense=[DenseFeature(name="n0", missing_rate=0.5), DenseFeature(name="n1")],
    sparse=[
        SparseFeature(name="s0", cardinality=7),
        SparseFeature(name="s1", cardinality=1000, missing_rate=0.3),
        SparseFeature(name="s2", cardinality=5_000_000),
    ],
)


def read_table(path: Path, dataset: DatasetConfig, tmp_path: Path) -> tuple[pa.Table, int]:
    with Quarantine(tmp_path / f"{path.name}.q.jsonl") as q:
        table = pa.Table.from_batches(list(read_criteo(path, dataset, q)), schema=arrow_schema(dataset))
    return table, q.count


def test_same_seed_same_bytes_other_seed_or_day_differs(tmp_path):
    a = generate_days(DS, tmp_path / "a", days=2, rows_per_day=3000, seed=7)
    b = generate_days(DS, tmp_path / "b", days=2, rows_per_day=3000, seed=7)
    c = generate_days(DS, tmp_path / "c", days=1, rows_per_day=3000, seed=8)
    day0, day1 = (Path(f).read_bytes() for f in a.files)
    assert [Path(f).read_bytes() for f in b.files] == [day0, day1]
    assert a.model_dump(exclude={"files"}) == b.model_dump(exclude={"files"})
    assert Path(c.files[0]).read_bytes() != day0
    assert day0 != day1
    assert [Path(f).name for f in a.files] == ["day_0.tsv", "day_1.tsv"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["day_0.tsv", "day_1.tsv"]  # no temp files left


def test_first_day_slides_the_window_over_one_hidden_model(tmp_path):
    base = generate_days(SMALL, tmp_path / "base", days=3, rows_per_day=500, seed=7)
    later = generate_days(SMALL, tmp_path / "later", days=2, rows_per_day=500, seed=7, first_day=1)
    assert [Path(f).read_bytes() for f in later.files] == [Path(f).read_bytes() for f in base.files[1:]]
    assert later.id_space == base.id_space  # same hidden model, other days
    with pytest.raises(ValueError, match="first_day must be >= 0"):
        generate_days(SMALL, tmp_path / "bad", days=1, rows_per_day=10, seed=7, first_day=-1)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_daily_dag_runs_draw_the_days_of_their_logical_date():
    class Run:  # the two attributes of an Airflow DagRun that data_day_of reads
        run_after = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)

    day = datetime(2026, 11, 29, tzinfo=UTC)
    # the train_days days end with the run's day (holdout next_day: the day after is held out)
    assert data_day_of({"logical_date": day, "dag_run": Run()}, {"train_days": 2}) == day.date().toordinal() - 1
    nxt = data_day_of({"logical_date": datetime(2026, 11, 30, tzinfo=UTC), "dag_run": Run()}, {"train_days": 2})
    assert nxt == day.date().toordinal()  # tomorrow's run: its window slides by one day
    # a manual run without a logical date (Airflow 3) falls back to run_after; the default train_days applies
    manual = data_day_of({"logical_date": None, "dag_run": Run()}, {})
    assert manual == Run.run_after.date().toordinal() - PipelineConfig().train_days + 1


def test_gzip_is_deterministic_and_same_content(tmp_path):
    plain = generate_days(DS, tmp_path / "p", days=1, rows_per_day=2000, seed=1)
    gz1 = generate_days(DS, tmp_path / "g1", days=1, rows_per_day=2000, seed=1, gzip=True)
    gz2 = generate_days(DS, tmp_path / "g2", days=1, rows_per_day=2000, seed=1, gzip=True)
    assert gz1.files[0].endswith("day_0.tsv.gz")
    assert Path(gz1.files[0]).read_bytes() == Path(gz2.files[0]).read_bytes()
    assert gzip.decompress(Path(gz1.files[0]).read_bytes()) == Path(plain.files[0]).read_bytes()


@pytest.mark.parametrize("dataset", [DS, SMALL, wide_dataset()], ids=["criteo", "small", "wide400"])
def test_layout_follows_config_and_ingests_clean(tmp_path, dataset):
    rows = 300 if len(dataset.sparse) > 100 else 2000
    rep = generate_days(dataset, tmp_path / "raw", days=1, rows_per_day=rows, seed=0)
    lines = Path(rep.files[0]).read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) - 1 == rows == rep.rows_per_day[0]
    assert {line.count(b"\t") for line in lines[:-1]} == {dataset.num_fields - 1}
    m = ingest([Path(f) for f in rep.files], dataset, tmp_path / "out", rows_per_shard=1000, max_bad_fraction=0.0)
    assert m.quarantined_rows == 0 and m.total_rows == rows
    assert set(rep.id_space) == set(dataset.sparse_names)


def test_shape_is_realistic(tmp_path):
    rows = 20_000
    rep = generate_days(DS, tmp_path / "raw", days=1, rows_per_day=rows, seed=2)
    table, bad = read_table(Path(rep.files[0]), DS, tmp_path)
    assert bad == 0
    # missing values at the configured per-column rates
    for feat in DS.dense + DS.sparse:
        share = table.column(feat.name).null_count / rows
        assert abs(share - feat.missing_rate) < 0.02, (feat.name, share, feat.missing_rate)
    # dense: counts, I2 with -1/-2 like Criteo, heavy tail
    i2 = table.column("I2").drop_null().to_numpy()
    assert set(np.unique(i2[i2 < 0])) == {-1, -2}
    for name in DS.dense_names:
        x = table.column(name).drop_null().to_numpy()
        assert (x >= -2).all()
        if name != "I2":
            assert (x >= 0).all()
    i5 = table.column("I5").drop_null().to_numpy()
    assert np.percentile(i5, 99) > 5 * max(np.median(i5), 1)
    # sparse: 32-bit raw values, small columns exact, Zipf-like skew
    c9 = table.column("C9").drop_null().to_numpy()
    assert len(np.unique(c9)) <= 3 == rep.id_space["C9"]
    c3 = table.column("C3").drop_null().to_numpy()
    assert c3.min() >= 0 and c3.max() < 2**32 and c3.max() > 2**31  # unsigned, spread over 32 bits
    _, counts = np.unique(c3, return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[0] > 50 * np.median(counts)  # head ids are far more frequent than typical ones
    assert len(counts) > 1000  # and there is a long tail
    assert rep.id_space["C1"] == 1460 and rep.id_space["C3"] < 10_131_227


def test_cardinality_scale(tmp_path):
    assert default_cardinality_scale(DS, 200_000) == pytest.approx(200_000 / 10_131_227)
    assert default_cardinality_scale(SMALL, 10**9) == 1.0
    assert id_space(1460, 0.01) == 1460  # small columns stay exact
    assert id_space(10_131_227, 0.02) == 202_625
    rep = generate_days(SMALL, tmp_path / "raw", days=1, rows_per_day=500, seed=0, cardinality_scale=0.5)
    assert rep.id_space == {"s0": 7, "s1": 1000, "s2": 2_500_000}
    with pytest.raises(ValueError, match="cardinality_scale"):
        generate_days(SMALL, tmp_path / "raw", days=1, rows_per_day=10, seed=0, cardinality_scale=0.0)


@pytest.mark.parametrize("dataset", [DS, SMALL], ids=["criteo", "small"])
def test_positive_rate_and_bayes_auc(tmp_path, dataset):
    rep = generate_days(dataset, tmp_path / "raw", days=2, rows_per_day=20_000, seed=5)
    for rate, bayes in zip(rep.positive_rate, rep.bayes_auc, strict=True):
        assert abs(rate - dataset.positive_rate) < 0.02
        assert 0.6 < bayes < 0.95
    table, _ = read_table(Path(rep.files[0]), dataset, tmp_path)
    assert table.column(dataset.label).to_numpy().mean() == pytest.approx(rep.positive_rate[0])


def test_labels_are_learnable_from_head_ids(tmp_path):
    """Click rate differs across the frequent ids of a column: there is signal a model can learn."""
    rep = generate_days(DS, tmp_path / "raw", days=1, rows_per_day=20_000, seed=4)
    table, _ = read_table(Path(rep.files[0]), DS, tmp_path)
    y = table.column("label").to_numpy()
    spreads = []
    for name in DS.sparse_names:
        ids = table.column(name).fill_null(-1).to_numpy()
        values, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        rates = np.bincount(inverse, weights=y) / counts
        frequent = counts >= 200
        if frequent.sum() >= 2:
            spreads.append(rates[frequent].max() - rates[frequent].min())
    assert max(spreads) > 0.2


def test_auc_matches_sklearn():
    rng = np.random.default_rng(0)
    y = rng.random(500) < 0.3
    scores = np.round(rng.random(500) + 0.3 * y, 1)  # many ties
    assert auc(y, scores) == pytest.approx(roc_auc_score(y, scores))
    with pytest.raises(ValueError):
        auc(np.zeros(3), np.arange(3))
