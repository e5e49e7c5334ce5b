"""The fused kernels (C++ extension and torch fallback) vs the numpy oracle, one group of features per call:
NaN, +-inf, negatives, int64 extremes, empty rows and empty inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import recforge_kernels  # noqa: F401
from recforge.preprocess.semantics import reference as ref
from recforge.preprocess.semantics.ops import logit_bounds
from recforge_kernels import cpu_ext, fused_torch
from recforge_kernels.reference import INT64_MAX, INT64_MIN, sigrid_hash_ref

FAST = settings(max_examples=40, deadline=None)
IMPLS = ["cpp", "torch"]

floats32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(0.0, 1.0, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-5, 0.99999, 16.0, float("nan"), float("inf"), float("-inf")]),
)
int64s = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.integers(-100, 100),
                   st.sampled_from([0, 1, -1, INT64_MIN, INT64_MAX, 2**32 - 1, 2**53 + 1]))


def cols(dtype, elements, max_features=4):
    return st.lists(hnp.arrays(dtype, st.integers(0, 30), elements=elements), min_size=1, max_size=max_features)


def kernel(impl: str, name: str):
    if impl == "cpp":
        if not cpu_ext.load():
            pytest.skip(f"C++ extension not built: {cpu_ext.status()}")
        return getattr(torch.ops.recforge_cpu, name)
    return getattr(fused_torch, name)


def t(xs):
    return [torch.from_numpy(np.ascontiguousarray(x)) for x in xs]


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(x=hnp.arrays(np.int64, st.tuples(st.integers(0, 70), st.integers(1, 9)), elements=int64s), data=st.data())
def test_fill_null_columns(impl, x, data):
    valid = data.draw(hnp.arrays(np.bool_, x.shape))
    cols_ = data.draw(st.lists(st.integers(0, x.shape[1] - 1), min_size=1, max_size=6))
    values = data.draw(st.lists(st.integers(-5, 5), min_size=len(cols_), max_size=len(cols_)))
    for dense in (True, False):
        out = kernel(impl, "fill_null_columns")(torch.from_numpy(x), torch.from_numpy(valid), cols_,
                                                [float(v) for v in values], dense)
        for c, v, o in zip(cols_, values, out, strict=True):
            expected = ref.fill_null_ref(x[:, c], valid[:, c], v, "dense" if dense else "sparse")
            np.testing.assert_array_equal(o.numpy(), expected)


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(x=hnp.arrays(np.float64, st.tuples(st.integers(0, 70), st.integers(1, 9)),
                    elements=st.floats(allow_nan=True, allow_infinity=True)), data=st.data())
def test_fill_null_columns_float64(impl, x, data):
    """Float dense columns arrive as a float64 matrix: rounded to float32 (overflow -> inf), nulls filled."""
    valid = data.draw(hnp.arrays(np.bool_, x.shape))
    cols_ = data.draw(st.lists(st.integers(0, x.shape[1] - 1), min_size=1, max_size=6))
    out = kernel(impl, "fill_null_columns")(torch.from_numpy(x), torch.from_numpy(valid), cols_,
                                            [0.5] * len(cols_), True)
    for c, o in zip(cols_, out, strict=True):
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(o.numpy(), ref.fill_null_ref(x[:, c], valid[:, c], 0.5, "dense"))
    lists = kernel(impl, "fill_null")([torch.from_numpy(x[:, 0].copy())], [torch.from_numpy(valid[:, 0].copy())],
                                      [2.0], True)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(lists[0].numpy(), ref.fill_null_ref(x[:, 0], valid[:, 0], 2.0, "dense"))


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.float32, floats32))
def test_log1p(impl, xs):
    out = kernel(impl, "log1p")(t(xs))
    for x, o in zip(xs, out, strict=True):
        assert o.dtype == torch.float32
        np.testing.assert_allclose(o.numpy(), ref.log1p_ref(x), rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.int64, int64s), data=st.data())
def test_fill_null_list_values(impl, xs, data):
    valids = [data.draw(hnp.arrays(np.bool_, x.shape)) for x in xs]
    out = kernel(impl, "fill_null")(t(xs), t(valids), [7.0] * len(xs), False)
    for x, v, o in zip(xs, valids, out, strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.fill_null_ref(x, v, 7, "sparse"))


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.int64, int64s), data=st.data())
def test_sigrid_hash(impl, xs, data):
    salts = data.draw(st.lists(st.sampled_from([0, 1, -7, INT64_MAX, INT64_MIN]), min_size=len(xs), max_size=len(xs)))
    moduli = data.draw(st.lists(st.one_of(
        st.sampled_from([1, 2, 3, 2047, 3073, 65536, 10131227, 2**51 - 1, 2**51 + 1, 2**62 + 3, INT64_MAX]),
        st.integers(1, INT64_MAX)), min_size=len(xs), max_size=len(xs)))
    out = kernel(impl, "sigrid_hash")(t(xs), salts, moduli)
    for x, s, m, o in zip(xs, salts, moduli, out, strict=True):
        assert o.tolist() == [sigrid_hash_ref(int(v), s, m) for v in x]


@pytest.mark.parametrize("impl", IMPLS)
def test_sigrid_hash_fixed_vectors(impl):
    # TorchArrow's SigridHashTest: x = 1..16, salt 0, maxValue 100
    out = kernel(impl, "sigrid_hash")([torch.arange(1, 17)], [0], [100])[0]
    assert out.tolist() == [60, 54, 54, 9, 4, 91, 11, 67, 79, 2, 25, 92, 98, 83, 66, 2]


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.float32, floats32), eps=st.sampled_from([1e-5, 1e-3, 0.25]))
def test_logit(impl, xs, eps):
    lo, hi = logit_bounds(eps)
    out = kernel(impl, "logit")(t(xs), [lo] * len(xs), [hi] * len(xs))
    for x, o in zip(xs, out, strict=True):
        np.testing.assert_allclose(o.numpy(), ref.logit_ref(x, eps), rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.float32, floats32), lam=st.sampled_from([0.0, 1e-5, 0.5, -1.0, 2.0, 3.0]))
def test_boxcox(impl, xs, lam):
    out = kernel(impl, "boxcox")(t(xs), [lam] * len(xs))
    for x, o in zip(xs, out, strict=True):
        np.testing.assert_allclose(o.numpy(), ref.boxcox_ref(x, lam), rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.float32, floats32), data=st.data())
def test_clamp_cast_bucketize(impl, xs, data):
    out = kernel(impl, "clamp_float")(t(xs), [-1.5] * len(xs), [0.75] * len(xs))
    for x, o in zip(xs, out, strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.clamp_ref(x, -1.5, 0.75))
    for x, o in zip(xs, kernel(impl, "cast")(t(xs), False), strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.cast_ref(x, "id"))
    borders = [data.draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=5, unique=True).map(sorted))
               for _ in xs]
    flat = torch.tensor([b for bs in borders for b in bs], dtype=torch.float32)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in borders])]).tolist()
    for x, b, o in zip(xs, borders, kernel(impl, "bucketize")(t(xs), flat, offsets), strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.bucketize_ref(x, b))


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.int64, int64s), data=st.data())
def test_clamp_id_mapid_cast_float(impl, xs, data):
    out = kernel(impl, "clamp_id")(t(xs), [-3] * len(xs), [INT64_MAX] * len(xs))
    for x, o in zip(xs, out, strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.clamp_ref(x, -3, INT64_MAX))
    tables = [data.draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=6)) for _ in xs]
    flat = torch.tensor([v for tb in tables for v in tb], dtype=torch.int64)
    offsets = np.concatenate([[0], np.cumsum([len(tb) for tb in tables])]).tolist()
    for x, tb, o in zip(xs, tables, kernel(impl, "mapid")(t(xs), flat, offsets), strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.mapid_ref(x, tb))
    for x, o in zip(xs, kernel(impl, "cast")(t(xs), True), strict=True):
        np.testing.assert_array_equal(o.numpy(), ref.cast_ref(x, "float"))


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(xs=cols(np.float32, floats32), C=st.integers(1, 9), lo=st.floats(-10, 10, width=32))
def test_onehot(impl, xs, C, lo):
    hi = float(np.float32(lo + 16))
    keep = [C, 1, max(1, C - 2), C + 3][:len(xs)] + [C] * max(0, len(xs) - 4)  # the first columns only
    out = kernel(impl, "onehot")([torch.from_numpy(x).unsqueeze(1) for x in xs], [lo] * len(xs), [hi] * len(xs),
                                 [C] * len(xs), keep)
    for x, o, k in zip(xs, out, keep, strict=True):
        assert o.shape == (len(x), min(C, k))
        for i in range(len(x)):
            np.testing.assert_array_equal(o[i].numpy(), ref.onehot_ref(x[i:i + 1], lo, hi, C)[:k])


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(x=hnp.arrays(np.int64, st.tuples(st.integers(0, 20), st.integers(1, 9)), elements=int64s),
       n=st.integers(1, 11), X=st.integers(1, 11))
def test_firstx_ngram_fixed(impl, x, n, X):
    for arr in (x, x.astype(np.float32)):
        got = kernel(impl, "ngram")([torch.from_numpy(arr)], [n])[0]
        for row, e in zip(got.numpy(), arr, strict=True):
            np.testing.assert_array_equal(row, ref.ngram_ref(e, n))
        got = kernel(impl, "firstx")([torch.from_numpy(arr)], [X])[0]
        np.testing.assert_array_equal(got.numpy(), arr[:, :X])


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(rows=st.lists(st.lists(int64s, max_size=7), max_size=12), n=st.integers(1, 9), X=st.integers(1, 9))
def test_firstx_ngram_jagged(impl, rows, n, X):
    values = torch.tensor([v for r in rows for v in r], dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    v, ln = kernel(impl, "ngram_jagged")([values], [lengths], [n])
    expected = [ref.ngram_ref(np.array(r, dtype=np.int64), n) for r in rows]
    assert ln.tolist() == [len(e) for e in expected] and v.tolist() == [int(a) for e in expected for a in e]
    v, ln = kernel(impl, "firstx_jagged")([values], [lengths], [X])
    assert ln.tolist() == [min(len(r), X) for r in rows] and v.tolist() == [a for r in rows for a in r[:X]]


def test_kernel_errors_name_the_problem():
    if not cpu_ext.load():
        pytest.skip("C++ extension not built")
    with pytest.raises(RuntimeError, match="modulus must be >= 1"):
        torch.ops.recforge_cpu.sigrid_hash([torch.arange(3)], [0], [0])
    with pytest.raises(RuntimeError, match="moduli has 2 entries for 1 features"):
        torch.ops.recforge_cpu.sigrid_hash([torch.arange(3)], [0], [5, 6])
    with pytest.raises(RuntimeError, match="lengths add up to 4 but there are 3 values"):
        torch.ops.recforge_cpu.firstx_jagged([torch.arange(3)], [torch.tensor([4])], [1])


def test_stack_columns_and_registered_ops_trace():
    cols_ = [torch.rand(37) for _ in range(5)]
    assert torch.equal(torch.ops.recforge.stack_columns(cols_), torch.stack(cols_, 1))

    def f(x, y):
        a, b = torch.ops.recforge.fused_sigrid_hash([x, y], [0, 3], [100, 7])
        c, = torch.ops.recforge.fused_onehot([a.to(torch.float32).unsqueeze(1)], [0.0], [100.0], [4], [4])
        return a + b, c

    x, y = torch.arange(20), torch.arange(20) * 3
    gm = torch.export.export(_Wrap(f), (x, y))
    names = {str(n.target) for n in gm.graph.nodes}
    assert "recforge.fused_sigrid_hash.default" in names and "recforge.fused_onehot.default" in names
    got, want = gm.module()(x, y), f(x, y)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)
