// Horizontally fused preprocessing kernels for CPU: one call runs one op over every feature of a fused group.
// Registered as torch ops in namespace `recforge_cpu`; recforge_kernels.fused wraps them as `recforge::fused_*`.
// Semantics are documented in recforge.preprocess.registry; every kernel is checked against the numpy oracle.
// Work is split into (feature, row chunk) pieces over ATen's intra-op pool (at::parallel_for), so
// torch.set_num_threads governs it. Loops are written to auto-vectorize (-O3 -march=native); the float64
// log / pow of logit and boxcox use Sleef's vector functions (exported by libtorch_cpu) when AVX-512 or AVX2 is on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

using at::Tensor;

namespace {

constexpr int64_t kChunk = 16384;

// Calls fn(feature, begin, end) for chunks of every feature's n[f] elements, spread over the intra-op threads.
template <typename Fn>
void for_chunks(const std::vector<int64_t>& n, const Fn& fn) {
  std::vector<std::array<int64_t, 3>> chunks;
  for (int64_t f = 0; f < (int64_t)n.size(); ++f)
    for (int64_t b = 0; b < n[f]; b += kChunk) chunks.push_back({f, b, std::min(n[f], b + kChunk)});
  at::parallel_for(0, (int64_t)chunks.size(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) fn(chunks[i][0], chunks[i][1], chunks[i][2]);
  });
}

std::vector<int64_t> numels(const std::vector<Tensor>& xs) {
  std::vector<int64_t> n;
  for (const auto& x : xs) n.push_back(x.numel());
  return n;
}

std::vector<Tensor> contiguous(at::TensorList xs, at::ScalarType dtype, const char* op) {
  std::vector<Tensor> out;
  for (const auto& x : xs) {
    TORCH_CHECK(x.scalar_type() == dtype, op, ": expected ", dtype, " inputs, got ", x.scalar_type());
    TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
    out.push_back(x.contiguous());
  }
  return out;
}

std::vector<Tensor> empty_like_all(const std::vector<Tensor>& xs, at::ScalarType dtype) {
  std::vector<Tensor> out;
  for (const auto& x : xs) out.push_back(at::empty(x.sizes(), x.options().dtype(dtype)));
  return out;
}

void check_len(size_t got, size_t want, const char* op, const char* what) {
  TORCH_CHECK(got == want, op, ": ", what, " has ", got, " entries for ", want, " features");
}

// ------------------------------------------------------------------ fill_null

// valid ? x : fill without a branch (null masks are random: a branch mispredicts) and in a form that vectorizes.
inline int64_t select_i64(bool valid, int64_t x, int64_t fill) {
  const int64_t m = -(int64_t)(uint8_t)valid;
  return (x & m) | (fill & ~m);
}

inline float select_f32(bool valid, float x, float fill) {
  uint32_t a, b;
  std::memcpy(&a, &x, 4);
  std::memcpy(&b, &fill, 4);
  const uint32_t m = -(uint32_t)(uint8_t)valid;
  const uint32_t r = (a & m) | (b & ~m);
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

// Gathers columns `cols` of the raw matrix x[B, Fin] (row-major) with nulls replaced: one [B] tensor per feature.
std::vector<Tensor> fill_null_columns(const Tensor& x_, const Tensor& valid_, at::IntArrayRef cols,
                                      at::ArrayRef<double> values, bool dense) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kLong, "fill_null_columns: x must be int64 [B, F]");
  TORCH_CHECK(valid_.sizes() == x_.sizes() && valid_.scalar_type() == at::kBool,
              "fill_null_columns: valid must be bool like x");
  check_len(values.size(), cols.size(), "fill_null_columns", "values");
  const int64_t B = x_.size(0), Fin = x_.size(1), F = (int64_t)cols.size();
  for (auto c : cols) TORCH_CHECK(c >= 0 && c < Fin, "fill_null_columns: column ", c, " outside [0, ", Fin, ")");
  std::vector<Tensor> out;
  for (int64_t f = 0; f < F; ++f) out.push_back(at::empty({B}, x_.options().dtype(dense ? at::kFloat : at::kLong)));
  std::vector<int64_t> colv(cols.begin(), cols.end());
  // Column-major input (RawBatch's layout): every column is contiguous, a plain vectorized pass per feature.
  if (B > 0 && x_.stride(0) == 1 && valid_.stride(0) == 1) {
    const int64_t* xp = x_.data_ptr<int64_t>();
    const bool* vp = valid_.data_ptr<bool>();
    const int64_t xs1 = x_.stride(1), vs1 = valid_.stride(1);
    std::vector<int64_t> n(F, B);
    for_chunks(n, [&](int64_t f, int64_t b, int64_t e) {
      const int64_t* __restrict x = xp + colv[f] * xs1;
      const bool* __restrict v = vp + colv[f] * vs1;
      if (dense) {
        float* __restrict o = out[f].data_ptr<float>();
        const float fill = (float)values[f];
        for (int64_t i = b; i < e; ++i) o[i] = select_f32(v[i], (float)x[i], fill);
      } else {
        int64_t* __restrict o = out[f].data_ptr<int64_t>();
        const int64_t fill = (int64_t)values[f];
        for (int64_t i = b; i < e; ++i) o[i] = select_i64(v[i], x[i], fill);
      }
    });
    return out;
  }
  Tensor x = x_.contiguous(), valid = valid_.contiguous();
  const int64_t* xp = x.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  // Row-major input: blocks of 32 rows; within a block, each feature's 32 values are gathered from the rows (in
  // L1/L2) and written as one run of its output. The raw matrix is read from memory once. (Measured: faster than
  // transposing the matrix first with ATen and taking the column-major path.)
  constexpr int64_t kRows = 32;
  at::parallel_for(0, (B + kRows - 1) / kRows, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kRows, r1 = std::min(B, r0 + kRows);
      for (int64_t f = 0; f < F; ++f) {
        const int64_t c = colv[f];
        if (dense) {
          float* __restrict o = (float*)out[f].data_ptr();
          const float fill = (float)values[f];
          for (int64_t r = r0; r < r1; ++r) o[r] = select_f32(vp[r * Fin + c], (float)xp[r * Fin + c], fill);
        } else {
          int64_t* __restrict o = (int64_t*)out[f].data_ptr();
          const int64_t fill = (int64_t)values[f];
          for (int64_t r = r0; r < r1; ++r) o[r] = select_i64(vp[r * Fin + c], xp[r * Fin + c], fill);
        }
      }
    }
  });
  return out;
}

// fill_null on list values (one int64 tensor per feature, any shape) with element masks.
std::vector<Tensor> fill_null(at::TensorList xs_, at::TensorList valids_, at::ArrayRef<double> values, bool dense) {
  auto xs = contiguous(xs_, at::kLong, "fill_null");
  auto valids = contiguous(valids_, at::kBool, "fill_null");
  check_len(valids.size(), xs.size(), "fill_null", "valids");
  check_len(values.size(), xs.size(), "fill_null", "values");
  auto out = empty_like_all(xs, dense ? at::kFloat : at::kLong);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const int64_t* x = xs[f].data_ptr<int64_t>();
    const bool* v = valids[f].data_ptr<bool>();
    if (dense) {
      float* o = out[f].data_ptr<float>();
      const float fill = (float)values[f];
      for (int64_t i = b; i < e; ++i) o[i] = select_f32(v[i], (float)x[i], fill);
    } else {
      int64_t* o = out[f].data_ptr<int64_t>();
      const int64_t fill = (int64_t)values[f];
      for (int64_t i = b; i < e; ++i) o[i] = select_i64(v[i], x[i], fill);
    }
  });
  return out;
}

// ------------------------------------------------------------------ cast, clamp, bucketize, mapid

std::vector<Tensor> cast(at::TensorList xs_, bool to_float) {
  std::vector<Tensor> out;
  if (to_float) {
    auto xs = contiguous(xs_, at::kLong, "cast");
    out = empty_like_all(xs, at::kFloat);
    for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
      const int64_t* x = xs[f].data_ptr<int64_t>();
      float* o = out[f].data_ptr<float>();
      for (int64_t i = b; i < e; ++i) o[i] = (float)x[i];
    });
  } else {
    auto xs = contiguous(xs_, at::kFloat, "cast");
    out = empty_like_all(xs, at::kLong);
    for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
      const float* x = xs[f].data_ptr<float>();
      int64_t* o = out[f].data_ptr<int64_t>();
      for (int64_t i = b; i < e; ++i) {
        const float v = x[i];
        // float32 holds 2^63 exactly; every float32 below it and >= -2^63 converts exactly after truncation
        o[i] = v != v ? 0
               : v >= 9223372036854775808.0f ? std::numeric_limits<int64_t>::max()
               : v < -9223372036854775808.0f ? std::numeric_limits<int64_t>::min()
                                             : (int64_t)v;
      }
    });
  }
  return out;
}

std::vector<Tensor> clamp_float(at::TensorList xs_, at::ArrayRef<double> lo, at::ArrayRef<double> hi) {
  auto xs = contiguous(xs_, at::kFloat, "clamp");
  check_len(lo.size(), xs.size(), "clamp", "lo");
  check_len(hi.size(), xs.size(), "clamp", "hi");
  auto out = empty_like_all(xs, at::kFloat);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const float* x = xs[f].data_ptr<float>();
    float* o = out[f].data_ptr<float>();
    const float l = (float)lo[f], h = (float)hi[f];
    for (int64_t i = b; i < e; ++i) {
      const float v = x[i] < l ? l : x[i];  // NaN fails both comparisons and stays NaN
      o[i] = v > h ? h : v;
    }
  });
  return out;
}

std::vector<Tensor> clamp_id(at::TensorList xs_, at::IntArrayRef lo, at::IntArrayRef hi) {
  auto xs = contiguous(xs_, at::kLong, "clamp");
  check_len(lo.size(), xs.size(), "clamp", "lo");
  check_len(hi.size(), xs.size(), "clamp", "hi");
  auto out = empty_like_all(xs, at::kLong);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const int64_t* x = xs[f].data_ptr<int64_t>();
    int64_t* o = out[f].data_ptr<int64_t>();
    const int64_t l = lo[f], h = hi[f];
    for (int64_t i = b; i < e; ++i) o[i] = std::min(std::max(x[i], l), h);
  });
  return out;
}

// borders: all features' borders (float32) back to back; offsets[f]..offsets[f+1] are feature f's.
std::vector<Tensor> bucketize(at::TensorList xs_, const Tensor& borders_, at::IntArrayRef offsets) {
  auto xs = contiguous(xs_, at::kFloat, "bucketize");
  check_len(offsets.size(), xs.size() + 1, "bucketize", "offsets");
  Tensor borders = borders_.to(at::kFloat).contiguous();
  const float* bp = borders.data_ptr<float>();
  auto out = empty_like_all(xs, at::kLong);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const float* x = xs[f].data_ptr<float>();
    int64_t* o = out[f].data_ptr<int64_t>();
    for (int64_t i = b; i < e; ++i) o[i] = 0;
    for (int64_t k = offsets[f]; k < offsets[f + 1]; ++k) {
      const float border = bp[k];
      for (int64_t i = b; i < e; ++i) o[i] += x[i] > border ? 1 : 0;  // NaN counts nothing
    }
  });
  return out;
}

std::vector<Tensor> mapid(at::TensorList xs_, const Tensor& table_, at::IntArrayRef offsets) {
  auto xs = contiguous(xs_, at::kLong, "mapid");
  check_len(offsets.size(), xs.size() + 1, "mapid", "offsets");
  Tensor table = table_.to(at::kLong).contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  auto out = empty_like_all(xs, at::kLong);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const int64_t* x = xs[f].data_ptr<int64_t>();
    int64_t* o = out[f].data_ptr<int64_t>();
    const int64_t* t = tp + offsets[f];
    const int64_t n = offsets[f + 1] - offsets[f];
    for (int64_t i = b; i < e; ++i) o[i] = (x[i] >= 0 && x[i] < n) ? t[x[i]] : 0;
  });
  return out;
}

// ------------------------------------------------------------------ sigrid_hash

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

// Signed h floor-mod d: with s = h >> 63 (all ones when negative), a = h ^ s lies in [0, 2^63) and
// h mod d = s ? d - 1 - (a mod d) : a mod d. Three loops, one per way of taking a mod d; each vectorizes.
void sigrid_hash_block(const int64_t* __restrict x, int64_t* __restrict o, int64_t n, uint64_t salt, uint64_t d) {
  const int64_t di = (int64_t)d;
  if ((d & (d - 1)) == 0) {  // a power of two, 1 included: a mask
    const int64_t mask = di - 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = (int64_t)hash_128_to_64(salt, twang_mix64((uint64_t)x[i]));
      const int64_t s = h >> 63, r = (h ^ s) & mask;
      o[i] = s ? di - 1 - r : r;
    }
  } else if (d < (1ULL << 51)) {
    // a mod d through float64 (no 64-bit vector division exists): the truncated quotient a * (1/d) is off by at
    // most 3 * 2^10 / d + 1, which leaves |r| < 2^53; the second quotient of r is exact but for rounding at an
    // integer, leaving r in (-2d, 2d) for the three corrections. Products wrap in uint64; the true values are small.
    const double inv = 1.0 / (double)d;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = (int64_t)hash_128_to_64(salt, twang_mix64((uint64_t)x[i]));
      const int64_t s = h >> 63, a = h ^ s;
      int64_t r = (int64_t)((uint64_t)a - (uint64_t)(int64_t)((double)a * inv) * d);
      r = (int64_t)((uint64_t)r - (uint64_t)(int64_t)((double)r * inv) * d);
      r += r < 0 ? di : 0;
      r += r < 0 ? di : 0;
      r -= r >= di ? di : 0;
      o[i] = s ? di - 1 - r : r;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = (int64_t)hash_128_to_64(salt, twang_mix64((uint64_t)x[i]));
      const int64_t s = h >> 63;
      const int64_t r = (int64_t)((uint64_t)(h ^ s) % d);
      o[i] = s ? di - 1 - r : r;
    }
  }
}

std::vector<Tensor> sigrid_hash(at::TensorList xs_, at::IntArrayRef salts, at::IntArrayRef moduli) {
  auto xs = contiguous(xs_, at::kLong, "sigrid_hash");
  check_len(salts.size(), xs.size(), "sigrid_hash", "salts");
  check_len(moduli.size(), xs.size(), "sigrid_hash", "moduli");
  for (auto m : moduli) TORCH_CHECK(m >= 1, "sigrid_hash: every modulus must be >= 1, got ", m);
  auto out = empty_like_all(xs, at::kLong);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    sigrid_hash_block(xs[f].data_ptr<int64_t>() + b, out[f].data_ptr<int64_t>() + b, e - b, (uint64_t)salts[f],
                      (uint64_t)moduli[f]);
  });
  return out;
}

// ------------------------------------------------------------------ logit, boxcox (float64 math)

// y[i] = float(g(double(x[i]))) where g is given as a vector body and a scalar body (for the tail).
template <typename Scalar
#if defined(__AVX512F__)
          , typename Vec
#endif
          >
void map_f64(const float* x, float* o, int64_t n, const Scalar& scalar
#if defined(__AVX512F__)
             , const Vec& vec
#endif
) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 8 <= n; i += 8) {
    __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    _mm256_storeu_ps(o + i, _mm512_cvtpd_ps(vec(v)));
  }
#endif
  for (; i < n; ++i) o[i] = (float)scalar((double)x[i]);
}

std::vector<Tensor> logit(at::TensorList xs_, at::ArrayRef<double> lo, at::ArrayRef<double> hi) {
  auto xs = contiguous(xs_, at::kFloat, "logit");
  check_len(lo.size(), xs.size(), "logit", "lo");
  check_len(hi.size(), xs.size(), "logit", "hi");
  auto out = empty_like_all(xs, at::kFloat);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const float* x = xs[f].data_ptr<float>() + b;
    float* o = out[f].data_ptr<float>() + b;
    // the clamp bounds are float32 values, so clamping the float64 value is the float32 clamp
    const double l = (double)(float)lo[f], h = (double)(float)hi[f];
    auto scalar = [l, h](double v) {
      v = v < l ? l : v;  // NaN fails both tests and stays NaN
      v = v > h ? h : v;
      return std::log(v / (1.0 - v));
    };
#if defined(__AVX512F__)
    const __m512d vl = _mm512_set1_pd(l), vh = _mm512_set1_pd(h), one = _mm512_set1_pd(1.0);
    auto vec = [vl, vh, one](__m512d v) {
      v = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, vl, _CMP_LT_OQ), v, vl);
      v = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, vh, _CMP_GT_OQ), v, vh);
      return Sleef_logd8_u10(_mm512_div_pd(v, _mm512_sub_pd(one, v)));
    };
    map_f64(x, o, e - b, scalar, vec);
#else
    map_f64(x, o, e - b, scalar);
#endif
  });
  return out;
}

std::vector<Tensor> boxcox(at::TensorList xs_, at::ArrayRef<double> lambdas) {
  auto xs = contiguous(xs_, at::kFloat, "boxcox");
  check_len(lambdas.size(), xs.size(), "boxcox", "lambdas");
  auto out = empty_like_all(xs, at::kFloat);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const float* x = xs[f].data_ptr<float>() + b;
    float* o = out[f].data_ptr<float>() + b;
    const double lam = (double)(float)lambdas[f];  // lambda is a float32 parameter
    auto scalar = [lam](double v) {
      if (!(v > 0)) return v;  // x <= 0 and NaN unchanged
      return lam == 0 ? std::log(v) : (std::pow(v, lam) - 1.0) / lam;
    };
#if defined(__AVX512F__)
    const __m512d vl = _mm512_set1_pd(lam), one = _mm512_set1_pd(1.0);
    auto vec = [lam, vl, one](__m512d v) {
      const __mmask8 pos = _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_GT_OQ);
      const __m512d safe = _mm512_mask_blend_pd(pos, one, v);
      // x^lam = exp(lam * ln x): in float64 the error stays ~1e-13 relative, far below float32's resolution
      const __m512d lg = Sleef_logd8_u10(safe);
      const __m512d y = lam == 0 ? lg : _mm512_div_pd(_mm512_sub_pd(Sleef_expd8_u10(_mm512_mul_pd(vl, lg)), one), vl);
      return _mm512_mask_blend_pd(pos, v, y);
    };
    map_f64(x, o, e - b, scalar, vec);
#else
    map_f64(x, o, e - b, scalar);
#endif
  });
  return out;
}

// ------------------------------------------------------------------ onehot, firstx, ngram

// x: one value per row ([B] or [B, 1], float32 or int64); out [B, K] float32: the first K = min(keep, C) of the
// C one-hot values (keep < C when no consumer reads the rest).
std::vector<Tensor> onehot(at::TensorList xs_, at::ArrayRef<double> lo, at::ArrayRef<double> hi,
                           at::IntArrayRef classes, at::IntArrayRef keep) {
  check_len(lo.size(), xs_.size(), "onehot", "lo");
  check_len(hi.size(), xs_.size(), "onehot", "hi");
  check_len(classes.size(), xs_.size(), "onehot", "classes");
  check_len(keep.size(), xs_.size(), "onehot", "keep");
  std::vector<Tensor> xs, out;
  for (const auto& x : xs_) {
    TORCH_CHECK(x.dim() == 1 || (x.dim() == 2 && x.size(1) == 1), "onehot: takes one value per row");
    xs.push_back(x.to(at::kFloat).contiguous().view({-1}));
  }
  for (size_t f = 0; f < xs.size(); ++f)
    out.push_back(at::empty({xs[f].size(0), std::min(classes[f], keep[f])}, xs[f].options()));
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const float* __restrict x = xs[f].data_ptr<float>();
    float* __restrict o = out[f].data_ptr<float>();
    const int64_t C = classes[f], K = std::min(C, keep[f]);
    const float l = (float)lo[f];
    const float step = ((float)hi[f] - l) / (float)C;
    std::vector<int32_t> idx(e - b);
    for (int64_t i = b; i < e; ++i) {  // vectorizes
      const float q = (x[i] - l) / step;
      idx[i - b] = (q >= 0.0f && q < (float)C) ? (int32_t)q : 0;  // NaN fails the test
    }
    std::memset(o + b * K, 0, (e - b) * K * sizeof(float));
    for (int64_t i = b; i < e; ++i)
      if (idx[i - b] < K) o[i * K + idx[i - b]] = 1.0f;
  });
  return out;
}

// Row-wise copies of fixed-width rows, typed so the compiler unrolls them (memcpy calls of 16 bytes cost more).
template <typename T>
void copy_windows(const T* __restrict x, T* __restrict o, int64_t rows, int64_t w, int64_t k, int64_t windows) {
  const int64_t wo = windows * k;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < windows; ++i)
      for (int64_t j = 0; j < k; ++j) o[r * wo + i * k + j] = x[r * w + i + j];
}

void copy_windows_any(const Tensor& x, Tensor& o, int64_t r0, int64_t r1, int64_t k, int64_t windows) {
  const int64_t w = x.size(1), wo = windows * k;
  const int64_t es = x.element_size();
  TORCH_CHECK(es == 4 || es == 8, "firstx/ngram: 4- or 8-byte values only");
  if (es == 4)
    copy_windows((const uint32_t*)x.data_ptr() + r0 * w, (uint32_t*)o.data_ptr() + r0 * wo, r1 - r0, w, k, windows);
  else
    copy_windows((const uint64_t*)x.data_ptr() + r0 * w, (uint64_t*)o.data_ptr() + r0 * wo, r1 - r0, w, k, windows);
}

// x [B, w] -> [B, min(X, w)]: one window of k = min(X, w) values
std::vector<Tensor> firstx(at::TensorList xs_, at::IntArrayRef X) {
  check_len(X.size(), xs_.size(), "firstx", "X");
  std::vector<Tensor> xs, out;
  std::vector<int64_t> rows;
  for (size_t f = 0; f < xs_.size(); ++f) {
    TORCH_CHECK(xs_[f].dim() == 2, "firstx: takes [B, w] tensors");
    xs.push_back(xs_[f].contiguous());
    out.push_back(at::empty({xs_[f].size(0), std::min<int64_t>(X[f], xs_[f].size(1))}, xs_[f].options()));
    rows.push_back(xs_[f].size(0));
  }
  for_chunks(rows, [&](int64_t f, int64_t b, int64_t e) {
    copy_windows_any(xs[f], out[f], b, e, std::min<int64_t>(X[f], xs[f].size(1)), 1);
  });
  return out;
}

// x [B, w] -> [B, (w - k + 1) * k], k = min(n, w)
std::vector<Tensor> ngram(at::TensorList xs_, at::IntArrayRef ns) {
  check_len(ns.size(), xs_.size(), "ngram", "n");
  std::vector<Tensor> xs, out;
  std::vector<int64_t> rows;
  for (size_t f = 0; f < xs_.size(); ++f) {
    TORCH_CHECK(xs_[f].dim() == 2, "ngram: takes [B, w] tensors");
    xs.push_back(xs_[f].contiguous());
    const int64_t w = xs_[f].size(1), k = std::min<int64_t>(ns[f], w);
    out.push_back(at::empty({xs_[f].size(0), (w - k + 1) * k}, xs_[f].options()));
    rows.push_back(xs_[f].size(0));
  }
  for_chunks(rows, [&](int64_t f, int64_t b, int64_t e) {
    const int64_t w = xs[f].size(1), k = std::min<int64_t>(ns[f], w);
    if (k > 0) copy_windows_any(xs[f], out[f], b, e, k, w - k + 1);
  });
  return out;
}

// Jagged forms: values[f] (1-D) with lengths[f] (int64 [B]); return values of every feature, then lengths.
std::vector<Tensor> jagged_rows_op(at::TensorList values_, at::TensorList lengths_, at::IntArrayRef param,
                                   bool is_ngram) {
  const char* op = is_ngram ? "ngram_jagged" : "firstx_jagged";
  check_len(lengths_.size(), values_.size(), op, "lengths");
  check_len(param.size(), values_.size(), op, is_ngram ? "n" : "X");
  const size_t F = values_.size();
  std::vector<Tensor> values, lengths, out_values(F), out_lengths(F);
  std::vector<std::vector<int64_t>> in_off(F), out_off(F);
  std::vector<int64_t> rows;
  for (size_t f = 0; f < F; ++f) {
    values.push_back(values_[f].contiguous());
    lengths.push_back(lengths_[f].to(at::kLong).contiguous());
    const int64_t B = lengths[f].numel(), p = param[f];
    const int64_t* len = lengths[f].data_ptr<int64_t>();
    out_lengths[f] = at::empty({B}, lengths[f].options());
    int64_t* ol = out_lengths[f].data_ptr<int64_t>();
    in_off[f].assign(B + 1, 0);
    out_off[f].assign(B + 1, 0);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t w = len[r], k = std::min(p, w);
      ol[r] = is_ngram ? (w - k + 1) * k : k;
      in_off[f][r + 1] = in_off[f][r] + w;
      out_off[f][r + 1] = out_off[f][r] + ol[r];
    }
    TORCH_CHECK(in_off[f][B] == values[f].numel(), op, ": lengths add up to ", in_off[f][B], " but there are ",
                values[f].numel(), " values");
    out_values[f] = at::empty({out_off[f][B]}, values[f].options());
    rows.push_back(B);
  }
  for_chunks(rows, [&](int64_t f, int64_t b, int64_t e) {
    const int64_t es = values[f].element_size(), p = param[f];
    const char* x = (const char*)values[f].data_ptr();
    char* o = (char*)out_values[f].data_ptr();
    for (int64_t r = b; r < e; ++r) {
      const int64_t s = in_off[f][r], w = in_off[f][r + 1] - s, k = std::min(p, w), d = out_off[f][r];
      if (!is_ngram) {
        std::memcpy(o + d * es, x + s * es, k * es);
      } else {
        for (int64_t i = 0; i + k <= w && k > 0; ++i) std::memcpy(o + (d + i * k) * es, x + (s + i) * es, k * es);
      }
    }
  });
  std::vector<Tensor> result(out_values);
  result.insert(result.end(), out_lengths.begin(), out_lengths.end());
  return result;
}

std::vector<Tensor> firstx_jagged(at::TensorList values, at::TensorList lengths, at::IntArrayRef X) {
  return jagged_rows_op(values, lengths, X, false);
}

std::vector<Tensor> ngram_jagged(at::TensorList values, at::TensorList lengths, at::IntArrayRef n) {
  return jagged_rows_op(values, lengths, n, true);
}

// Columns (each B values, any stride: a [B] tensor or the first column of [B, w]) -> one row-major [B, F]
// matrix, written in tiles that stay in L1.
Tensor stack_columns(at::TensorList cols) {
  TORCH_CHECK(!cols.empty(), "stack_columns: no columns");
  const int64_t B = cols[0].size(0), F = (int64_t)cols.size(), es = cols[0].element_size();
  TORCH_CHECK(es == 4 || es == 8, "stack_columns: 4- or 8-byte values only");
  std::vector<const char*> src;
  std::vector<int64_t> stride;
  for (const auto& c : cols) {
    TORCH_CHECK(c.scalar_type() == cols[0].scalar_type(), "stack_columns: columns differ in dtype");
    TORCH_CHECK(c.size(0) == B && (c.dim() == 1 || (c.dim() == 2 && c.size(1) == 1)),
                "stack_columns: every column must hold ", B, " values");
    src.push_back((const char*)c.data_ptr());
    stride.push_back(c.stride(0));
  }
  Tensor out = at::empty({B, F}, cols[0].options());
  char* o = (char*)out.data_ptr();
  constexpr int64_t kTile = 64;
  at::parallel_for(0, (B + kTile - 1) / kTile, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(B, r0 + kTile);
      for (int64_t f = 0; f < F; ++f) {
        const int64_t s = stride[f];
        if (es == 4) {
          const uint32_t* __restrict x = (const uint32_t*)src[f];
          uint32_t* __restrict y = (uint32_t*)o;
          for (int64_t r = r0; r < r1; ++r) y[r * F + f] = x[r * s];
        } else {
          const uint64_t* __restrict x = (const uint64_t*)src[f];
          uint64_t* __restrict y = (uint64_t*)o;
          for (int64_t r = r0; r < r1; ++r) y[r * F + f] = x[r * s];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(recforge_cpu, m) {
  m.def("stack_columns(Tensor[] cols) -> Tensor", &stack_columns);
  m.def("fill_null_columns(Tensor x, Tensor valid, int[] cols, float[] values, bool dense) -> Tensor[]",
        &fill_null_columns);
  m.def("fill_null(Tensor[] xs, Tensor[] valids, float[] values, bool dense) -> Tensor[]", &fill_null);
  m.def("cast(Tensor[] xs, bool to_float) -> Tensor[]", &cast);
  m.def("clamp_float(Tensor[] xs, float[] lo, float[] hi) -> Tensor[]", &clamp_float);
  m.def("clamp_id(Tensor[] xs, int[] lo, int[] hi) -> Tensor[]", &clamp_id);
  m.def("bucketize(Tensor[] xs, Tensor borders, int[] offsets) -> Tensor[]", &bucketize);
  m.def("mapid(Tensor[] xs, Tensor table, int[] offsets) -> Tensor[]", &mapid);
  m.def("sigrid_hash(Tensor[] xs, int[] salts, int[] moduli) -> Tensor[]", &sigrid_hash);
  m.def("logit(Tensor[] xs, float[] lo, float[] hi) -> Tensor[]", &logit);
  m.def("boxcox(Tensor[] xs, float[] lambdas) -> Tensor[]", &boxcox);
  m.def("onehot(Tensor[] xs, float[] lo, float[] hi, int[] classes, int[] keep) -> Tensor[]", &onehot);
  m.def("firstx(Tensor[] xs, int[] X) -> Tensor[]", &firstx);
  m.def("ngram(Tensor[] xs, int[] n) -> Tensor[]", &ngram);
  m.def("firstx_jagged(Tensor[] values, Tensor[] lengths, int[] X) -> Tensor[]", &firstx_jagged);
  m.def("ngram_jagged(Tensor[] values, Tensor[] lengths, int[] n) -> Tensor[]", &ngram_jagged);
}
