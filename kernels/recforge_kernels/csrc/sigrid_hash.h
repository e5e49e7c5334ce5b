// sigrid_hash's 64-bit mixing, bit-exact with TorchArrow/Velox (folly's twang_mix64 and Hash128to64), and its
// floor-modulo by an invariant divisor through precomputed magic numbers (no divide per value).
// Shared by the fused preprocessing kernels (fused_cpu.cpp) and the RECom embedding op (embedding_cpu.cpp), so
// the two can never hash an id differently.
#ifndef RECFORGE_SIGRID_HASH_H
#define RECFORGE_SIGRID_HASH_H
#include <cstdint>

constexpr uint64_t kHashMul = 0x9ddfea08eb382d69ULL;

inline uint64_t twang_mix64(uint64_t key) {
  key = (~key) + (key << 21);
  key = key ^ (key >> 24);
  key = key + (key << 3) + (key << 8);
  key = key ^ (key >> 14);
  key = key + (key << 2) + (key << 4);
  key = key ^ (key >> 28);
  key = key + (key << 31);
  return key;
}

inline uint64_t hash_128_to_64(uint64_t upper, uint64_t lower) {
  uint64_t a = (lower ^ upper) * kHashMul;
  a ^= (a >> 47);
  uint64_t b = (upper ^ a) * kHashMul;
  b ^= (b >> 47);
  return b * kHashMul;
}

// a mod d for 0 <= a < 2^63 and an invariant 1 <= d < 2^63 (Granlund & Montgomery 1994, as libdivide and Velox
// use them): for d not a power of two, with l = ceil(log2 d), magic = floor(2^(63+l) / d) + 1 (< 2^64) gives
// floor(a / d) = mulhi64(a, magic) >> (l - 1) exactly for every 63-bit a, since
// 2^(63+l) <= magic * d <= 2^(63+l) + d <= 2^(63+l) + 2^l. A power of two (1 included) is a mask.
struct ModMagic {
  uint64_t d;      // the divisor
  uint64_t magic;  // 0 when d is a power of two
  int shift;       // l - 1
  bool pow2;
};

inline ModMagic mod_magic(uint64_t d) {
  if ((d & (d - 1)) == 0) return {d, 0, 0, true};
  const int l = 64 - __builtin_clzll(d);  // d in (2^(l-1), 2^l)
  const unsigned __int128 one = 1;
  return {d, (uint64_t)((one << (63 + l)) / d) + 1, l - 1, false};
}

inline uint64_t mod_magic_rem(uint64_t a, const ModMagic& mm) {  // a < 2^63
  if (mm.pow2) return a & (mm.d - 1);
  const uint64_t q = (uint64_t)(((unsigned __int128)a * mm.magic) >> 64) >> mm.shift;
  return a - q * mm.d;
}

// h floor-mod d in [0, d) (Python's h % d): with s = h >> 63 (all ones when h < 0), a = h ^ s lies in [0, 2^63),
// and h mod d = s ? d - 1 - (a mod d) : a mod d = (r ^ s) + (s & d), r = a mod d.
inline int64_t floor_mod_magic(int64_t h, const ModMagic& mm) {
  const int64_t s = h >> 63;
  const int64_t r = (int64_t)mod_magic_rem((uint64_t)(h ^ s), mm);
  return (r ^ s) + (s & (int64_t)mm.d);
}

#endif  // RECFORGE_SIGRID_HASH_H
