"""recforge_cpu::chain's vector paths give the scalar bits: the int64 -> float32 fill (AVX2 mantissa trick with a
sticky bit, or AVX-512DQ's vcvtqq2ps in a native build) against an exact round-to-nearest-even reference for every
int64 (ties, near ties, 2^52 and 2^53 edges, INT64_MIN / MAX), and the tile transposes (AVX2 4 x 4 blocks of the
values, SSE2 16 x 16 blocks of the null flags, the scalar loop for the rest) against the scalar transpose and a torch
reference, across block and tile edges, null-flag patterns and float64 columns with NaN / inf / -0.0."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recforge.preprocess.executors.chain import FILL_FLOAT, FILL_ID
from recforge_kernels import cpu_ext
from recforge_kernels.reference import INT64_MAX, INT64_MIN

AUTO, SCALAR, AVX2 = 0, 1, 2  # fill_float_path's paths (I64ToF32Path in csrc/fused_cpu.cpp)
EDGES = [0, 1, -1, 2**24 - 1, 2**24 + 1, 2**24 + 3, -(2**24) - 1, 2**51 - 1, 2**51, 2**52 - 1, 2**52, 2**52 + 1,
         2**53 - 1, 2**53 + 1, -(2**53) - 1, 2**60 + 2**36, 2**60 + 2**36 + 1, 2**60 + 3 * 2**36, 2**60 + 2**37 + 2**36,
         -(2**60) - 2**36 - 1, 2**62 + 2**38 + 1, INT64_MAX - 2**39, INT64_MAX - 1, INT64_MAX, INT64_MIN,
         INT64_MIN + 1, INT64_MIN + 2**39, INT64_MIN + 2**39 - 1]


@pytest.fixture(scope="module")
def ops():
    if not cpu_ext.load():
        pytest.skip(f"C++ extension not built: {cpu_ext.status()}")
    return torch.ops.recforge_cpu


def paths() -> list[int]:
    """The paths this CPU runs (AVX2 needs the CPU's AVX2)."""
    return [AUTO, SCALAR, AVX2] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else [AUTO, SCALAR]


def f32_exact(x: int) -> float:
    """int -> float32 rounded to nearest, ties to even, from Python integers (no float64 step to round twice)."""
    a = abs(x)
    if a.bit_length() > 24:
        shift = a.bit_length() - 24
        q, r = divmod(a, 1 << shift)
        half = 1 << (shift - 1)
        q += r > half or (r == half and q & 1)
        a = q << shift
    return float(-a if x < 0 else a)  # <= 24 significant bits: exact in float64 and in float32


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()


def expected(xs: list[int], valid: list[bool], fill: float) -> list[int]:
    want = [f32_exact(x) if v else fill for x, v in zip(xs, valid, strict=True)]
    return bits(torch.tensor(want, dtype=torch.float32))


def near_ties() -> list[int]:
    """Values at, just below and just above float32 rounding ties, at every magnitude from 2^24 up."""
    out = []
    for e in range(25, 64):
        for q in (2**23, 2**23 + 1, 2**24 - 1):  # even and odd float32 mantissas
            tie = (2 * q + 1) << (e - 25)  # halfway between q and q + 1 units of 2^(e - 24)
            out += [v for v in (tie - 1, tie, tie + 1) if v <= INT64_MAX]
    return out + [-v for v in out]


@pytest.mark.parametrize("path", [AUTO, SCALAR, AVX2])
def test_int64_to_float32_edges_and_ties_round_like_a_cast(ops, path):
    if path not in paths():
        pytest.skip("this CPU has no AVX2")
    xs = EDGES + near_ties()
    for n in (len(xs), 1, 3, 4, 5, 7):  # the vector body and the scalar tail
        got = ops.fill_float_path(torch.tensor(xs[:n], dtype=torch.int64), torch.ones(n, dtype=torch.bool), 0.0, path)
        assert bits(got) == expected(xs[:n], [True] * n, 0.0)


@settings(max_examples=200, deadline=None)
@given(xs=st.lists(st.one_of(st.integers(INT64_MIN, INT64_MAX), st.integers(-(2**53), 2**53),
                             st.integers(-70, 70), st.sampled_from(EDGES)), min_size=0, max_size=23),
       seed=st.integers(0, 2**16), fill=st.sampled_from([0.0, -1.5, 3e38, float("nan"), float("-inf")]))
def test_int64_to_float32_fill_random(ops, xs, seed, fill):
    valid = (torch.rand(len(xs), generator=torch.Generator().manual_seed(seed)) < 0.7).tolist()
    x, v = torch.tensor(xs, dtype=torch.int64), torch.tensor(valid, dtype=torch.bool)
    want = expected(xs, valid, fill)
    for path in paths():
        assert bits(ops.fill_float_path(x, v, fill, path)) == want, path


def test_fill_float_path_refuses_bad_input(ops):
    x, v = torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="x must be a 1-D CPU int64 tensor"):
        ops.fill_float_path(x.float(), v, 0.0, AUTO)
    with pytest.raises(RuntimeError, match="valid must be bool with x's shape"):
        ops.fill_float_path(x, v[:3], 0.0, AUTO)
    with pytest.raises(RuntimeError, match="path must be 0"):
        ops.fill_float_path(x, v, 0.0, 3)


def fill_program(n_dense: int, n_sparse: int, order: list[int]) -> dict:
    """A chain program of fills only: feature f < n_dense fills dense column f (float, fill -f - 0.5), the rest fill
    sparse column f - n_dense (id, fill -f), run in `order` (which sets the order the tile buffers hold columns)."""
    prog: dict = {k: [] for k in ("src_kind", "src_col", "out_kind", "out_slot", "codes", "f0", "f1", "i0", "i1")}
    prog["step_offsets"] = [0]
    for f in order:
        dense = f < n_dense
        prog["src_kind"].append(0 if dense else 1)
        prog["src_col"].append(f if dense else f - n_dense)
        prog["out_kind"].append(0 if dense else 1)
        prog["out_slot"].append(f if dense else f - n_dense)
        prog["codes"].append(FILL_FLOAT if dense else FILL_ID)
        prog["f0"].append(-f - 0.5 if dense else float(-f))
        prog["f1"].append(0.0)
        prog["i0"].append(0)
        prog["i1"].append(0)
        prog["step_offsets"].append(len(prog["codes"]))
    return prog


def run_fills(ops, dense, dvalid, sparse, svalid, order):
    nd, ns = dense.shape[1], sparse.shape[1]
    p = fill_program(nd, ns, order)
    return ops.chain(dense, dvalid, sparse, svalid, p["src_kind"], p["src_col"], p["out_kind"], p["out_slot"],
                     p["step_offsets"], p["codes"], p["f0"], p["f1"], p["i0"], p["i1"], torch.zeros(0),
                     torch.zeros(0, dtype=torch.int64), nd, ns)


def flag_pattern(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    if kind == "all_valid":
        return torch.ones(shape, dtype=torch.bool)
    if kind == "all_null":
        return torch.zeros(shape, dtype=torch.bool)
    if kind == "checker":
        r, c = np.indices(shape)
        return torch.from_numpy((r + c) % 2 == 0)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.6


def raw_values(rows: int, cols: int, seed: int, f64: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(INT64_MIN, INT64_MAX, (rows, cols), dtype=torch.int64, generator=g)
    x[torch.rand(rows, cols, generator=g) < 0.5] //= 2**40  # small values too
    if not f64:
        return x
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 3.5e38, -1e-46, 1.0000001])
    out = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 1e3
    pick = torch.rand(rows, cols, generator=g) < 0.3
    out[pick] = specials[torch.randint(0, len(specials), (int(pick.sum()),), generator=g)].double()
    return out


@pytest.mark.parametrize("rows", [1, 3, 4, 15, 16, 17, 33, 127, 128, 129, 145, 256, 257, 300])
@pytest.mark.parametrize("shape", [(13, 26), (1, 3), (4, 16), (17, 33), (52, 104)])
@pytest.mark.parametrize("flags", ["random", "all_valid", "all_null", "checker"])
def test_tile_transposes_match_scalar_and_reference(ops, rows, shape, flags):
    nd, ns = shape
    for f64 in (False, True):
        dense, sparse = raw_values(rows, nd, rows + nd, f64), raw_values(rows, ns, rows + ns + 1, False)
        dvalid, svalid = flag_pattern(flags, (rows, nd), rows), flag_pattern(flags, (rows, ns), rows + 1)
        in_order = list(range(nd + ns))  # every column in order: the vector transposes
        d1, i1 = run_fills(ops, dense, dvalid, sparse, svalid, in_order)
        d2, i2 = run_fills(ops, dense, dvalid, sparse, svalid, in_order[::-1])  # columns out of order: scalar
        assert torch.equal(d1.view(torch.int32), d2.view(torch.int32)) and torch.equal(i1, i2)
        fills_d = torch.tensor([-f - 0.5 for f in range(nd)], dtype=torch.float32)
        conv = torch.from_numpy(dense.numpy().astype(np.float32))  # C casts: rounded to nearest, one rounding
        want_d = torch.where(dvalid, conv, fills_d.expand(rows, nd))
        want_i = torch.where(svalid, sparse, torch.tensor([-float(nd + j) for j in range(ns)]).long().expand(rows, ns))
        assert torch.equal(d1.view(torch.int32), want_d.view(torch.int32)), (f64, "dense")
        assert torch.equal(i1, want_i.t().reshape(-1)), (f64, "ids")


def test_flags_of_a_batch_that_ends_a_larger_buffer(ops):
    """A batch that is a row slice of a larger matrix (its flags end before the buffer does) and one that ends it:
    the 16-byte flag loads stop before the end of the batch's matrix, and the rows give the same bits either way."""
    big_d, big_s = raw_values(400, 13, 0, False), raw_values(400, 26, 1, False)
    big_dv, big_sv = flag_pattern("random", (400, 13), 2), flag_pattern("random", (400, 26), 3)
    order = list(range(39))
    whole_d, whole_i = run_fills(ops, big_d, big_dv, big_s, big_sv, order)
    for lo, hi in ((0, 150), (250, 400), (383, 400), (399, 400)):
        d, i = run_fills(ops, big_d[lo:hi], big_dv[lo:hi], big_s[lo:hi], big_sv[lo:hi], order)
        assert torch.equal(d.view(torch.int32), whole_d[lo:hi].view(torch.int32))
        assert torch.equal(i.view(26, hi - lo), whole_i.view(26, 400)[:, lo:hi])
