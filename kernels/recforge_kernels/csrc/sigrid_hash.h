// sigrid_hash's 64-bit mixing, bit-exact with TorchArrow/Velox (folly's twang_mix64 and Hash128to64).
// Shared by the fused preprocessing kernels (fused_cpu.cpp) and the RECom embedding op (embedding_cpu.cpp), so
// the two can never hash an id differently.
#ifndef RECFORGE_SIGRID_HASH_H
#define RECFORGE_SIGRID_HASH_H
#include <cstdint>

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
  constexpr uint64_t kMul = 0x9ddfea08eb382d69ULL;
  uint64_t a = (lower ^ upper) * kMul;
  a ^= (a >> 47);
  uint64_t b = (upper ^ a) * kMul;
  b ^= (b >> 47);
  return b * kMul;
}

#endif  // RECFORGE_SIGRID_HASH_H
