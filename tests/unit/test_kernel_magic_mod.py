"""The C++ kernels' floor-modulo by invariant-divisor magic numbers (csrc/sigrid_hash.h, `recforge_cpu::floor_mod`)
equals Python's `%` at the edges and on random (h, d); the hardware-divide and float64 forms the limit benchmark
compares it with agree too, and the hashed kernels (AVX2 body and scalar tail) reduce with it bit for bit."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recforge_kernels import cpu_ext
from recforge_kernels.reference import INT64_MAX, INT64_MIN, sigrid_hash_ref

MAGIC, DIVIDE, FLOAT64 = 0, 1, 2
EDGE_H = [INT64_MIN, INT64_MIN + 1, -(2**62), -(2**32) - 1, -(2**31), -2, -1, 0, 1, 2, 2**31 - 1, 2**32 + 1, 2**53 + 1,
          2**62, INT64_MAX - 1, INT64_MAX]
EDGE_D = [1, 2, 3, 4, 5, 7, 8, 1024, 1460, 10131227, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1,
          2**40 + 5, 2**51 - 1, 2**52 + 1, 2**62 - 1, 2**62, 2**62 + 1, 2**63 - 25, INT64_MAX]


@pytest.fixture(scope="module")
def ops():
    if not cpu_ext.load():
        pytest.skip(f"C++ extension not built: {cpu_ext.status()}")
    return torch.ops.recforge_cpu


def floor_mod(ops, hs: list[int], d: int, method: int = MAGIC) -> list[int]:
    return ops.floor_mod(torch.tensor(hs, dtype=torch.int64), d, method).tolist()


@pytest.mark.parametrize("d", EDGE_D)
def test_magic_floor_mod_edges(ops, d):
    assert floor_mod(ops, EDGE_H, d) == [h % d for h in EDGE_H]
    assert floor_mod(ops, EDGE_H, d, DIVIDE) == [h % d for h in EDGE_H]
    if d < 2**51:  # the float64 form's stated range
        assert floor_mod(ops, EDGE_H, d, FLOAT64) == [h % d for h in EDGE_H]


@settings(max_examples=300, deadline=None)
@given(h=st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=8),
       d=st.one_of(st.integers(1, 2**12), st.integers(1, 2**32 + 2), st.integers(1, INT64_MAX),
                   st.integers(0, 62).map(lambda k: 2**k), st.integers(1, 62).map(lambda k: 2**k + 1)))
def test_magic_floor_mod_random(ops, h, d):
    assert floor_mod(ops, h, d) == [v % d for v in h]


def test_bad_modulus_and_method_are_refused(ops):
    h = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="modulus must be >= 1"):
        ops.floor_mod(h, 0, MAGIC)
    with pytest.raises(RuntimeError, match="needs d < 2"):
        ops.floor_mod(h, 2**52, FLOAT64)
    with pytest.raises(RuntimeError, match="method must be"):
        ops.floor_mod(h, 3, 7)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 11), salt=st.integers(INT64_MIN, INT64_MAX),
       d=st.one_of(st.sampled_from(EDGE_D), st.integers(1, INT64_MAX)), seed=st.integers(0, 2**16))
def test_hash_kernel_vector_body_and_tail_reduce_alike(ops, n, salt, d, seed):
    # n from 0 to 11: lengths with and without a 4-value AVX2 body and a scalar tail
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(INT64_MIN, INT64_MAX, (n,), dtype=torch.int64, generator=g)
    if n:
        x[0] = INT64_MIN
    got = ops.sigrid_hash([x], [salt], [d])[0].tolist()
    assert got == [sigrid_hash_ref(v, salt, d) for v in x.tolist()]


def test_limit_loops_run_every_kind(ops):
    x = torch.arange(64, dtype=torch.int64)
    o = torch.empty_like(x)
    for kind in range(6):
        assert ops.limit_loop(x, x, o, kind, 1460, 2) >= 0.0
    ops.limit_loop(x, x, o, 2, 1460, 1)
    assert o.tolist() == [sigrid_hash_ref(v, 0, 1460) for v in range(64)]
    ops.limit_loop(x, x, o, 1, 1, 1)
    assert o.tolist() == [4 * v for v in range(64)]
    with pytest.raises(RuntimeError, match="unknown kind"):
        ops.limit_loop(x, x, o, 9, 3, 1)
