"""The massive-column model family: presets, column kinds, request batches."""
from __future__ import annotations

import pytest
import torch

from recforge.recom.family import (
    FamilySpec,
    batch_of,
    build_model,
    fingerprint_strings,
    make_features,
    preset,
    scaled,
    select_rows,
)
from recforge.recom.family.columns import BucketizedColumn, RawIdColumn, SafeMultiHotColumn
from test_recom_columns_fixtures import SMALL, eager, small_model


def test_presets_match_the_paper_models():
    e, f = preset("E"), preset("F")
    assert e.num_columns == 1000 and f.num_columns == 1200  # F's Table 1 row says 1,000; its kinds sum to 1,200
    for spec, width in ((e, 8120), (f, 9672)):
        small = FamilySpec(**{**spec.__dict__, "large_rows": 16, "vary": True})
        layer = build_model(FamilySpec(**{**small.__dict__, "top": (4,), "bottom": (4,)})).embedding
        assert layer.output_dim == width


def test_scaled_keeps_the_mix():
    e = preset("E")
    for n in (10, 100, 1000, 1200):
        s = scaled(e, n)
        assert s.num_columns == n
        assert s.bucketized >= s.int_hash >= s.large_multi_hot
    assert scaled(e, 10).bucketized == 9
    with pytest.raises(ValueError, match="num_columns"):
        scaled(e, 0)


def test_one_submodule_per_column_and_kinds():
    m = small_model()
    kinds = [c.kind for c in m.embedding.columns.values()]
    assert len(kinds) == SMALL.num_columns
    assert kinds.count("bucketized") == 3 and kinds.count("raw_id") == 2
    assert kinds.count("safe_multi_hot") == 3 and kinds.count("multi_hot") == 4  # 3 of 6 safe + 1 large
    dims = {c.bag.embedding_dim if hasattr(c, "bag") else 0 for c in m.embedding.columns.values()}
    assert dims - {0} <= {4, 8, 12, 32}


def test_forward_on_a_request():
    m = small_model()
    f = make_features(m, 17, seed=1)
    assert batch_of(f) == 17
    for name, col in m.embedding.columns.items():
        if col.kind in ("multi_hot", "safe_multi_hot"):
            assert int(f[name + "_lengths"].sum()) == f[name].shape[0] != 17
    y = eager(m, f)
    assert y.shape == (17,) and bool(((y > 0) & (y < 1)).all())
    emb = eager(m.embedding, f)
    assert emb.shape == (17, m.embedding.output_dim)


def test_safe_lookup_zeroes_empty_rows_and_pools_the_rest():
    torch.manual_seed(0)
    for combiner in ("sum", "mean"):
        col = SafeMultiHotColumn(50, 4, combiner=combiner, salt=7)
        values = torch.tensor([5, 9, 9, 1 << 40], dtype=torch.int64)
        lengths = torch.tensor([2, 0, 2])
        out = eager(col, values, lengths)
        ids = torch.ops.recforge.sigrid_hash(values, 7, 50)
        rows = col.weight[ids]
        want = torch.stack([rows[:2].sum(0), torch.zeros(4), rows[2:].sum(0)])
        if combiner == "mean":
            want = want / torch.tensor([2.0, 1.0, 2.0]).unsqueeze(1)
        torch.testing.assert_close(out, want)


def test_bucketized_column_edges():
    col = BucketizedColumn(torch.tensor([0.0, 5.0, 10.0]), 4)
    x = torch.tensor([-1.0, 0.0, 0.5, 10.0, 11.0, float("nan")])
    ids = torch.bucketize(x, col.boundaries)
    assert ids.tolist() == [0, 0, 1, 2, 3, 3]  # [0, K]: K = 3 is reached; NaN -> K
    assert eager(col, x).shape == (6, 4)
    with pytest.raises(ValueError, match="increasing"):
        BucketizedColumn(torch.tensor([1.0, 1.0]), 4)


def test_raw_id_column_oov_behaviour():
    torch.manual_seed(0)
    zero = RawIdColumn(10, 3, oov="zero")
    out = eager(zero, torch.tensor([-5, 3, 10, 99]))
    torch.testing.assert_close(out, zero.embedding.weight[torch.tensor([0, 3, 0, 0])])
    err = RawIdColumn(10, 3, oov="error")
    with pytest.raises(IndexError):
        eager(err, torch.tensor([10]))


def test_select_rows_is_row_selection_of_the_model():
    m = small_model()
    f = make_features(m, 12, seed=2)
    rows = [3, 0, 11, 3]
    sub = select_rows(f, rows)
    torch.testing.assert_close(eager(m, sub), eager(m, f)[rows], rtol=0, atol=1e-6)


def test_fingerprints_are_stable_int64():
    a = fingerprint_strings(["abc", "abd", "abc"])
    assert a.dtype == torch.int64 and a[0] == a[2] and a[0] != a[1]
    assert fingerprint_strings(["abc"]).item() == a[0].item()


def test_bad_specs_name_the_field():
    with pytest.raises(ValueError, match="bucketized"):
        FamilySpec(bucketized=-1)
    with pytest.raises(ValueError, match="safe_fraction"):
        FamilySpec(safe_fraction=2.0)
    with pytest.raises(ValueError, match="preset"):
        preset("Z")
    with pytest.raises(ValueError, match="batch"):
        make_features(small_model(), 0)
