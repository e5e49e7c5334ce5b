"""Flat-memory scoring of a day: StreamingAuc against the rank AUC, and the evaluate stage's
stream_metrics against recforge.train.metrics.evaluate (which holds every logit) on a small manifest."""
from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import roc_auc_score

from recforge.config import DatasetConfig, DenseFeature, ModelConfig, SparseFeature
from recforge.data import shards
from recforge.data.binned_auc import StreamingAuc
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest
from recforge.data.manifest import Manifest
from recforge.data.shards import iter_shard, open_manifest, read_rows
from recforge.pipelines.stages.evaluate import stream_metrics
from recforge.preprocess.executor import TorchExecutor
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.metrics import NonFiniteMetricsError, evaluate
from recforge.train.model import build_dlrm


def test_streaming_auc_is_within_its_bound_of_the_rank_auc_chunk_by_chunk():
    rng = np.random.default_rng(3)
    y = rng.random(200_000) < 0.25
    p = 1.0 / (1.0 + np.exp(-(rng.normal(-1.2, 1.0, y.size) + 1.1 * y)))
    s = StreamingAuc()
    for lo in range(0, y.size, 7_777):  # chunks of any size add up
        s.update(y[lo:lo + 7_777], p[lo:lo + 7_777])
    exact = roc_auc_score(y, p)
    assert s.count == y.size
    assert 0 < s.error_bound() < 1e-4
    assert abs(s.auc() - exact) <= s.error_bound() + 1e-12
    coarse = StreamingAuc(bins=4)  # few bins: a larger bound that still holds
    coarse.update(y, p)
    assert abs(coarse.auc() - exact) <= coarse.error_bound()
    assert coarse.error_bound() > s.error_bound()


def test_streaming_auc_rejects_bad_input():
    s = StreamingAuc(bins=16)
    with pytest.raises(ValueError, match="NaN"):
        s.update(np.array([0, 1]), np.array([0.1, np.nan]))
    with pytest.raises(ValueError, match="2 labels but 1 scores"):
        s.update(np.array([0, 1]), np.array([0.1]))
    s.update(np.array([1, 1]), np.array([0.2, 0.3]))
    with pytest.raises(ValueError, match="both positive and negative"):
        s.auc()
    with pytest.raises(ValueError, match="bins"):
        StreamingAuc(bins=1)


SMALL = DatasetConfig(
    name="small",
    dense=[DenseFeature(name="I1", missing_rate=0.2), DenseFeature(name="I2")],
    sparse=[SparseFeature(name="C1", cardinality=50, missing_rate=0.1), SparseFeature(name="C2", cardinality=500)],
)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    report = generate_days(SMALL, root / "raw", days=1, rows_per_day=3000, seed=1)
    ingest([root / "raw" / "day_0.tsv"], SMALL, root / "data", rows_per_shard=1100, max_bad_fraction=0.0)
    plan = criteo_plan(SMALL, table_cap=100)
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=4, dense_arch=[8, 4], over_arch=[8, 1]), plan.tables(), 2)
    return root / "data", model, TorchExecutor(plan, SMALL), report


def test_the_generators_bayes_auc_is_the_streamed_one(scored):
    report = scored[3]
    assert 0.6 < report.bayes_auc[0] < 0.95
    assert 0 < report.positive_rate[0] < 1


def test_stream_metrics_match_the_in_memory_evaluation(scored):
    data, model, ex, _ = scored
    whole = evaluate(model, ex, data, batch_size=4096)
    for batch, slab in ((4096, 65536), (97, 300)):  # slabs inside shards, batches inside slabs
        m = stream_metrics(model, ex, data, batch_size=batch, slab_rows=slab)
        assert m["rows"] == whole["rows"] == 3000
        assert m["logloss"] == pytest.approx(whole["logloss"], rel=1e-6)  # float32 logits, any batch
        assert m["ne"] == pytest.approx(whole["ne"], rel=1e-6)
        assert abs(m["auc"] - whole["auc"]) <= m["auc_error_bound"] + 1e-6
    assert model.training  # the mode it found is restored


def test_stream_metrics_fail_on_non_finite_logits_naming_the_row(scored):
    data, model, ex, _ = scored
    poisoned = build_dlrm(ModelConfig(embedding_dim=4, dense_arch=[8, 4], over_arch=[8, 1]), ex.plan.tables(), 2)
    with torch.no_grad():
        next(poisoned.parameters()).view(-1)[:4] = float("nan")
    with pytest.raises(NonFiniteMetricsError, match=r"not finite on \d+ of \d+ rows of shard part-00000.parquet .*"
                                                    r"first: row \d+"):
        stream_metrics(poisoned, ex, data, batch_size=512)


def test_iter_shard_walks_every_row_in_order_and_leaves_no_file_open(scored):
    data = scored[0]
    manifest = open_manifest(data)
    shards._open.cache_clear()
    for i, shard in enumerate(manifest.shards):
        whole = read_rows(data, i, 0, shard.rows)
        slabs = list(iter_shard(data, i, 256))
        assert all(0 < s.num_rows <= 256 for s in slabs)
        assert pa.Table.from_batches(slabs).combine_chunks().to_batches()[0].equals(whole)
    shards._open.cache_clear()
    stream_metrics(scored[1], scored[2], data, batch_size=97, slab_rows=300)
    assert shards._open.cache_info().currsize == 0  # the one-pass walk does not fill read_rows' open-file cache
    with pytest.raises(ValueError, match="slab_rows must be >= 1"):
        next(iter_shard(data, 0, 0))


def test_stream_metrics_refuse_a_shard_shorter_than_its_manifest(scored, tmp_path):
    data, model, ex, _ = scored
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    manifest = Manifest.load(copy)
    first = copy / manifest.shards[0].path
    table = pq.read_table(first)
    pq.write_table(table.slice(0, table.num_rows - 5), first)  # truncated after ingest
    with pytest.raises(ValueError, match=rf"shard {manifest.shards[0].path} of .* holds {table.num_rows - 5} rows, "
                                         rf"its manifest says {table.num_rows}"):
        stream_metrics(model, ex, copy, batch_size=512)
