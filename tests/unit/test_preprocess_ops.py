"""Every torch op in recforge.preprocess.semantics.ops vs the numpy reference, on edge-case inputs (hypothesis)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from recforge.preprocess.semantics import ops
from recforge.preprocess.semantics import reference as ref
from recforge_kernels.reference import sigrid_hash_ref

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FAST = settings(max_examples=60, deadline=None)

floats32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(0.0, 1.0, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-5, 0.99999, float("nan"), float("inf"), float("-inf")]),
)
int64s = st.one_of(
    st.integers(INT64_MIN, INT64_MAX), st.sampled_from([0, 1, -1, INT64_MIN, INT64_MAX, 2**24 + 1, 2**53 + 1]),
    st.integers(-100, 100),
)
float_cols = hnp.arrays(np.float32, st.integers(0, 40), elements=floats32)  # includes B = 0
int_cols = hnp.arrays(np.int64, st.integers(0, 40), elements=int64s)


def close(actual: torch.Tensor, expected: np.ndarray) -> None:
    assert actual.dtype == torch.float32 and expected.dtype == np.float32
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@FAST
@given(x=int_cols, data=st.data(), value=st.one_of(st.integers(-5, 5), st.floats(-3, 3)))
def test_fill_null_dense(x, data, value):
    valid = data.draw(hnp.arrays(np.bool_, x.shape))
    got = ops.fill_null(torch.from_numpy(x), torch.from_numpy(valid), value, "dense")
    expected = ref.fill_null_ref(x, valid, value, "dense")
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)
    assert (got.numpy()[~valid] == np.float32(value)).all()


@FAST
@given(x=int_cols, data=st.data(), value=st.integers(-5, 5))
def test_fill_null_sparse(x, data, value):
    valid = data.draw(hnp.arrays(np.bool_, x.shape))
    got = ops.fill_null(torch.from_numpy(x), torch.from_numpy(valid), value, "sparse")
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), ref.fill_null_ref(x, valid, value, "sparse"))
    np.testing.assert_array_equal(got.numpy()[valid], x[valid])  # valid values pass through, extremes included


def test_fill_null_uses_the_mask_not_the_value():
    x = torch.tensor([0, 7, 0, -3])
    valid = torch.tensor([True, False, False, True])
    assert ops.fill_null(x, valid, 9, "sparse").tolist() == [0, 9, 9, -3]
    assert ops.fill_null(x, valid, 0.5, "dense").tolist() == [0.0, 0.5, 0.5, -3.0]
    assert ops.fill_null(x, valid, 4.0, "sparse").tolist() == [0, 4, 4, -3]
    with pytest.raises(ValueError, match="kind"):
        ops.fill_null(x, valid, 0, "wide")
    with pytest.raises(ValueError, match="integer"):
        ops.fill_null(x, valid, 0.5, "sparse")


@FAST
@given(x=float_cols, eps=st.sampled_from([1e-5, 1e-3, 0.25]))
def test_logit(x, eps):
    close(ops.logit(torch.from_numpy(x), eps), ref.logit_ref(x, eps))


def test_logit_known_values():
    y = ops.logit(torch.tensor([0.5, 0.0, 1.0, float("inf"), float("-inf")]), 1e-5)
    assert y[0].item() == 0.0
    assert y[1].item() == pytest.approx(np.log(1e-5 / (1 - 1e-5)), rel=1e-4)
    assert y[2].item() == pytest.approx(-y[1].item(), rel=1e-3)  # float32: 1 - (1 - eps) loses digits
    assert y[3].item() == y[2].item() and y[4].item() == y[1].item()
    assert torch.isnan(ops.logit(torch.tensor([float("nan")]))).all()


@FAST
@given(x=float_cols)
def test_log1p(x):
    close(ops.log1p(torch.from_numpy(x)), ref.log1p_ref(x))


def test_log1p_known_values():
    y = ops.log1p(torch.tensor([0.0, -3.0, 1.0, float("inf"), float("-inf"), 1e-9, 1e6]))
    np.testing.assert_allclose(y.numpy(), [0.0, 0.0, np.log(2.0), np.inf, 0.0, 1e-9, np.log1p(1e6)], rtol=1e-7)
    assert y.dtype == torch.float32 and torch.isnan(ops.log1p(torch.tensor([float("nan")]))).all()


@FAST
@given(x=float_cols, lmbda=st.sampled_from([0.0, 0.5, -1.0, 2.0, 0.25]))
def test_boxcox(x, lmbda):
    close(ops.boxcox(torch.from_numpy(x), lmbda), ref.boxcox_ref(x, lmbda))


def test_boxcox_known_values():
    x = torch.tensor([np.e, 4.0, -2.0, 0.0])
    np.testing.assert_allclose(ops.boxcox(x, 0.0).numpy(), [1.0, np.log(4.0), -2.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(ops.boxcox(x, 0.5).numpy(), [2 * (np.sqrt(np.e) - 1), 2.0, -2.0, 0.0], rtol=1e-6)


@FAST
@given(
    x=float_cols,
    borders=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=6, unique=True).map(sorted),
)
def test_bucketize(x, borders):
    got = ops.bucketize(torch.from_numpy(x), borders)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), ref.bucketize_ref(x, borders))


def test_bucketize_ties_count_strictly_greater():
    y = ops.bucketize(torch.tensor([0.5, 0.6, 1.0, 2.0, -1.0, float("nan"), float("inf")]), [0.5, 1.0, 1.5])
    assert y.tolist() == [0, 1, 1, 3, 0, 0, 3]


@FAST
@given(x=float_cols, lo=st.floats(-10, 10, width=32), width=st.floats(0, 10, width=32))
def test_clamp_float(x, lo, width):
    hi = float(np.float32(lo + width))
    close(ops.clamp(torch.from_numpy(x), lo, hi), ref.clamp_ref(x, lo, hi))


@FAST
@given(x=int_cols, lo=st.integers(-1000, 1000), width=st.integers(0, 1000))
def test_clamp_int(x, lo, width):
    got = ops.clamp(torch.from_numpy(x), lo, lo + width)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), ref.clamp_ref(x, lo, lo + width))


@FAST
@given(
    x=hnp.arrays(np.int64, st.tuples(st.integers(0, 10), st.integers(1, 6)), elements=int64s),
    X=st.integers(1, 8),
)
def test_firstx(x, X):
    got = ops.firstx(torch.from_numpy(x), X)
    assert got.shape == (x.shape[0], min(X, x.shape[1]))
    np.testing.assert_array_equal(got.numpy(), ref.firstx_ref(x, X))


def test_firstx_rejects_zero():
    with pytest.raises(ValueError, match="X must be >= 1"):
        ops.firstx(torch.zeros(2, 3, dtype=torch.int64), 0)


@FAST
@given(x=int_cols, salt=st.sampled_from([0, 1, -5, INT64_MAX]), M=st.sampled_from([1, 2, 1460, 10131227, 2**31 - 1]))
def test_sigrid_hash_single_modulus(x, salt, M):
    got = ops.sigrid_hash(torch.from_numpy(x), salt, M)
    np.testing.assert_array_equal(got.numpy(), ref.sigrid_hash_np(x, salt, M))
    assert ((got >= 0) & (got < M)).all()


@FAST
@given(
    x=hnp.arrays(np.int64, st.tuples(st.integers(0, 12), st.just(3)), elements=int64s),
    ms=st.lists(st.sampled_from([1, 2, 583, 1460, 100_000, 2**31 - 1]), min_size=3, max_size=3),
)
def test_sigrid_hash_per_column_moduli(x, ms):
    got = ops.sigrid_hash(torch.from_numpy(x), 0, torch.tensor(ms))
    for j, m in enumerate(ms):
        np.testing.assert_array_equal(got[:, j].numpy(), ref.sigrid_hash_np(x[:, j], 0, m))


# ---------------------------------------------------------------- ops added with issue 3: cast, onehot, ngram, mapid,
# list (jagged) columns


@FAST
@given(x=float_cols)
def test_cast_float_to_id(x):
    got = ops.cast(torch.from_numpy(x), "id")
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), ref.cast_ref(x, "id"))


def test_cast_known_values():
    x = torch.tensor([1.9, -1.9, float("nan"), float("inf"), float("-inf"), 2.0**63, -(2.0**63), 2.0**62])
    assert ops.cast(x, "id").tolist() == [1, -1, 0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN, 2**62]
    assert ops.cast(torch.tensor([INT64_MAX, -3]), "float").tolist() == [2.0**63, -3.0]


@FAST
@given(x=int_cols)
def test_cast_id_to_float(x):
    got = ops.cast(torch.from_numpy(x), "float")
    np.testing.assert_array_equal(got.numpy(), ref.cast_ref(x, "float"))


@FAST
@given(x=float_cols, lo=st.floats(-20, 5, width=32), span=st.floats(0.5, 40, width=32), C=st.integers(1, 9))
def test_onehot(x, lo, span, C):
    hi = float(np.float32(lo + span))
    got = ops.onehot(torch.from_numpy(x).unsqueeze(1), lo, hi, C)
    assert got.shape == (len(x), C) and got.dtype == torch.float32
    expected = np.stack([ref.onehot_ref(x[i:i + 1], lo, hi, C) for i in range(len(x))]) if len(x) else np.zeros((0, C))
    np.testing.assert_array_equal(got.numpy(), expected)
    assert (got.sum(1) == 1).all()


def test_onehot_known_values():
    x = torch.tensor([[0.0], [3.2], [3.19], [15.99], [16.0], [-0.5], [float("nan")], [float("inf")], [-1e30]])
    idx = ops.onehot(x, 0.0, 16.0, 5).argmax(1).tolist()
    assert idx == [0, 1, 0, 4, 0, 0, 0, 0, 0]  # outside [0, C) (and NaN, inf) -> class 0, as RAP / TorchArrow


@FAST
@given(x=hnp.arrays(np.int64, st.tuples(st.integers(0, 8), st.integers(1, 9)), elements=int64s), n=st.integers(1, 12))
def test_ngram_fixed_width(x, n):
    got = ops.ngram(torch.from_numpy(x), n)
    expected = [ref.ngram_ref(r, n) for r in x]
    assert got.shape[1] == (x.shape[1] - min(n, x.shape[1]) + 1) * min(n, x.shape[1])
    for row, e in zip(got.numpy(), expected, strict=True):
        np.testing.assert_array_equal(row, e)


def test_ngram_known_values():
    assert ops.ngram(torch.tensor([[1, 2, 3, 4]]), 2).tolist() == [[1, 2, 2, 3, 3, 4]]
    assert ops.ngram(torch.tensor([[1, 2, 3]]), 5).tolist() == [[1, 2, 3]]  # n' = min(n, w)
    assert ops.ngram(torch.tensor([[7]]), 4).tolist() == [[7]]


@FAST
@given(x=int_cols, table=st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=20))
def test_mapid(x, table):
    got = ops.mapid(torch.from_numpy(x), table)
    np.testing.assert_array_equal(got.numpy(), ref.mapid_ref(x, table))


def test_mapid_out_of_range_is_zero():
    assert ops.mapid(torch.tensor([-1, 0, 2, 3, INT64_MAX, INT64_MIN]), [16, 15, 14]).tolist() == [0, 16, 14, 0, 0, 0]


jagged_rows = st.lists(st.lists(int64s, min_size=0, max_size=7), min_size=0, max_size=12)  # empty rows, empty batch


def to_jagged(rows):
    values = torch.tensor([v for r in rows for v in r], dtype=torch.int64)
    return values, torch.tensor([len(r) for r in rows], dtype=torch.int64)


@FAST
@given(rows=jagged_rows, X=st.integers(1, 8))
def test_firstx_jagged(rows, X):
    values, lengths = ops.firstx_jagged(*to_jagged(rows), X)
    assert lengths.tolist() == [min(len(r), X) for r in rows]
    assert values.tolist() == [v for r in rows for v in r[:X]]


@FAST
@given(rows=jagged_rows, n=st.integers(1, 9))
def test_ngram_jagged(rows, n):
    values, lengths = ops.ngram_jagged(*to_jagged(rows), n)
    expected = [ref.ngram_ref(np.array(r, dtype=np.int64), n) for r in rows]
    assert lengths.tolist() == [len(e) for e in expected]
    assert values.tolist() == [int(v) for e in expected for v in e]


@FAST
@given(rows=jagged_rows, salt=st.sampled_from([0, -5, INT64_MAX]), M=st.sampled_from([1, 3, 65536, 10131227]))
def test_elementwise_ops_on_list_values(rows, salt, M):
    values, _ = to_jagged(rows)
    expected = [sigrid_hash_ref(int(v), salt, M) for r in rows for v in r]
    assert ops.sigrid_hash(values, salt, M).tolist() == expected
    assert ops.clamp(values, -3, 7).tolist() == [min(max(v, -3), 7) for r in rows for v in r]
