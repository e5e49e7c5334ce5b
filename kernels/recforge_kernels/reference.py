"""Pure-Python-int oracle for sigrid_hash (TorchArrow/Velox semantics), explicit 64-bit masking.

Definitions checked against the sources (not memory):
  * folly/hash/Hash.h (facebook/folly): `twang_mix64(uint64_t)`, `hash_128_to_64(upper, lower)` and
    `hash_combine(t, ts...) = hash_combine_generic(StdHasher{}, t, ts...)`, which returns
    `hash_128_to_64(h(t), hash_combine_generic(h, ts...))`: the FIRST argument is `upper`. StdHasher is
    std::hash, the identity on 64-bit integers in libstdc++.
  * torcharrow csrc/velox/functions/rec/sigrid_hash.h (pytorch/torcharrow): `computeSigridHash` returns 0 when
    maxValue == 1, else `hashed = hash_combine(salt, twang_mix64(input))` as int64_t, i.e.
    upper = salt, lower = twang_mix64(x); then a multiply-shift signed division with precision 63 whose
    quotient rounds towards negative infinity, so the result is `hashed` floor-mod maxValue in [0, maxValue).
    `velox_floor_mod` below replays that multiply-shift so tests can check it equals Python's `%`.
  * torcharrow csrc/velox/functions/rec/tests/SigridHashTest.cpp: x = 1..16, salt 0, maxValue 100 ->
    60 54 54 9 4 91 11 67 79 2 25 92 98 83 66 2 (reproduced by this oracle; see the kernel tests).
"""
from __future__ import annotations

import math

MASK64 = (1 << 64) - 1
KMUL = 0x9DDFEA08EB382D69
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def to_unsigned64(x: int) -> int:
    return x & MASK64


def to_signed64(u: int) -> int:
    u &= MASK64
    return u - (1 << 64) if u >> 63 else u


def twang_mix64_ref(key: int) -> int:
    """folly::hash::twang_mix64 on an unsigned 64-bit value (given as any Python int, taken mod 2**64)."""
    key &= MASK64
    key = (~key + (key << 21)) & MASK64
    key ^= key >> 24
    key = (key + (key << 3) + (key << 8)) & MASK64
    key ^= key >> 14
    key = (key + (key << 2) + (key << 4)) & MASK64
    key ^= key >> 28
    key = (key + (key << 31)) & MASK64
    return key


def hash_128_to_64_ref(upper: int, lower: int) -> int:
    """folly::hash::hash_128_to_64(upper, lower) (CityHash's Hash128to64), unsigned 64-bit result."""
    upper &= MASK64
    lower &= MASK64
    a = ((lower ^ upper) * KMUL) & MASK64
    a ^= a >> 47
    b = ((upper ^ a) * KMUL) & MASK64
    b ^= b >> 47
    return (b * KMUL) & MASK64


def sigrid_hash_raw_ref(x: int, salt: int) -> int:
    """hash_combine(salt, twang_mix64(x)) read as a signed int64 (upper = salt, lower = twang_mix64(x))."""
    return to_signed64(hash_128_to_64_ref(salt, twang_mix64_ref(x)))


def _check_args(x: int, salt: int, M: int) -> None:
    for name, v in (("x", x), ("salt", salt), ("M", M)):
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"sigrid_hash: {name}={v} is outside int64")
    if M < 1:
        raise ValueError(f"sigrid_hash: M must be >= 1, got {M}")


def sigrid_hash_ref(x: int, salt: int, M: int) -> int:
    """TorchArrow sigrid_hash of one int64 value: 0 when M == 1, else the signed hash floor-mod M."""
    _check_args(x, salt, M)
    if M == 1:
        return 0
    return sigrid_hash_raw_ref(x, salt) % M


def velox_multiplier_and_shift(divisor: int, precision: int = 63) -> tuple[int, int]:
    """Replays torcharrow's computeMultiperAndShift (128-bit arithmetic; the multiplier is cast to uint64)."""
    n = 64
    shift = math.ceil(math.log2(divisor))
    low = (1 << (n + shift)) // divisor
    high = ((1 << (n + shift)) + (1 << (n + shift - precision))) // divisor
    while low // 2 < high // 2 and shift > 0:
        low //= 2
        high //= 2
        shift -= 1
    return high & MASK64, shift


def velox_floor_mod(hashed: int, divisor: int) -> int:
    """Replays computeSigridHash's division for divisor > 1: q = s ^ (mulhi(m, s ^ h) >> shift); h - q * M."""
    multiplier, shift = velox_multiplier_and_shift(divisor)
    sign = -1 if hashed < 0 else 0
    q = sign ^ to_signed64((multiplier * ((sign ^ hashed) & MASK64)) >> (64 + shift))
    return to_signed64(hashed - q * divisor)
