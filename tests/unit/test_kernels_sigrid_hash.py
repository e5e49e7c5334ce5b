"""recforge::sigrid_hash custom ops vs the pure-Python-int oracle and fixed vectors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recforge_kernels
from recforge_kernels.reference import (
    INT64_MAX,
    INT64_MIN,
    hash_128_to_64_ref,
    sigrid_hash_ref,
    twang_mix64_ref,
    velox_floor_mod,
)

# (x, salt, M) -> y, computed once from recforge_kernels.reference.sigrid_hash_ref and frozen here.
FIXED_VECTORS = [
    (0, 0, 1, 0),
    (0, 0, 1460, 346),
    (0, 0x5EED, 10131227, 999382),
    (1, 0, 2, 0),
    (1, 0, 10131227, 5237522),
    (1, 0x5EED, 2**31 - 1, 962040980),
    (-1, 0, 2, 1),
    (-1, 0, 1460, 915),
    (-1, 0x5EED, 10131227, 8554688),
    (2**63 - 1, 0, 2**31 - 1, 547079183),
    (2**63 - 1, 0x5EED, 1460, 1040),
    (2**63 - 1, 0x5EED, 1, 0),
    (-(2**63), 0, 10131227, 6426487),
    (-(2**63), 0x5EED, 2, 1),
    (-(2**63), 0x5EED, 2**31 - 1, 1046621426),
    (0x68FD1E64, 0, 1460, 1141),  # Criteo-style 32-bit hex ids, parsed unsigned
    (0x68FD1E64, 0x5EED, 10131227, 8912655),
    (0x80E26C9B, 0, 2**31 - 1, 749912555),
    (0x80E26C9B, 0x5EED, 2, 0),
]

# TorchArrow's own test (csrc/velox/functions/rec/tests/SigridHashTest.cpp): x = 1..16, salt 0, maxValue 100.
TORCHARROW_EXPECTED = [60, 54, 54, 9, 4, 91, 11, 67, 79, 2, 25, 92, 98, 83, 66, 2]

EXTREMES = [0, 1, -1, 2, -2, INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1, 2**32 - 1, 2**31, -(2**31)]
int64s = st.one_of(st.sampled_from(EXTREMES), st.integers(INT64_MIN, INT64_MAX), st.integers(0, 2**32 - 1))
moduli = st.one_of(
    st.sampled_from([1, 2, 3, 1460, 10131227, 2**31 - 1, 2**32, INT64_MAX]),
    st.integers(1, 2**20),
    st.integers(1, INT64_MAX),
)


@pytest.mark.parametrize("x,salt,M,y", FIXED_VECTORS)
def test_fixed_vectors(x, salt, M, y):
    assert sigrid_hash_ref(x, salt, M) == y
    assert recforge_kernels.sigrid_hash(torch.tensor([x], dtype=torch.int64), salt, M).tolist() == [y]


def test_fixed_vectors_batched_through_the_registered_op():
    for salt in (0, 0x5EED):
        for M in (1, 2, 1460, 10131227, 2**31 - 1):
            cases = [(x, y) for x, s, m, y in FIXED_VECTORS if s == salt and m == M]
            if cases:
                xs = torch.tensor([x for x, _ in cases], dtype=torch.int64)
                assert torch.ops.recforge.sigrid_hash(xs, salt, M).tolist() == [y for _, y in cases]


def test_matches_torcharrow_upstream_vectors():
    x = torch.arange(1, 17, dtype=torch.int64)
    assert recforge_kernels.sigrid_hash(x, 0, 100).tolist() == TORCHARROW_EXPECTED
    assert [sigrid_hash_ref(v, 0, 100) for v in range(1, 17)] == TORCHARROW_EXPECTED


def test_oracle_building_blocks_follow_folly():
    # hash_128_to_64 is not symmetric: swapping upper/lower changes the result (salt must be `upper`).
    assert hash_128_to_64_ref(5, 7) != hash_128_to_64_ref(7, 5)
    assert twang_mix64_ref(0) == twang_mix64_ref(2**64)  # works mod 2**64
    assert 0 <= twang_mix64_ref(-1) < 2**64


@settings(max_examples=60, deadline=None)
@given(xs=st.lists(int64s, min_size=0, max_size=40), salt=int64s, M=moduli)
def test_op_equals_oracle(xs, salt, M):
    got = recforge_kernels.sigrid_hash(torch.tensor(xs, dtype=torch.int64), salt, M)
    assert got.dtype == torch.int64
    assert got.tolist() == [sigrid_hash_ref(x, salt, M) for x in xs]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.lists(int64s, min_size=3, max_size=3), min_size=0, max_size=12),
    salt=int64s,
    ms=st.lists(moduli, min_size=3, max_size=3),
)
def test_multi_equals_oracle_per_column(rows, salt, ms):
    x = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    got = recforge_kernels.sigrid_hash_multi(x, salt, torch.tensor(ms, dtype=torch.int64))
    assert got.shape == x.shape
    assert got.tolist() == [[sigrid_hash_ref(v, salt, m) for v, m in zip(r, ms, strict=True)] for r in rows]


@settings(max_examples=200, deadline=None)
@given(h=int64s, M=st.one_of(moduli, st.integers(2, 2**40)).filter(lambda m: m > 1))
def test_velox_multiply_shift_division_is_floor_mod(h, M):
    # torcharrow's computeSigridHash divides by multiply-shift; the kernels use floor-mod: they agree.
    assert velox_floor_mod(h, M) == h % M


def test_shape_preserved_and_empty():
    x = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    assert recforge_kernels.sigrid_hash(x, 0, 1460).shape == (2, 3)
    assert recforge_kernels.sigrid_hash(torch.empty(0, dtype=torch.int64), 0, 1460).shape == (0,)
    empty = torch.empty(0, 2, dtype=torch.int64)
    assert recforge_kernels.sigrid_hash_multi(empty, 0, torch.tensor([5, 7])).shape == (0, 2)


def test_bad_arguments():
    x = torch.tensor([1, 2], dtype=torch.int64)
    with pytest.raises(ValueError, match="M must be >= 1"):
        recforge_kernels.sigrid_hash(x, 0, 0)
    with pytest.raises(TypeError, match="int64"):
        recforge_kernels.sigrid_hash(x.to(torch.int32), 0, 10)
    with pytest.raises(ValueError, match="every modulus"):
        recforge_kernels.sigrid_hash_multi(x.view(1, 2), 0, torch.tensor([3, 0]))
    with pytest.raises(ValueError, match=r"M\[F\]"):
        recforge_kernels.sigrid_hash_multi(x.view(1, 2), 0, torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="M must be >= 1"):
        sigrid_hash_ref(1, 0, 0)


def test_opcheck_schema_and_fake_kernels():
    x = torch.tensor([[0, -1, 2**40], [INT64_MAX, INT64_MIN, 7]], dtype=torch.int64)
    torch.library.opcheck(torch.ops.recforge.sigrid_hash.default, (x, 3, 1460))
    torch.library.opcheck(torch.ops.recforge.sigrid_hash_multi.default, (x, 3, torch.tensor([1, 1460, 2**31 - 1])))


def test_exports_with_dynamic_batch():
    class M(torch.nn.Module):
        def forward(self, x):
            return recforge_kernels.sigrid_hash(x, 7, 1000)

    batch = torch.export.Dim("batch")
    ep = torch.export.export(M(), (torch.arange(6, dtype=torch.int64).view(3, 2),), dynamic_shapes=({0: batch},))
    assert any("recforge.sigrid_hash" in str(n.target) for n in ep.graph.nodes)
    y = torch.arange(10, dtype=torch.int64).view(5, 2)
    assert torch.equal(ep.module()(y), recforge_kernels.sigrid_hash(y, 7, 1000))
