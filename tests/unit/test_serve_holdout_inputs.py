"""The compile stage's example and check inputs come from the held-out day, across its shards."""
from __future__ import annotations

from pathlib import Path

import pytest

from recforge.config import PipelineConfig
from recforge.data import generate_days, ingest
from recforge.data.shards import read_rows
from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.outputs import IngestOutputs, SplitOutputs
from recforge.pipelines.stages.serve import _holdout_inputs
from recforge.preprocess.batch import RawBatch


def _context(tmp_path, rows: int, rows_per_shard: int) -> RunContext:
    ctx = RunContext.create("holdout", PipelineConfig(rows_per_day=rows), home=tmp_path / "home")
    days = generate_days(ctx.config.dataset(), tmp_path / "raw", days=1, rows_per_day=rows, seed=5)
    manifest = ingest([Path(f) for f in days.files], ctx.config.dataset(), tmp_path / "holdout",
                      rows_per_shard=rows_per_shard, max_bad_fraction=0.0)
    split = SplitOutputs(manifest_dir=str(tmp_path / "holdout"), rows=manifest.total_rows, quarantined=0,
                         shards=len(manifest.shards))
    StageWriter(ctx, "ingest").commit(IngestOutputs(train=split, holdout=split, rows_ingested=2 * split.rows,
                                                    rows_quarantined=0))
    return ctx


def test_inputs_span_shards_and_stop_at_the_days_rows(tmp_path):
    ctx = _context(tmp_path, rows=700, rows_per_shard=300)  # shards of 300, 300, 100 rows
    dense, dense_valid, sparse, sparse_valid = _holdout_inputs(ctx, 650)
    assert dense.shape[0] == sparse.shape[0] == 650
    pieces = [RawBatch.from_arrow(read_rows(tmp_path / "holdout", i, 0, n), ctx.config.dataset())
              for i, n in ((0, 300), (1, 300), (2, 50))]
    assert (sparse[300:600] == pieces[1].sparse).all() and (sparse[600:] == pieces[2].sparse).all()
    assert (dense_valid[:300] == pieces[0].dense_valid).all()
    assert _holdout_inputs(ctx, 2048)[0].shape[0] == 700  # a small day gives what it has


def test_an_empty_holdout_day_is_a_clear_error(tmp_path):
    ctx = _context(tmp_path, rows=200, rows_per_shard=300)
    with pytest.raises(ValueError, match="has no rows"):
        _holdout_inputs(ctx, 0)  # asking for none is the same as a day without rows
