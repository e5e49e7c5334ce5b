"""`recforge::sigrid_hash` and `recforge::sigrid_hash_multi`: TorchArrow/Velox sigrid_hash as torch custom ops.

h = folly::hash::hash_128_to_64(upper = salt, lower = twang_mix64(x)) read as signed int64 (this is
folly::hash::hash_combine(salt, twang_mix64(x)): hash_combine passes its first argument, the salt, as
`upper`); y = h floor-mod M in [0, M), and y = 0 when M == 1. See `recforge_kernels.reference` for where
the definitions were checked and for the pure-Python oracle.

The implementation is vectorized int64 torch arithmetic, so it runs on any device torch does: additions and
multiplications wrap around modulo 2**64 (two's complement), left shifts drop the high bits, and the
unsigned (logical) right shifts of the C++ code are emulated on signed int64 by masking off the sign bits an
arithmetic shift copies in. A device-specific kernel (e.g. Triton on CUDA) can be added later with
`register_kernel` without changing callers.
"""
from __future__ import annotations

import torch
from torch import Tensor

from recforge_kernels.reference import INT64_MAX, INT64_MIN, KMUL, to_signed64

_KMUL_S = to_signed64(KMUL)  # kMul as a signed int64 constant: same bits, so the wrapped product is the same


def _lsr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits by 0 < k < 64."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def twang_mix64(key: Tensor) -> Tensor:
    """folly::hash::twang_mix64 on the bits of an int64 tensor."""
    key = (~key) + (key << 21)
    key = key ^ _lsr(key, 24)
    key = key + (key << 3) + (key << 8)
    key = key ^ _lsr(key, 14)
    key = key + (key << 2) + (key << 4)
    key = key ^ _lsr(key, 28)
    return key + (key << 31)


def hash_128_to_64(upper: int, lower: Tensor) -> Tensor:
    """folly::hash::hash_128_to_64(upper, lower) with a scalar `upper` (signed int64 bits)."""
    a = (lower ^ upper) * _KMUL_S
    a = a ^ _lsr(a, 47)
    b = (a ^ upper) * _KMUL_S
    b = b ^ _lsr(b, 47)
    return b * _KMUL_S


def sigrid_hash_raw(x: Tensor, salt: int) -> Tensor:
    """The signed 64-bit hash before the modulus: hash_combine(salt, twang_mix64(x))."""
    return hash_128_to_64(salt, twang_mix64(x))


def _check_x(x: Tensor, op: str) -> None:
    if x.dtype != torch.int64:
        raise TypeError(f"{op}: x must be an int64 tensor, got {x.dtype}")


def _check_salt(salt: int, op: str) -> None:
    if not INT64_MIN <= salt <= INT64_MAX:
        raise ValueError(f"{op}: salt={salt} is outside int64")


@torch.library.custom_op("recforge::sigrid_hash", mutates_args=())
def sigrid_hash(x: Tensor, salt: int, M: int) -> Tensor:
    """sigrid_hash of every element of int64 `x` with one modulus M >= 1; same shape, int64 in [0, M)."""
    _check_x(x, "sigrid_hash")
    _check_salt(salt, "sigrid_hash")
    if M < 1:
        raise ValueError(f"sigrid_hash: M must be >= 1, got {M}")
    if M == 1:
        return torch.zeros_like(x)
    # torch.remainder on integers is a floor-mod (the result takes the divisor's sign): [0, M) for M > 0.
    return torch.remainder(sigrid_hash_raw(x, salt), M)


@sigrid_hash.register_fake
def _sigrid_hash_fake(x: Tensor, salt: int, M: int) -> Tensor:
    _check_x(x, "sigrid_hash")
    return torch.empty_like(x)


@torch.library.custom_op("recforge::sigrid_hash_multi", mutates_args=())
def sigrid_hash_multi(x: Tensor, salt: int, M: Tensor) -> Tensor:
    """sigrid_hash of int64 x[B, F] with per-column moduli M: int64[F] (all >= 1); y[:, j] in [0, M[j])."""
    _check_x(x, "sigrid_hash_multi")
    _check_salt(salt, "sigrid_hash_multi")
    if x.dim() != 2 or M.dim() != 1 or M.shape[0] != x.shape[1] or M.dtype != torch.int64:
        raise ValueError(
            f"sigrid_hash_multi: needs x[B, F] and int64 M[F], got x{list(x.shape)} and M{list(M.shape)} {M.dtype}"
        )
    if M.numel() and bool((M < 1).any()):
        raise ValueError(f"sigrid_hash_multi: every modulus must be >= 1, got {M.tolist()}")
    # M == 1 gives 0 through the floor-mod itself, as Velox's special case does.
    return torch.remainder(sigrid_hash_raw(x, salt), M.to(x.device))


@sigrid_hash_multi.register_fake
def _sigrid_hash_multi_fake(x: Tensor, salt: int, M: Tensor) -> Tensor:
    _check_x(x, "sigrid_hash_multi")
    torch._check(x.dim() == 2, lambda: "sigrid_hash_multi: x must be [B, F]")
    torch._check(M.dim() == 1 and M.shape[0] == x.shape[1], lambda: "sigrid_hash_multi: M must be [F]")
    return torch.empty_like(x)
