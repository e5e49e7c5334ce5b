// Horizontally fused preprocessing kernels for CPU: one call runs one op over every feature of a fused group.
// Registered as torch ops in namespace `recforge_cpu`; recforge_kernels.fused wraps them as `recforge::fused_*`.
// Semantics are documented in recforge.preprocess.semantics.registry; every kernel is checked against the numpy oracle.
// Work is split into (feature, row chunk) pieces over ATen's intra-op pool (at::parallel_for), so
// torch.set_num_threads governs it. Loops are written to auto-vectorize (-O3 -march=native); the float64
// log / pow of logit and boxcox use Sleef's vector functions (exported by libtorch_cpu) when AVX-512 or AVX2 is on.
// Each op's per-value loop is one function (*_run), shared by its grouped kernel and by `chain`, the single-pass form
// that runs every feature's whole chain per row tile (so both give the same bits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <sleef.h>
#endif

using at::Tensor;

// Hand-written AVX2 loops are compiled through a target attribute and chosen at run time (cpu_has_avx2), so the
// extension builds and runs on any x86-64 (a portable -march keeps them); every one has a scalar form.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RECFORGE_AVX2_DISPATCH 1
#define RECFORGE_AVX2 __attribute__((target("avx2")))
#endif

namespace {

#ifdef RECFORGE_AVX2_DISPATCH
bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

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

// Calls fn(r0, r1) for tiles of `tile` rows of [0, B), spread over the intra-op threads (grain tiles at least).
template <typename Fn>
void for_row_tiles(int64_t B, int64_t tile, int64_t grain, const Fn& fn) {
  at::parallel_for(0, (B + tile - 1) / tile, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(t * tile, std::min(B, (t + 1) * tile));
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

// The shape of every elementwise kernel: In values per feature -> Out values of the same shape, where
// body(f, x, o, n) maps n values of feature f (x, o point at a chunk's first value).
template <typename In, typename Out, typename Body>
std::vector<Tensor> per_feature(at::TensorList xs_, const char* op, const Body& body) {
  auto xs = contiguous(xs_, c10::CppTypeToScalarType<In>::value, op);
  auto out = empty_like_all(xs, c10::CppTypeToScalarType<Out>::value);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    body(f, xs[f].template data_ptr<In>() + b, out[f].template data_ptr<Out>() + b, e - b);
  });
  return out;
}

// ------------------------------------------------------------------ fill_null

// valid ? x : fill without a branch (null masks are random: a branch mispredicts) and in a form that vectorizes.
// Flags are read as bytes (a torch bool is one byte, 0 or 1): GCC does not vectorize loads of `bool`.
inline int64_t select_i64(uint8_t valid, int64_t x, int64_t fill) {
  const int64_t m = -(int64_t)(valid != 0);
  return (x & m) | (fill & ~m);
}

inline float select_f32(uint8_t valid, float x, float fill) {
  uint32_t a, b;
  std::memcpy(&a, &x, 4);
  std::memcpy(&b, &fill, 4);
  const uint32_t m = -(uint32_t)(valid != 0);
  const uint32_t r = (a & m) | (b & ~m);
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

inline float select_value(uint8_t valid, int64_t x, float fill) { return select_f32(valid, (float)x, fill); }
inline float select_value(uint8_t valid, double x, float fill) { return select_f32(valid, (float)x, fill); }
inline int64_t select_value(uint8_t valid, int64_t x, int64_t fill) { return select_i64(valid, x, fill); }

// In: int64 (integer columns, ids) or double (float dense columns: rounded to float32 as a cast does).
template <typename In, typename Out>
void fill_run_plain(const In* __restrict x, const uint8_t* __restrict v, Out* __restrict o, int64_t n, Out fill) {
  for (int64_t i = 0; i < n; ++i) o[i] = select_value(v[i], x[i], fill);
}

// int64 -> float32, rounded to nearest as (float)x (cvtsi2ss) rounds, for every int64. AVX-512DQ converts 4 or 8
// int64 per instruction (vcvtqq2ps: the plain loops vectorize in a native build there); AVX2 has no such
// instruction, so this builds it: a = |x| below 2^52 is exact as the double 2^52 + a less 2^52 (the mantissa
// trick); from 2^52 up, a >> 12 with the 12 bits shifted out ORed into its lowest bit (a sticky bit: a >= 2^52
// keeps >= 41 bits, so float32's round bit lies far above it and the rounding sees the same round and sticky
// information), exact as a double times 2^12. One rounding, double -> float32 (cvtpd_ps, to nearest like
// cvtsi2ss), of a value that rounds as x does; the sign is applied before it (rounding to nearest is symmetric).
#ifdef RECFORGE_AVX2_DISPATCH
RECFORGE_AVX2 inline __m128 cvt_i64_f32_avx2(__m256i x) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i s = _mm256_cmpgt_epi64(zero, x);                  // all ones where x < 0
  const __m256i a = _mm256_sub_epi64(_mm256_xor_si256(x, s), s);  // |x| as unsigned (INT64_MIN: 2^63)
  const __m256i small = _mm256_cmpeq_epi64(_mm256_srli_epi64(a, 52), zero);
  const __m256i sticky = _mm256_andnot_si256(_mm256_cmpeq_epi64(_mm256_and_si256(a, _mm256_set1_epi64x(0xfff)), zero),
                                             _mm256_set1_epi64x(1));
  const __m256i big = _mm256_or_si256(_mm256_srli_epi64(a, 12), sticky);  // < 2^52
  const __m256i m = _mm256_blendv_epi8(big, a, small);
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
  __m256d d = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(m, _mm256_castpd_si256(two52))), two52);  // exact
  d = _mm256_mul_pd(d, _mm256_blendv_pd(_mm256_set1_pd(4096.0), _mm256_set1_pd(1.0), _mm256_castsi256_pd(small)));
  d = _mm256_xor_pd(d, _mm256_castsi256_pd(_mm256_slli_epi64(s, 63)));  // the sign (exact)
  return _mm256_cvtpd_ps(d);
}

// o = v ? float(x) : fill for 4 values per step (v null: no fill, o = float(x)); returns how many it wrote.
RECFORGE_AVX2 int64_t fill_float_i64_avx2(const int64_t* __restrict x, const uint8_t* __restrict v,
                                          float* __restrict o, int64_t n, float fill) {
  const __m128 fv = _mm_set1_ps(fill);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128 f = cvt_i64_f32_avx2(_mm256_loadu_si256((const __m256i*)(x + i)));
    if (v != nullptr) {
      int32_t flags;
      std::memcpy(&flags, v + i, 4);
      const __m128i null = _mm_cmpeq_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(flags)), _mm_setzero_si128());
      f = _mm_blendv_ps(f, fv, _mm_castsi128_ps(null));
    }
    _mm_storeu_ps(o + i, f);
  }
  return i;
}
#endif

// Which int64 -> float32 loop runs: 0 the one below chooses (what every kernel runs), 1 scalar, 2 AVX2.
enum I64ToF32Path : int64_t { I64F32_AUTO = 0, I64F32_SCALAR = 1, I64F32_AVX2 = 2 };

inline void cast_float_plain(const int64_t* __restrict x, float* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = (float)x[i];
}

// o = v ? float(x) : fill (v null: o = float(x)), by `path`.
inline void i64_to_f32(const int64_t* x, const uint8_t* v, float* o, int64_t n, float fill,
                       int64_t path = I64F32_AUTO) {
  int64_t i = 0;
#if defined(__AVX512DQ__) && defined(__AVX512VL__)
  const bool native = true;  // the plain loops vectorize with vcvtqq2ps
#else
  const bool native = false;
#endif
#ifdef RECFORGE_AVX2_DISPATCH
  if (path == I64F32_AVX2 || (path == I64F32_AUTO && !native && cpu_has_avx2()))
    i = fill_float_i64_avx2(x, v, o, n, fill);
#endif
  if (v != nullptr)
    fill_run_plain(x + i, v + i, o + i, n - i, fill);
  else
    cast_float_plain(x + i, o + i, n - i);
}

template <typename In, typename Out>
void fill_run(const In* x, const uint8_t* v, Out* o, int64_t n, Out fill) {
  fill_run_plain(x, v, o, n, fill);
}

inline void fill_run(const int64_t* x, const uint8_t* v, float* o, int64_t n, float fill) {
  i64_to_f32(x, v, o, n, fill);
}

// Row-major raw x[B, Fin]: blocks of 32 rows; within a block, each feature's 32 values are gathered from the rows
// (in L1) and written as one run of its output, so the raw matrix is read from memory once. (Measured: going row
// by row instead, every row scattering to F outputs, is ~20x slower: at B = 8192 the outputs lie 32 KiB apart and
// share cache sets.)
template <typename In, typename Out>
void fill_rows(const In* __restrict xp, const uint8_t* __restrict vp, int64_t B, int64_t Fin,
               const std::vector<int64_t>& cols, const std::vector<Out*>& outs, const std::vector<Out>& fills) {
  const int64_t F = (int64_t)cols.size();
  for_row_tiles(B, 32, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t f = 0; f < F; ++f) {
      Out* __restrict o = outs[f];
      const int64_t c = cols[f];
      const Out fill = fills[f];
      for (int64_t r = r0; r < r1; ++r) o[r] = select_value(vp[r * Fin + c], xp[r * Fin + c], fill);
    }
  });
}

template <typename In, typename Out>
std::vector<Tensor> fill_columns(const Tensor& x_, const Tensor& valid_, const std::vector<int64_t>& colv,
                                 at::ArrayRef<double> values) {
  const int64_t B = x_.size(0), F = (int64_t)colv.size();
  std::vector<Tensor> out;
  std::vector<Out*> outs;
  std::vector<Out> fills;
  for (int64_t f = 0; f < F; ++f) {
    out.push_back(at::empty({B}, x_.options().dtype(c10::CppTypeToScalarType<Out>::value)));
    outs.push_back(out.back().data_ptr<Out>());
    fills.push_back((Out)values[f]);
  }
  if (B == 0) return out;
  // Column-major input: every column is contiguous, a plain vectorized pass per feature.
  if (x_.stride(0) == 1 && valid_.stride(0) == 1) {
    const In* xp = x_.data_ptr<In>();
    const uint8_t* vp = (const uint8_t*)valid_.data_ptr<bool>();
    const int64_t xs1 = x_.stride(1), vs1 = valid_.stride(1);
    for_chunks(std::vector<int64_t>(F, B), [&](int64_t f, int64_t b, int64_t e) {
      fill_run(xp + colv[f] * xs1 + b, vp + colv[f] * vs1 + b, outs[f] + b, e - b, fills[f]);
    });
    return out;
  }
  Tensor x = x_.contiguous(), valid = valid_.contiguous();
  fill_rows(x.data_ptr<In>(), (const uint8_t*)valid.data_ptr<bool>(), B, x.size(1), colv, outs, fills);
  return out;
}

// Gathers columns `cols` of the raw matrix x[B, Fin] (row-major) with nulls replaced: one [B] tensor per feature.
// x: int64, or float64 for dense (float columns; rounded to float32).
std::vector<Tensor> fill_null_columns(const Tensor& x_, const Tensor& valid_, at::IntArrayRef cols,
                                      at::ArrayRef<double> values, bool dense) {
  const bool f64 = x_.scalar_type() == at::kDouble;
  TORCH_CHECK(x_.dim() == 2 && (x_.scalar_type() == at::kLong || (f64 && dense)),
              "fill_null_columns: x must be int64 [B, F] (or float64 for dense columns), got ", x_.scalar_type());
  TORCH_CHECK(valid_.sizes() == x_.sizes() && valid_.scalar_type() == at::kBool,
              "fill_null_columns: valid must be bool like x");
  check_len(values.size(), cols.size(), "fill_null_columns", "values");
  const int64_t Fin = x_.size(1);
  for (auto c : cols) TORCH_CHECK(c >= 0 && c < Fin, "fill_null_columns: column ", c, " outside [0, ", Fin, ")");
  std::vector<int64_t> colv(cols.begin(), cols.end());
  if (f64) return fill_columns<double, float>(x_, valid_, colv, values);
  return dense ? fill_columns<int64_t, float>(x_, valid_, colv, values)
               : fill_columns<int64_t, int64_t>(x_, valid_, colv, values);
}

// fill_null on list values (one tensor per feature, any shape) with element masks: int64 values, or float64 ones
// when dense (rounded to float32).
std::vector<Tensor> fill_null(at::TensorList xs_, at::TensorList valids_, at::ArrayRef<double> values, bool dense) {
  auto valids = contiguous(valids_, at::kBool, "fill_null");
  check_len(valids.size(), xs_.size(), "fill_null", "valids");
  check_len(values.size(), xs_.size(), "fill_null", "values");
  const bool f64 = dense && !xs_.empty() && xs_[0].scalar_type() == at::kDouble;
  auto xs = contiguous(xs_, f64 ? at::kDouble : at::kLong, "fill_null");
  for (size_t f = 0; f < xs.size(); ++f)
    TORCH_CHECK(valids[f].numel() == xs[f].numel(), "fill_null: feature ", f, " has ", xs[f].numel(),
                " values and ", valids[f].numel(), " validity flags");
  auto out = empty_like_all(xs, dense ? at::kFloat : at::kLong);
  for_chunks(numels(xs), [&](int64_t f, int64_t b, int64_t e) {
    const uint8_t* v = (const uint8_t*)valids[f].data_ptr<bool>() + b;
    if (f64) {
      fill_run(xs[f].data_ptr<double>() + b, v, out[f].data_ptr<float>() + b, e - b, (float)values[f]);
      return;
    }
    const int64_t* x = xs[f].data_ptr<int64_t>() + b;
    if (dense)
      fill_run(x, v, out[f].data_ptr<float>() + b, e - b, (float)values[f]);
    else
      fill_run(x, v, out[f].data_ptr<int64_t>() + b, e - b, (int64_t)values[f]);
  });
  return out;
}

// fill_null's int64 -> float32 loop by path (I64ToF32Path), for the tests of each path: o = valid ? float(x) : fill.
Tensor fill_float_path(const Tensor& x_, const Tensor& valid_, double fill, int64_t path) {
  TORCH_CHECK(x_.scalar_type() == at::kLong && x_.device().is_cpu() && x_.dim() == 1,
              "fill_float_path: x must be a 1-D CPU int64 tensor, got ", x_.scalar_type(), " with ", x_.dim(), " dims");
  TORCH_CHECK(valid_.scalar_type() == at::kBool && valid_.sizes() == x_.sizes(),
              "fill_float_path: valid must be bool with x's shape");
  TORCH_CHECK(0 <= path && path <= 2, "fill_float_path: path must be 0 (the kernels' choice), 1 (scalar) or 2 (AVX2), got ",
              path);
#ifdef RECFORGE_AVX2_DISPATCH
  TORCH_CHECK(path != I64F32_AVX2 || cpu_has_avx2(), "fill_float_path: this CPU has no AVX2");
#else
  TORCH_CHECK(path != I64F32_AVX2, "fill_float_path: this build has no AVX2 path");
#endif
  Tensor x = x_.contiguous(), valid = valid_.contiguous();
  Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  i64_to_f32(x.data_ptr<int64_t>(), (const uint8_t*)valid.data_ptr<bool>(), out.data_ptr<float>(), x.numel(),
             (float)fill, path);
  return out;
}

// ------------------------------------------------------------------ cast, clamp, bucketize, mapid

inline void cast_float_run(const int64_t* x, float* o, int64_t n) { i64_to_f32(x, nullptr, o, n, 0.0f); }

inline void cast_id_run(const float* __restrict x, int64_t* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    // float32 holds 2^63 exactly; every float32 below it and >= -2^63 converts exactly after truncation
    o[i] = v != v ? 0
           : v >= 9223372036854775808.0f ? std::numeric_limits<int64_t>::max()
           : v < -9223372036854775808.0f ? std::numeric_limits<int64_t>::min()
                                         : (int64_t)v;
  }
}

std::vector<Tensor> cast(at::TensorList xs_, bool to_float) {
  if (to_float)
    return per_feature<int64_t, float>(xs_, "cast", [](int64_t, const int64_t* x, float* o, int64_t n) {
      cast_float_run(x, o, n);
    });
  return per_feature<float, int64_t>(xs_, "cast", [](int64_t, const float* x, int64_t* o, int64_t n) {
    cast_id_run(x, o, n);
  });
}

inline void clamp_float_run(const float* __restrict x, float* __restrict o, int64_t n, float l, float h) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] < l ? l : x[i];  // NaN fails both comparisons and stays NaN
    o[i] = v > h ? h : v;
  }
}

std::vector<Tensor> clamp_float(at::TensorList xs, at::ArrayRef<double> lo, at::ArrayRef<double> hi) {
  check_len(lo.size(), xs.size(), "clamp", "lo");
  check_len(hi.size(), xs.size(), "clamp", "hi");
  return per_feature<float, float>(xs, "clamp", [&](int64_t f, const float* x, float* o, int64_t n) {
    clamp_float_run(x, o, n, (float)lo[f], (float)hi[f]);
  });
}

inline void clamp_id_run(const int64_t* __restrict x, int64_t* __restrict o, int64_t n, int64_t l, int64_t h) {
  for (int64_t i = 0; i < n; ++i) o[i] = std::min(std::max(x[i], l), h);
}

std::vector<Tensor> clamp_id(at::TensorList xs, at::IntArrayRef lo, at::IntArrayRef hi) {
  check_len(lo.size(), xs.size(), "clamp", "lo");
  check_len(hi.size(), xs.size(), "clamp", "hi");
  return per_feature<int64_t, int64_t>(xs, "clamp", [&](int64_t f, const int64_t* x, int64_t* o, int64_t n) {
    clamp_id_run(x, o, n, lo[f], hi[f]);
  });
}

// borders: all features' borders (float32) back to back; offsets[f]..offsets[f+1] are feature f's.
inline void bucketize_run(const float* __restrict x, int64_t* __restrict o, int64_t n, const float* borders,
                          int64_t count) {
  for (int64_t i = 0; i < n; ++i) o[i] = 0;
  for (int64_t k = 0; k < count; ++k) {
    const float border = borders[k];
    for (int64_t i = 0; i < n; ++i) o[i] += x[i] > border ? 1 : 0;  // NaN counts nothing
  }
}

std::vector<Tensor> bucketize(at::TensorList xs, const Tensor& borders_, at::IntArrayRef offsets) {
  check_len(offsets.size(), xs.size() + 1, "bucketize", "offsets");
  Tensor borders = borders_.to(at::kFloat).contiguous();
  const float* bp = borders.data_ptr<float>();
  return per_feature<float, int64_t>(xs, "bucketize", [&](int64_t f, const float* x, int64_t* o, int64_t n) {
    bucketize_run(x, o, n, bp + offsets[f], offsets[f + 1] - offsets[f]);
  });
}

inline void mapid_run(const int64_t* __restrict x, int64_t* __restrict o, int64_t n, const int64_t* table,
                      int64_t size) {
  for (int64_t i = 0; i < n; ++i) o[i] = (x[i] >= 0 && x[i] < size) ? table[x[i]] : 0;
}

std::vector<Tensor> mapid(at::TensorList xs, const Tensor& table_, at::IntArrayRef offsets) {
  check_len(offsets.size(), xs.size() + 1, "mapid", "offsets");
  Tensor table = table_.to(at::kLong).contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  return per_feature<int64_t, int64_t>(xs, "mapid", [&](int64_t f, const int64_t* x, int64_t* o, int64_t n) {
    mapid_run(x, o, n, tp + offsets[f], offsets[f + 1] - offsets[f]);
  });
}

// ------------------------------------------------------------------ sigrid_hash

#include "sigrid_hash.h"

// Signed h floor-mod d (d >= 1): with s = h >> 63 (all ones when negative), a = h ^ s lies in [0, 2^63) and
// h mod d = s ? d - 1 - (a mod d) : a mod d = (r ^ s) + (s & d), r = a mod d, without a branch.
// a mod d without a divide: ModMagic holds d's invariant-divisor magic numbers, computed once per column and call
// (sigrid_hash_magic.h); a power of two (1 included) is a mask. The AVX2 loop hashes and reduces 4 values per
// step (no 64-bit vector multiply or divide exists in AVX2: the products are built from 32x32->64 multiplies); it
// is compiled for AVX2 by a target attribute and chosen at run time, so the code builds and runs on any x86-64.

#ifdef RECFORGE_AVX2_DISPATCH

RECFORGE_AVX2 inline __m256i mullo64(__m256i a, __m256i kl, __m256i kh) {  // a * k mod 2^64; kl, kh: k's halves
  const __m256i lo = _mm256_mul_epu32(a, kl);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), kl), _mm256_mul_epu32(a, kh));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

RECFORGE_AVX2 inline __m256i mulhi64(__m256i a, __m256i ml, __m256i mh) {  // (a * m) >> 64, unsigned
  const __m256i ah = _mm256_srli_epi64(a, 32);
  const __m256i ll = _mm256_mul_epu32(a, ml), lh = _mm256_mul_epu32(a, mh);
  const __m256i hl = _mm256_mul_epu32(ah, ml), hh = _mm256_mul_epu32(ah, mh);
  const __m256i t = _mm256_add_epi64(hl, _mm256_srli_epi64(ll, 32));  // no carry out: < 2^64
  const __m256i u = _mm256_add_epi64(lh, _mm256_and_si256(t, _mm256_set1_epi64x(0xffffffffLL)));
  return _mm256_add_epi64(hh, _mm256_add_epi64(_mm256_srli_epi64(t, 32), _mm256_srli_epi64(u, 32)));
}

RECFORGE_AVX2 inline __m256i sigrid_raw_avx2(__m256i k, __m256i salt, __m256i kl, __m256i kh) {
  k = _mm256_add_epi64(_mm256_xor_si256(k, _mm256_set1_epi64x(-1)), _mm256_slli_epi64(k, 21));  // twang_mix64
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 24));
  k = _mm256_add_epi64(_mm256_add_epi64(k, _mm256_slli_epi64(k, 3)), _mm256_slli_epi64(k, 8));
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 14));
  k = _mm256_add_epi64(_mm256_add_epi64(k, _mm256_slli_epi64(k, 2)), _mm256_slli_epi64(k, 4));
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 28));
  k = _mm256_add_epi64(k, _mm256_slli_epi64(k, 31));
  __m256i a = mullo64(_mm256_xor_si256(k, salt), kl, kh);  // hash_128_to_64(salt, k)
  a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
  __m256i b = mullo64(_mm256_xor_si256(salt, a), kl, kh);
  b = _mm256_xor_si256(b, _mm256_srli_epi64(b, 47));
  return mullo64(b, kl, kh);
}

// n values; the tail (n % 4) is left to the scalar loop. Returns how many values it wrote.
RECFORGE_AVX2 int64_t sigrid_hash_avx2(const int64_t* __restrict x, int64_t* __restrict o, int64_t n, uint64_t salt,
                                       const ModMagic& mm) {
  const __m256i kl = _mm256_set1_epi64x((int64_t)(kHashMul & 0xffffffffULL));
  const __m256i kh = _mm256_set1_epi64x((int64_t)(kHashMul >> 32));
  const __m256i sv = _mm256_set1_epi64x((int64_t)salt), zero = _mm256_setzero_si256();
  const __m256i dv = _mm256_set1_epi64x((int64_t)mm.d), mask = _mm256_set1_epi64x((int64_t)(mm.d - 1));
  const __m256i ml = _mm256_set1_epi64x((int64_t)(mm.magic & 0xffffffffULL));
  const __m256i mh = _mm256_set1_epi64x((int64_t)(mm.magic >> 32));
  const __m256i dl = _mm256_set1_epi64x((int64_t)(mm.d & 0xffffffffULL));
  const __m256i dh = _mm256_set1_epi64x((int64_t)(mm.d >> 32));
  const __m128i shift = _mm_cvtsi32_si128(mm.shift);
  const bool small_d = (mm.d >> 32) == 0;  // q * d from two 32-bit multiplies
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i h = sigrid_raw_avx2(_mm256_loadu_si256((const __m256i*)(x + i)), sv, kl, kh);
    const __m256i s = _mm256_cmpgt_epi64(zero, h);
    const __m256i a = _mm256_xor_si256(h, s);
    __m256i r;
    if (mm.pow2) {
      r = _mm256_and_si256(a, mask);
    } else {
      const __m256i q = _mm256_srl_epi64(mulhi64(a, ml, mh), shift);
      const __m256i qd = small_d ? _mm256_add_epi64(_mm256_mul_epu32(q, dl),
                                                    _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(q, 32), dl), 32))
                                 : mullo64(q, dl, dh);
      r = _mm256_sub_epi64(a, qd);
    }
    _mm256_storeu_si256((__m256i*)(o + i), _mm256_add_epi64(_mm256_xor_si256(r, s), _mm256_and_si256(s, dv)));
  }
  return i;
}

#endif

// Scalar form (the tail, CPUs without AVX2): one 64x64->128 multiply per value.
inline void sigrid_hash_scalar(const int64_t* __restrict x, int64_t* __restrict o, int64_t n, uint64_t salt,
                               const ModMagic& mm) {
  for (int64_t i = 0; i < n; ++i)
    o[i] = floor_mod_magic((int64_t)hash_128_to_64(salt, twang_mix64((uint64_t)x[i])), mm);
}

void sigrid_hash_block(const int64_t* __restrict x, int64_t* __restrict o, int64_t n, uint64_t salt,
                       const ModMagic& mm) {
  int64_t i = 0;
#ifdef RECFORGE_AVX2_DISPATCH
  if (cpu_has_avx2()) i = sigrid_hash_avx2(x, o, n, salt, mm);
#endif
  sigrid_hash_scalar(x + i, o + i, n - i, salt, mm);
}

std::vector<Tensor> sigrid_hash(at::TensorList xs, at::IntArrayRef salts, at::IntArrayRef moduli) {
  check_len(salts.size(), xs.size(), "sigrid_hash", "salts");
  check_len(moduli.size(), xs.size(), "sigrid_hash", "moduli");
  for (auto m : moduli) TORCH_CHECK(m >= 1, "sigrid_hash: every modulus must be >= 1, got ", m);
  std::vector<ModMagic> mms;
  for (auto m : moduli) mms.push_back(mod_magic((uint64_t)m));
  return per_feature<int64_t, int64_t>(xs, "sigrid_hash", [&](int64_t f, const int64_t* x, int64_t* o, int64_t n) {
    sigrid_hash_block(x, o, n, (uint64_t)salts[f], mms[f]);
  });
}

// ------------------------------------------------------------------ the machine's limits (bench_kernel_limits.py)

// The floor-mod alone, three ways, for the limit benchmark and the magic-number tests: method 0 magic numbers
// (what sigrid_hash runs), 1 the hardware divide, 2 float64 reciprocal with corrections (the kernel before).
inline int64_t floor_mod_div(int64_t h, uint64_t d) {
  const int64_t s = h >> 63;
  const int64_t r = (int64_t)((uint64_t)(h ^ s) % d);
  return (r ^ s) + (s & (int64_t)d);
}

// the truncated quotient a * (1/d) is off by at most 3 * 2^10 / d + 1, leaving |r| < 2^53; the second quotient of r
// is exact but for rounding at an integer, leaving r in (-2d, 2d) for the three corrections (d < 2^51)
inline int64_t floor_mod_f64(int64_t h, uint64_t d, double inv) {
  const int64_t di = (int64_t)d;
  const int64_t s = h >> 63, a = h ^ s;
  int64_t r = (int64_t)((uint64_t)a - (uint64_t)(int64_t)((double)a * inv) * d);
  r = (int64_t)((uint64_t)r - (uint64_t)(int64_t)((double)r * inv) * d);
  r += r < 0 ? di : 0;
  r += r < 0 ? di : 0;
  r -= r >= di ? di : 0;
  return (r ^ s) + (s & di);
}

Tensor floor_mod(const Tensor& h_, int64_t d, int64_t method) {
  TORCH_CHECK(h_.scalar_type() == at::kLong && h_.device().is_cpu(), "floor_mod: h must be a CPU int64 tensor");
  TORCH_CHECK(d >= 1, "floor_mod: the modulus must be >= 1, got ", d);
  TORCH_CHECK(method != 2 || d < (1LL << 51), "floor_mod: the float64 method needs d < 2^51, got ", d);
  TORCH_CHECK(0 <= method && method <= 2, "floor_mod: method must be 0 (magic), 1 (divide) or 2 (float64)");
  Tensor h = h_.contiguous();
  Tensor out = at::empty_like(h);
  const int64_t* hp = h.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const ModMagic mm = mod_magic((uint64_t)d);
  if (method == 0)
    for (int64_t i = 0; i < h.numel(); ++i) op[i] = floor_mod_magic(hp[i], mm);
  else if (method == 1)
    for (int64_t i = 0; i < h.numel(); ++i) op[i] = floor_mod_div(hp[i], (uint64_t)d);
  else
    for (int64_t i = 0; i < h.numel(); ++i) op[i] = floor_mod_f64(hp[i], (uint64_t)d, 1.0 / (double)d);
  return out;
}

void logit_run(const float* x, float* o, int64_t n, double l, double h);  // below

// Timed loops for bench_kernel_limits.py, on one thread, `reps` times over the same buffers (no allocation inside):
// kind 0 stream copy (o = x), 1 STREAM triad on int64 (o = x + 3 * y), 2 hash + floor-mod (sigrid_hash's block),
// 3 hash + hardware divide, 4 hash + float64 floor-mod (the kernel before), 5 hash alone, 6 logit (float64 log: the
// first n float32 values of y's bytes into o's), 7 an integer clamp (the cost of a cheap step). Returns the seconds.
double limit_loop(const Tensor& x_, const Tensor& y_, Tensor& o_, int64_t kind, int64_t d, int64_t reps) {
  TORCH_CHECK(x_.is_contiguous() && y_.is_contiguous() && o_.is_contiguous() && x_.scalar_type() == at::kLong &&
              y_.scalar_type() == at::kLong && o_.scalar_type() == at::kLong && x_.numel() == o_.numel() &&
              y_.numel() == o_.numel(), "limit_loop: contiguous int64 tensors of one size");
  TORCH_CHECK(d >= 1 && (kind != 4 || d < (1LL << 51)), "limit_loop: bad modulus ", d);
  const int64_t* x = x_.data_ptr<int64_t>();
  const int64_t* y = y_.data_ptr<int64_t>();
  int64_t* o = o_.data_ptr<int64_t>();
  const int64_t n = x_.numel();
  const uint64_t ud = (uint64_t)d;
  const double inv = 1.0 / (double)d;
  const ModMagic mm = mod_magic(ud);
  constexpr int64_t kBlock = 256;  // the most rows the chain kernel hashes per tile (plan 0: 128)
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t rep = 0; rep < reps; ++rep) {
    switch (kind) {
      case 0: std::memcpy(o, x, n * sizeof(int64_t)); break;
      case 1: for (int64_t i = 0; i < n; ++i) o[i] = x[i] + 3 * y[i]; break;
      case 2:
        for (int64_t b = 0; b < n; b += kBlock) sigrid_hash_block(x + b, o + b, std::min(kBlock, n - b), 0, mm);
        break;
      case 3:
        for (int64_t i = 0; i < n; ++i) o[i] = floor_mod_div((int64_t)hash_128_to_64(0, twang_mix64((uint64_t)x[i])), ud);
        break;
      case 4:
        for (int64_t i = 0; i < n; ++i)
          o[i] = floor_mod_f64((int64_t)hash_128_to_64(0, twang_mix64((uint64_t)x[i])), ud, inv);
        break;
      case 5: for (int64_t i = 0; i < n; ++i) o[i] = (int64_t)hash_128_to_64(0, twang_mix64((uint64_t)x[i])); break;
      case 6: logit_run((const float*)y, (float*)o, n, 1e-5, 1.0 - 1e-5); break;
      case 7: clamp_id_run(x, o, n, -3, d); break;
      default: TORCH_CHECK(false, "limit_loop: unknown kind ", kind);
    }
    asm volatile("" : : "r"(o) : "memory");  // keep every repetition
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ------------------------------------------------------------------ logit, boxcox (float64 math)

// y[i] = float(g(double(x[i]))) where g is given as a vector body (8 float64 lanes with AVX-512, 4 with AVX2; Sleef's
// vector log / exp from libtorch_cpu) and a scalar body (the tail, and builds without either).
#if defined(__AVX512F__)
#define RECFORGE_VEC_F64 1
using VecD = __m512d;
inline VecD vd_set1(double v) { return _mm512_set1_pd(v); }
inline VecD vd_blend_lt(VecD v, VecD bound) { return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, bound, _CMP_LT_OQ), v, bound); }
inline VecD vd_blend_gt(VecD v, VecD bound) { return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, bound, _CMP_GT_OQ), v, bound); }
inline VecD vd_pos_select(VecD v, VecD if_pos, VecD if_not) {  // v > 0 ? if_pos : if_not (NaN: if_not)
  return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_GT_OQ), if_not, if_pos);
}
inline VecD vd_div(VecD a, VecD b) { return _mm512_div_pd(a, b); }
inline VecD vd_sub(VecD a, VecD b) { return _mm512_sub_pd(a, b); }
inline VecD vd_mul(VecD a, VecD b) { return _mm512_mul_pd(a, b); }
inline VecD vd_log(VecD v) { return Sleef_logd8_u10(v); }
inline VecD vd_log1p(VecD v) { return Sleef_log1pd8_u10(v); }
inline VecD vd_exp(VecD v) { return Sleef_expd8_u10(v); }
constexpr int kVecD = 8;
inline VecD vd_load(const float* x) { return _mm512_cvtps_pd(_mm256_loadu_ps(x)); }
inline void vd_store(float* o, VecD v) { _mm256_storeu_ps(o, _mm512_cvtpd_ps(v)); }
#elif defined(__AVX2__)
#define RECFORGE_VEC_F64 1
using VecD = __m256d;
inline VecD vd_set1(double v) { return _mm256_set1_pd(v); }
// blendv takes the second operand where the mask is set; a NaN compares false and keeps v
inline VecD vd_blend_lt(VecD v, VecD bound) { return _mm256_blendv_pd(v, bound, _mm256_cmp_pd(v, bound, _CMP_LT_OQ)); }
inline VecD vd_blend_gt(VecD v, VecD bound) { return _mm256_blendv_pd(v, bound, _mm256_cmp_pd(v, bound, _CMP_GT_OQ)); }
inline VecD vd_pos_select(VecD v, VecD if_pos, VecD if_not) {
  return _mm256_blendv_pd(if_not, if_pos, _mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_GT_OQ));
}
inline VecD vd_div(VecD a, VecD b) { return _mm256_div_pd(a, b); }
inline VecD vd_sub(VecD a, VecD b) { return _mm256_sub_pd(a, b); }
inline VecD vd_mul(VecD a, VecD b) { return _mm256_mul_pd(a, b); }
inline VecD vd_log(VecD v) { return Sleef_logd4_u10avx2(v); }
inline VecD vd_log1p(VecD v) { return Sleef_log1pd4_u10avx2(v); }
inline VecD vd_exp(VecD v) { return Sleef_expd4_u10avx2(v); }
constexpr int kVecD = 4;
inline VecD vd_load(const float* x) { return _mm256_cvtps_pd(_mm_loadu_ps(x)); }
inline void vd_store(float* o, VecD v) { _mm_storeu_ps(o, _mm256_cvtpd_ps(v)); }
#endif

template <typename Scalar
#ifdef RECFORGE_VEC_F64
          , typename Vec
#endif
          >
void map_f64(const float* x, float* o, int64_t n, const Scalar& scalar
#ifdef RECFORGE_VEC_F64
             , const Vec& vec
#endif
) {
  int64_t i = 0;
#ifdef RECFORGE_VEC_F64
  for (; i + kVecD <= n; i += kVecD) vd_store(o + i, vec(vd_load(x + i)));
#endif
  for (; i < n; ++i) o[i] = (float)scalar((double)x[i]);
}

void logit_run(const float* x, float* o, int64_t n, double l, double h) {
  auto scalar = [l, h](double v) {
    v = v < l ? l : v;  // NaN fails both tests and stays NaN
    v = v > h ? h : v;
    return std::log(v / (1.0 - v));
  };
#ifdef RECFORGE_VEC_F64
  const VecD vl = vd_set1(l), vh = vd_set1(h), one = vd_set1(1.0);
  auto vec = [vl, vh, one](VecD v) {
    v = vd_blend_gt(vd_blend_lt(v, vl), vh);
    return vd_log(vd_div(v, vd_sub(one, v)));
  };
  map_f64(x, o, n, scalar, vec);
#else
  map_f64(x, o, n, scalar);
#endif
}

std::vector<Tensor> logit(at::TensorList xs, at::ArrayRef<double> lo, at::ArrayRef<double> hi) {
  check_len(lo.size(), xs.size(), "logit", "lo");
  check_len(hi.size(), xs.size(), "logit", "hi");
  // the clamp bounds are float32 values, so clamping the float64 value is the float32 clamp
  return per_feature<float, float>(xs, "logit", [&](int64_t f, const float* x, float* o, int64_t n) {
    logit_run(x, o, n, (double)(float)lo[f], (double)(float)hi[f]);
  });
}

// log1p(max(x, 0)) in float64, rounded to float32; NaN stays NaN (counts: a negative count clamps to 0).
void log1p_run(const float* x, float* o, int64_t n) {
  auto scalar = [](double v) { return std::log1p(v < 0 ? 0.0 : v); };  // NaN fails the test and stays NaN
#ifdef RECFORGE_VEC_F64
  auto vec = [](VecD v) { return vd_log1p(vd_blend_lt(v, vd_set1(0.0))); };
  map_f64(x, o, n, scalar, vec);
#else
  map_f64(x, o, n, scalar);
#endif
}

std::vector<Tensor> log1p_kernel(at::TensorList xs) {
  return per_feature<float, float>(xs, "log1p", [](int64_t, const float* x, float* o, int64_t n) {
    log1p_run(x, o, n);
  });
}

void boxcox_run(const float* x, float* o, int64_t n, double lam) {
  auto scalar = [lam](double v) {
    if (!(v > 0)) return v;  // x <= 0 and NaN unchanged
    return lam == 0 ? std::log(v) : (std::pow(v, lam) - 1.0) / lam;
  };
#ifdef RECFORGE_VEC_F64
  const VecD vl = vd_set1(lam), one = vd_set1(1.0);
  auto vec = [lam, vl, one](VecD v) {
    const VecD safe = vd_pos_select(v, v, one);
    // x^lam = exp(lam * ln x): in float64 the error stays ~1e-13 relative, far below float32's resolution
    const VecD lg = vd_log(safe);
    const VecD y = lam == 0 ? lg : vd_div(vd_sub(vd_exp(vd_mul(vl, lg)), one), vl);
    return vd_pos_select(v, y, v);
  };
  map_f64(x, o, n, scalar, vec);
#else
  map_f64(x, o, n, scalar);
#endif
}

std::vector<Tensor> boxcox(at::TensorList xs, at::ArrayRef<double> lambdas) {
  check_len(lambdas.size(), xs.size(), "boxcox", "lambdas");
  return per_feature<float, float>(xs, "boxcox", [&](int64_t f, const float* x, float* o, int64_t n) {
    boxcox_run(x, o, n, (double)(float)lambdas[f]);  // lambda is a float32 parameter
  });
}

// ------------------------------------------------------------------ onehot, firstx, ngram

// x: one value per row ([B] or [B, 1], float32 or int64); out [B, K] float32: the first K = min(keep, C) of the
// C one-hot values (keep < C when no consumer reads the rest).
// The class of each value: trunc((x - lo) / step) in float32, 0 outside [0, C) (NaN included). Vectorizes.
inline void onehot_index(const float* __restrict x, int32_t* __restrict idx, int64_t n, float lo, float step,
                         int64_t C) {
  for (int64_t i = 0; i < n; ++i) {
    const float q = (x[i] - lo) / step;
    idx[i] = (q >= 0.0f && q < (float)C) ? (int32_t)q : 0;  // NaN fails the test
  }
}

inline float onehot_step(double lo, double hi, int64_t C) { return ((float)hi - (float)lo) / (float)C; }

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
    std::vector<int32_t> idx(e - b);
    onehot_index(x + b, idx.data(), e - b, (float)lo[f], onehot_step(lo[f], hi[f], C), C);
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

// Fixed-width rows x [B, w]: firstx keeps one window of k = min(X, w) values ([B, k]); ngram keeps every window of
// k = min(n, w) values ([B, (w - k + 1) * k]).
std::vector<Tensor> fixed_rows_op(at::TensorList xs_, at::IntArrayRef param, bool is_ngram) {
  const char* op = is_ngram ? "ngram" : "firstx";
  check_len(param.size(), xs_.size(), op, is_ngram ? "n" : "X");
  std::vector<Tensor> xs, out;
  std::vector<int64_t> rows, ks, windows;
  for (size_t f = 0; f < xs_.size(); ++f) {
    TORCH_CHECK(xs_[f].dim() == 2, op, ": takes [B, w] tensors");
    xs.push_back(xs_[f].contiguous());
    const int64_t w = xs_[f].size(1), k = std::min<int64_t>(param[f], w);
    ks.push_back(k);
    windows.push_back(is_ngram ? w - k + 1 : 1);
    out.push_back(at::empty({xs_[f].size(0), windows.back() * k}, xs_[f].options()));
    rows.push_back(xs_[f].size(0));
  }
  for_chunks(rows, [&](int64_t f, int64_t b, int64_t e) {
    if (ks[f] > 0) copy_windows_any(xs[f], out[f], b, e, ks[f], windows[f]);
  });
  return out;
}

std::vector<Tensor> firstx(at::TensorList xs, at::IntArrayRef X) { return fixed_rows_op(xs, X, false); }

std::vector<Tensor> ngram(at::TensorList xs, at::IntArrayRef n) { return fixed_rows_op(xs, n, true); }

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

// Row-major y[B, F] from F strided columns in tiles of 64 rows: each column's run is read in order and the
// tile's rows (F * 64 values) stay in L1 while they fill. (Row by row, reading F columns at once, is ~7x slower:
// the columns lie 32 KiB apart and share cache sets.)
template <typename T>
void gather_rows(const std::vector<const T*>& src, const std::vector<int64_t>& stride, T* __restrict y, int64_t B) {
  const int64_t F = (int64_t)src.size();
  for_row_tiles(B, 64, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t f = 0; f < F; ++f) {
      const T* __restrict x = src[f];
      const int64_t s = stride[f];
      for (int64_t r = r0; r < r1; ++r) y[r * F + f] = x[r * s];
    }
  });
}

template <typename T>
void gather_rows_any(at::TensorList cols, Tensor& out) {
  std::vector<const T*> src;
  std::vector<int64_t> stride;
  for (const auto& c : cols) {
    src.push_back((const T*)c.data_ptr());
    stride.push_back(c.stride(0));
  }
  gather_rows(src, stride, (T*)out.data_ptr(), out.size(0));
}

// Columns (each B values, any stride: a [B] tensor or the first column of [B, w]) -> one row-major [B, F] matrix.
Tensor stack_columns(at::TensorList cols) {
  TORCH_CHECK(!cols.empty(), "stack_columns: no columns");
  const int64_t B = cols[0].size(0), F = (int64_t)cols.size(), es = cols[0].element_size();
  TORCH_CHECK(es == 4 || es == 8, "stack_columns: 4- or 8-byte values only");
  for (const auto& c : cols) {
    TORCH_CHECK(c.scalar_type() == cols[0].scalar_type(), "stack_columns: columns differ in dtype");
    TORCH_CHECK(c.size(0) == B && (c.dim() == 1 || (c.dim() == 2 && c.size(1) == 1)),
                "stack_columns: every column must hold ", B, " values");
  }
  Tensor out = at::empty({B, F}, cols[0].options());
  if (es == 4)
    gather_rows_any<uint32_t>(cols, out);
  else
    gather_rows_any<uint64_t>(cols, out);
  return out;
}

// ------------------------------------------------------------------ chain: every feature's whole op chain in one pass

// Step codes of a chain program (recforge.preprocess.executors.chain builds them). Every step maps one value per
// row; firstx / ngram on one-value rows are identities and are dropped, and onehot followed by firstx(1) becomes
// ONEHOT_FIRST (the first of the C one-hot values). The per-value code is the grouped kernels' code.
enum ChainCode : int64_t {
  FILL_FLOAT = 0,   // raw -> float: f0 fill
  FILL_ID = 1,      // raw -> id: f0 fill (an integer)
  LOGIT = 2,        // float: f0 lo, f1 hi (float32 values)
  BOXCOX = 3,       // float: f0 lambda (a float32 value)
  CLAMP_FLOAT = 4,  // float: f0 lo, f1 hi
  CLAMP_ID = 5,     // id: i0 lo, i1 hi
  SIGRID_HASH = 6,  // id: i0 salt, i1 M
  BUCKETIZE = 7,    // float -> id: borders[i0:i1]
  MAPID = 8,        // id: table[i0:i1]
  CAST_FLOAT = 9,   // id -> float
  CAST_ID = 10,     // float -> id
  ONEHOT_FIRST = 11, // float: f0 lo, f1 hi, i0 C -> 1.0 when the class is 0, else 0.0
  LOG1P = 12        // float: log1p(max(x, 0))
};

struct ChainStep {
  int64_t code, i0, i1;
  double f0, f1;
  ModMagic mod;  // SIGRID_HASH: i1's magic numbers, computed once per call
};

struct ChainFeature {
  int64_t src;         // its raw matrix: 0 dense, 1 sparse
  int64_t tile_col;    // its column's index among the columns the tile buffers hold for that matrix
  bool f64;            // the source matrix holds float64 (float dense columns), else int64
  bool to_dense;       // output: a column of the dense matrix, else a key of the ids
  int64_t slot;
  int64_t first_step, end_step;
};

constexpr int64_t kChainRows = 256;  // the most rows per tile (the L1 step buffers' size)

// Copies bytes to dst with non-temporal (streaming) stores where dst is 16-byte aligned: the outputs are written
// once and not read again here, so they bypass the caches (no read for ownership, no eviction of the raw tiles).
// The widest stores the CPU has (a 64-byte line per store with AVX-512, 32 bytes with AVX2, else 16): a write-
// combining buffer then fills in fewer steps (measured, plan 0 at 8192 rows, cold caches: 64-byte stores 11% and
// 32-byte ones 8% faster than 16-byte ones). The caller runs _mm_sfence() before its writes are read (stream_fence).
#ifdef RECFORGE_AVX2_DISPATCH
RECFORGE_AVX2 int64_t stream_copy_avx2(char* __restrict dst, const char* __restrict src, int64_t bytes) {
  int64_t i = 0;  // dst is 16-byte aligned
  if (((uintptr_t)dst & 31) != 0 && bytes >= 16) {
    _mm_stream_si128((__m128i*)dst, _mm_loadu_si128((const __m128i*)src));
    i = 16;
  }
  for (; i + 32 <= bytes; i += 32)
    _mm256_stream_si256((__m256i*)(dst + i), _mm256_loadu_si256((const __m256i*)(src + i)));
  return i;
}
#endif

inline void stream_copy(void* dst_, const void* src_, int64_t bytes) {
  char* dst = (char*)dst_;
  const char* src = (const char*)src_;
#if defined(__x86_64__)
  const int64_t head = std::min<int64_t>(bytes, (16 - ((uintptr_t)dst & 15)) & 15);
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
#if defined(__AVX512F__)
  for (; bytes >= 16 && ((uintptr_t)dst & 63) != 0; bytes -= 16, dst += 16, src += 16)
    _mm_stream_si128((__m128i*)dst, _mm_loadu_si128((const __m128i*)src));
  for (; bytes >= 64; bytes -= 64, dst += 64, src += 64)
    _mm512_stream_si512((__m512i*)dst, _mm512_loadu_si512((const void*)src));
#elif defined(RECFORGE_AVX2_DISPATCH)
  if (cpu_has_avx2()) {
    const int64_t done = stream_copy_avx2(dst, src, bytes);
    dst += done, src += done, bytes -= done;
  }
#endif
  for (; bytes >= 16; bytes -= 16, dst += 16, src += 16)
    _mm_stream_si128((__m128i*)dst, _mm_loadu_si128((const __m128i*)src));
#endif
  std::memcpy(dst, src, bytes);
}

inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Rows [r0, n) of a row-major matrix (row stride C values) to a column-major tile: t[j * T + r] = x[r * C + cols[j]]
// for the m columns the plan reads (all of them in order when cols is null). The raw rows are read once, in order
// (what the hardware prefetchers follow), and every feature then reads its column's run contiguously from L1.
template <int64_t T, typename V>
void transpose_tile(const V* __restrict x, const int64_t C, const int64_t* __restrict cols, const int64_t m,
                    const int64_t r0, const int64_t n, V* __restrict t) {
  if (cols == nullptr) {
    for (int64_t r = r0; r < n; ++r) {
      const V* __restrict row = x + r * C;
      for (int64_t j = 0; j < m; ++j) t[j * T + r] = row[j];
    }
  } else {
    for (int64_t r = r0; r < n; ++r) {
      const V* __restrict row = x + r * C;
      for (int64_t j = 0; j < m; ++j) t[j * T + r] = row[cols[j]];
    }
  }
}

// The same with every column in order (cols null, m = C), in blocks: the values (8 bytes) in 4 x 4 blocks of AVX2
// registers (4 loads of 4 values, 4 unpacks, 4 lane permutes, 4 stores of a column's 4 rows; the last m % 4 columns
// by scalar copies), the flags (1 byte) in 16 x 16 blocks of SSE2 registers (16 loads of 16 bytes, 64 unpacks in 4
// rounds, a store of 16 rows per column). Each returns how many rows (from 0) it did: the scalar loop does the rest.
#ifdef RECFORGE_AVX2_DISPATCH
RECFORGE_AVX2 int64_t transpose_values_avx2(const uint64_t* __restrict x, int64_t C, int64_t n,
                                            uint64_t* __restrict t, int64_t T) {
  const int64_t n4 = n & ~(int64_t)3, m4 = C & ~(int64_t)3;
  for (int64_t r = 0; r < n4; r += 4) {
    const uint64_t* p = x + r * C;
    for (int64_t j = 0; j < m4; j += 4) {
      const __m256i a0 = _mm256_loadu_si256((const __m256i*)(p + j));
      const __m256i a1 = _mm256_loadu_si256((const __m256i*)(p + C + j));
      const __m256i a2 = _mm256_loadu_si256((const __m256i*)(p + 2 * C + j));
      const __m256i a3 = _mm256_loadu_si256((const __m256i*)(p + 3 * C + j));
      const __m256i t0 = _mm256_unpacklo_epi64(a0, a1);  // a0[0] a1[0] a0[2] a1[2]
      const __m256i t1 = _mm256_unpackhi_epi64(a0, a1);  // a0[1] a1[1] a0[3] a1[3]
      const __m256i t2 = _mm256_unpacklo_epi64(a2, a3);
      const __m256i t3 = _mm256_unpackhi_epi64(a2, a3);
      uint64_t* o = t + j * T + r;
      _mm256_storeu_si256((__m256i*)o, _mm256_permute2x128_si256(t0, t2, 0x20));  // column j: rows r..r+3
      _mm256_storeu_si256((__m256i*)(o + T), _mm256_permute2x128_si256(t1, t3, 0x20));
      _mm256_storeu_si256((__m256i*)(o + 2 * T), _mm256_permute2x128_si256(t0, t2, 0x31));
      _mm256_storeu_si256((__m256i*)(o + 3 * T), _mm256_permute2x128_si256(t1, t3, 0x31));
    }
    for (int64_t j = m4; j < C; ++j)
      for (int64_t i = 0; i < 4; ++i) t[j * T + r + i] = p[i * C + j];
  }
  return n4;
}
#endif

#if defined(__x86_64__)
// end: the end of the whole flag matrix. A block's 16-byte loads run up to 16 - (C - j) bytes into the next row
// (harmless), so the blocks stop at the first one whose last load would pass end.
int64_t transpose_flags_sse2(const uint8_t* __restrict x, const uint8_t* end, int64_t C, int64_t n,
                             uint8_t* __restrict t, int64_t T) {
  const int64_t last_j = ((C - 1) / 16) * 16;  // the last block of columns
  int64_t r = 0;
  for (; r + 16 <= n && x + (r + 15) * C + last_j + 16 <= end; r += 16) {
    const uint8_t* p = x + r * C;
    for (int64_t j = 0; j < C; j += 16) {
      __m128i a[16], b[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm_loadu_si128((const __m128i*)(p + i * C + j));
      for (int i = 0; i < 8; ++i) {  // byte pairs of rows (2i, 2i+1): b[2i] columns 0-7, b[2i+1] columns 8-15
        b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
      }
      for (int q = 0; q < 4; ++q) {  // rows 4q..4q+3: a[4q + c] holds columns 4c..4c+3, 4 bytes each
        a[4 * q] = _mm_unpacklo_epi16(b[4 * q], b[4 * q + 2]);
        a[4 * q + 1] = _mm_unpackhi_epi16(b[4 * q], b[4 * q + 2]);
        a[4 * q + 2] = _mm_unpacklo_epi16(b[4 * q + 1], b[4 * q + 3]);
        a[4 * q + 3] = _mm_unpackhi_epi16(b[4 * q + 1], b[4 * q + 3]);
      }
      for (int h = 0; h < 2; ++h)  // rows 8h..8h+7: b[8h + c] holds columns 2c, 2c+1, 8 bytes each
        for (int c = 0; c < 4; ++c) {
          b[8 * h + 2 * c] = _mm_unpacklo_epi32(a[8 * h + c], a[8 * h + 4 + c]);
          b[8 * h + 2 * c + 1] = _mm_unpackhi_epi32(a[8 * h + c], a[8 * h + 4 + c]);
        }
      const int64_t cols = std::min<int64_t>(16, C - j);
      for (int64_t c = 0; c < cols; ++c) {  // column j + c: rows r..r+15
        const __m128i col = (c & 1) ? _mm_unpackhi_epi64(b[c >> 1], b[8 + (c >> 1)])
                                    : _mm_unpacklo_epi64(b[c >> 1], b[8 + (c >> 1)]);
        _mm_storeu_si128((__m128i*)(t + (j + c) * T + r), col);
      }
    }
  }
  return r;
}
#endif

template <typename V>
void transpose_tile_scalar(const V* x, int64_t C, const int64_t* cols, int64_t m, int64_t r0, int64_t n, V* t,
                           int64_t tr) {
  switch (tr) {  // the tile height as a constant: the column stride of the stores is an immediate
    case 32: transpose_tile<32>(x, C, cols, m, r0, n, t); break;
    case 64: transpose_tile<64>(x, C, cols, m, r0, n, t); break;
    case 128: transpose_tile<128>(x, C, cols, m, r0, n, t); break;
    default: transpose_tile<256>(x, C, cols, m, r0, n, t); break;
  }
}

// The tile transposes as the chain kernel runs them: blocks where every column is read in order (and, for the
// values, the CPU has AVX2), the scalar loop for the other rows. `simd` false: the scalar loop only (tests).
void transpose_values(const uint64_t* x, int64_t C, const int64_t* cols, int64_t m, int64_t n, uint64_t* t, int64_t T,
                      bool simd = true) {
  int64_t r0 = 0;
#ifdef RECFORGE_AVX2_DISPATCH
  if (simd && cols == nullptr && cpu_has_avx2()) r0 = transpose_values_avx2(x, C, n, t, T);
#endif
  transpose_tile_scalar(x, C, cols, m, r0, n, t, T);
}

void transpose_flags(const uint8_t* x, const uint8_t* end, int64_t C, const int64_t* cols, int64_t m, int64_t n,
                     uint8_t* t, int64_t T, bool simd = true) {
  int64_t r0 = 0;
#if defined(__x86_64__)
  if (simd && cols == nullptr) r0 = transpose_flags_sse2(x, end, C, n, t, T);
#endif
  transpose_tile_scalar(x, C, cols, m, r0, n, t, T);
}

// The next tile's raw rows (values and flags), prefetched a few cache lines before each feature's chain: the tile's
// transposes then read from cache instead of waiting on memory (the hardware prefetchers follow a stream but do not
// run a whole tile ahead while the features compute), and spreading the prefetches over the features leaves the
// memory system a steady trickle instead of a burst. (Measured, cold caches, 8192 rows: plans 0-3 6-19% faster with
// the T0 hint; the T1 hint (L2) helped plan 3 less and plan 0 not at all, all prefetches at the tile's start less.)
struct TilePrefetch {
  const char* at[4];
  int64_t left[4];
  int count = 0;
  void add(const void* p, int64_t bytes) {
    if (bytes <= 0) return;
    const uintptr_t a = (uintptr_t)p & ~(uintptr_t)63;  // from the line that holds the first byte
    at[count] = (const char*)a;
    left[count++] = (int64_t)((uintptr_t)p + bytes - a);
  }
  int64_t lines() const {
    int64_t l = 0;
    for (int i = 0; i < count; ++i) l += (left[i] + 63) / 64;
    return l;
  }
  void run(int64_t lines) {
    for (int i = 0; i < count && lines > 0; ++i)
      for (; left[i] > 0 && lines > 0; --lines, at[i] += 64, left[i] -= 64) {
#if defined(__x86_64__)
        _mm_prefetch(at[i], _MM_HINT_T0);
#else
        __builtin_prefetch(at[i], 0, 3);
#endif
      }
  }
};

// Runs one feature's steps over n <= kChainRows rows whose raw values and flags are x / v (contiguous: a column of
// the tile buffers), in L1 buffers, and writes its output: dense features into the tile's row-major dense block
// dtile[n, num_dense], sparse ones into ids_out (n values).
void run_chain(const ChainFeature& cf, const ChainStep* steps, const uint64_t* xbits, const uint8_t* v, int64_t n,
               const float* borders, const int64_t* table, float* dtile, int64_t num_dense, int64_t* ids_out) {
  alignas(64) int64_t id[2][kChainRows];
  alignas(64) float fl[2][kChainRows];
  alignas(64) int32_t idx[kChainRows];
  const int64_t* raw = (const int64_t*)xbits;
  const double* raw_f64 = (const double*)xbits;
  int fi = 0, ii = 0;  // the current float / id buffer
  bool is_float = false;
  for (int64_t k = cf.first_step; k < cf.end_step; ++k) {
    const ChainStep& st = steps[k];
    float* fx = fl[fi];
    float* fo = fl[fi ^ 1];
    int64_t* ix = id[ii];
    int64_t* io = id[ii ^ 1];
    switch (st.code) {
      case FILL_FLOAT:
        if (cf.f64)
          fill_run(raw_f64, v, fl[fi], n, (float)st.f0);
        else
          fill_run(raw, v, fl[fi], n, (float)st.f0);
        is_float = true;
        continue;
      case FILL_ID:  // chain() checks that its column is int64
        fill_run(raw, v, id[ii], n, (int64_t)st.f0);
        is_float = false;
        continue;
      case LOGIT: logit_run(fx, fo, n, st.f0, st.f1); fi ^= 1; break;
      case BOXCOX: boxcox_run(fx, fo, n, st.f0); fi ^= 1; break;
      case LOG1P: log1p_run(fx, fo, n); fi ^= 1; break;
      case CLAMP_FLOAT: clamp_float_run(fx, fo, n, (float)st.f0, (float)st.f1); fi ^= 1; break;
      case CLAMP_ID: clamp_id_run(ix, io, n, st.i0, st.i1); ii ^= 1; break;
      case SIGRID_HASH: sigrid_hash_block(ix, io, n, (uint64_t)st.i0, st.mod); ii ^= 1; break;
      case BUCKETIZE: bucketize_run(fx, id[ii], n, borders + st.i0, st.i1 - st.i0); is_float = false; break;
      case MAPID: mapid_run(ix, io, n, table + st.i0, st.i1 - st.i0); ii ^= 1; break;
      case CAST_FLOAT: cast_float_run(ix, fl[fi], n); is_float = true; break;
      case CAST_ID: cast_id_run(fx, id[ii], n); is_float = false; break;
      case ONEHOT_FIRST: {
        onehot_index(fx, idx, n, (float)st.f0, onehot_step(st.f0, st.f1, st.i0), st.i0);
        for (int64_t r = 0; r < n; ++r) fo[r] = idx[r] == 0 ? 1.0f : 0.0f;
        fi ^= 1;
        break;
      }
      default: TORCH_CHECK(false, "chain: unknown step code ", st.code);
    }
  }
  if (cf.to_dense) {
    float* o = dtile + cf.slot;
    if (is_float)
      for (int64_t r = 0; r < n; ++r) o[r * num_dense] = fl[fi][r];
    else
      for (int64_t r = 0; r < n; ++r) o[r * num_dense] = (float)id[ii][r];
  } else {
    stream_copy(ids_out, id[ii], n * (int64_t)sizeof(int64_t));
  }
}

// One pass over the batch in row tiles. Per tile: the raw rows of each matrix are transposed (the columns the plan
// reads, values and flags; in SIMD blocks when it reads every column in order) into column-major tile buffers,
// every feature's chain runs on its column's contiguous run while the next tile's rows are prefetched, and the
// outputs are streamed out: the tile's block of the dense matrix [B, num_dense] (float32, row-major)
// and each feature's run of the ids [num_sparse * B] (key-major, one id per row: a KJT's values).
std::vector<Tensor> chain(const Tensor& dense_raw, const Tensor& dense_valid, const Tensor& sparse_raw,
                          const Tensor& sparse_valid, at::IntArrayRef src_kind, at::IntArrayRef src_col,
                          at::IntArrayRef out_kind, at::IntArrayRef out_slot, at::IntArrayRef step_offsets,
                          at::IntArrayRef codes, at::ArrayRef<double> f0, at::ArrayRef<double> f1,
                          at::IntArrayRef i0, at::IntArrayRef i1, const Tensor& borders_, const Tensor& table_,
                          int64_t num_dense, int64_t num_sparse) {
  const int64_t F = (int64_t)src_kind.size(), S = (int64_t)codes.size();
  check_len(src_col.size(), F, "chain", "src_col");
  check_len(out_kind.size(), F, "chain", "out_kind");
  check_len(out_slot.size(), F, "chain", "out_slot");
  check_len(step_offsets.size(), F + 1, "chain", "step_offsets");
  for (auto* v : {&f0, &f1}) check_len(v->size(), S, "chain", "float parameters");
  for (auto* v : {&i0, &i1}) check_len(v->size(), S, "chain", "int parameters");
  TORCH_CHECK(num_dense >= 0 && num_sparse >= 0, "chain: num_dense and num_sparse must be >= 0");
  const Tensor raws[2] = {dense_raw.contiguous(), sparse_raw.contiguous()};
  const Tensor valids[2] = {dense_valid.contiguous(), sparse_valid.contiguous()};
  const int64_t B = raws[0].size(0);
  for (int k = 0; k < 2; ++k) {
    // the dense matrix may be float64 (a dataset with float columns); ids are int64
    const bool type_ok = raws[k].scalar_type() == at::kLong || (k == 0 && raws[k].scalar_type() == at::kDouble);
    TORCH_CHECK(raws[k].dim() == 2 && type_ok && raws[k].size(0) == B,
                "chain: raw matrices must be int64 [B, F] (the dense one may be float64) with the same B");
    TORCH_CHECK(valids[k].sizes() == raws[k].sizes() && valids[k].scalar_type() == at::kBool,
                "chain: valid must be bool like its raw matrix");
  }
  Tensor borders = borders_.to(at::kFloat).contiguous();
  Tensor table = table_.to(at::kLong).contiguous();
  std::vector<ChainStep> steps(S);
  for (int64_t k = 0; k < S; ++k) {
    steps[k] = {codes[k], i0[k], i1[k], f0[k], f1[k], {1, 0, 0, true}};
    if (codes[k] == SIGRID_HASH) {
      TORCH_CHECK(i1[k] >= 1, "chain: sigrid_hash modulus must be >= 1");
      steps[k].mod = mod_magic((uint64_t)i1[k]);  // once per call, not per tile
    }
  }
  // the columns each matrix's tile buffers hold: those some feature reads, in order of first use
  std::vector<int64_t> tile_cols[2];
  std::vector<int64_t> col_to_tile[2] = {std::vector<int64_t>(raws[0].size(1), -1),
                                         std::vector<int64_t>(raws[1].size(1), -1)};
  std::vector<ChainFeature> feats(F);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t kind = src_kind[f];
    TORCH_CHECK(kind == 0 || kind == 1, "chain: src_kind must be 0 (dense) or 1 (sparse)");
    const Tensor& raw = raws[kind];
    TORCH_CHECK(src_col[f] >= 0 && src_col[f] < raw.size(1), "chain: feature ", f, " reads column ", src_col[f],
                " of ", raw.size(1));
    const bool to_dense = out_kind[f] == 0;
    TORCH_CHECK(out_slot[f] >= 0 && out_slot[f] < (to_dense ? num_dense : num_sparse), "chain: feature ", f,
                " writes slot ", out_slot[f], " outside its output");
    TORCH_CHECK(0 <= step_offsets[f] && step_offsets[f] <= step_offsets[f + 1] && step_offsets[f + 1] <= S,
                "chain: step_offsets must be ascending within the steps");
    const bool f64 = raw.scalar_type() == at::kDouble;
    if (f64)
      for (int64_t k = step_offsets[f]; k < step_offsets[f + 1]; ++k)
        TORCH_CHECK(codes[k] != FILL_ID, "chain: feature ", f, " fills ids from a float64 column");
    int64_t& tc = col_to_tile[kind][src_col[f]];
    if (tc < 0) {
      tc = (int64_t)tile_cols[kind].size();
      tile_cols[kind].push_back(src_col[f]);
    }
    feats[f] = {kind, tc, f64, to_dense, out_slot[f], step_offsets[f], step_offsets[f + 1]};
  }
  for (const auto& st : steps) {
    if (st.code == BUCKETIZE)
      TORCH_CHECK(0 <= st.i0 && st.i0 <= st.i1 && st.i1 <= borders.numel(), "chain: bucketize borders out of range");
    if (st.code == MAPID)
      TORCH_CHECK(0 <= st.i0 && st.i0 <= st.i1 && st.i1 <= table.numel(), "chain: mapid table out of range");
  }
  Tensor dense = at::empty({B, num_dense}, raws[0].options().dtype(at::kFloat));
  Tensor ids = at::empty({num_sparse * B}, raws[1].options().dtype(at::kLong));
  if (B == 0) return {dense, ids};
  float* dp = dense.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const float* bp = borders.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  // a matrix's columns are transposed in their order when the plan reads all of them (no index per value)
  const int64_t* cols_of[2];
  const uint64_t* xbits[2];
  const uint8_t* vbytes[2];
  int64_t ncols[2];
  for (int k = 0; k < 2; ++k) {
    bool identity = (int64_t)tile_cols[k].size() == raws[k].size(1);
    for (int64_t j = 0; identity && j < (int64_t)tile_cols[k].size(); ++j) identity = tile_cols[k][j] == j;
    cols_of[k] = identity ? nullptr : tile_cols[k].data();
    xbits[k] = (const uint64_t*)raws[k].data_ptr();  // int64 or float64 values: transposed as their 8 bytes
    vbytes[k] = (const uint8_t*)valids[k].data_ptr<bool>();
    ncols[k] = (int64_t)tile_cols[k].size();
  }
  // Rows per tile (a power of two from 32 to kChainRows): the tile buffers (8 bytes + a flag per column read, and
  // the dense block) within 96 KiB, so they stay in L2 while every feature reads its column from them. (Measured
  // with cold caches, RAP plans 0-3 at 8192 rows: a 96 KiB budget beat 24, 48 and 192 KiB; plan 0 gets 128 rows.)
  const int64_t tile_bytes_per_row = 9 * (ncols[0] + ncols[1]) + 4 * num_dense;
  int64_t tile_rows = kChainRows;
  while (tile_rows > 32 && tile_rows * tile_bytes_per_row > 96 * 1024) tile_rows /= 2;
  const int64_t T = tile_rows;
  at::parallel_for(0, (B + T - 1) / T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint64_t> xt((ncols[0] + ncols[1]) * T);
    std::vector<uint8_t> vt((ncols[0] + ncols[1]) * T);
    std::vector<float> dtile(std::max<int64_t>(1, num_dense * T));
    uint64_t* xk[2] = {xt.data(), xt.data() + ncols[0] * T};
    uint8_t* vk[2] = {vt.data(), vt.data() + ncols[0] * T};
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * T, n = std::min(B, r0 + T) - r0;
      for (int k = 0; k < 2; ++k) {
        if (ncols[k] == 0) continue;
        const int64_t C = raws[k].size(1);
        transpose_values(xbits[k] + r0 * C, C, cols_of[k], ncols[k], n, xk[k], T);
        transpose_flags(vbytes[k] + r0 * C, vbytes[k] + B * C, C, cols_of[k], ncols[k], n, vk[k], T);
      }
      TilePrefetch pf;
      if (t + 1 < t1) {
        const int64_t r1 = r0 + T, n1 = std::min(B, r1 + T) - r1;
        for (int k = 0; k < 2; ++k) {
          if (ncols[k] == 0) continue;
          const int64_t C = raws[k].size(1);
          pf.add(xbits[k] + r1 * C, n1 * C * 8);
          pf.add(vbytes[k] + r1 * C, n1 * C);
        }
      }
      const int64_t per_feature = (pf.lines() + F - 1) / std::max<int64_t>(F, 1);
      for (const auto& cf : feats) {
        pf.run(per_feature);
        run_chain(cf, steps.data(), xk[cf.src] + cf.tile_col * T, vk[cf.src] + cf.tile_col * T, n, bp,
                  tp, dtile.data(), num_dense, ip + cf.slot * B + r0);
      }
      if (num_dense > 0) stream_copy(dp + r0 * num_dense, dtile.data(), n * num_dense * (int64_t)sizeof(float));
    }
    stream_fence();
  });
  return {dense, ids};
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
  m.def("log1p(Tensor[] xs) -> Tensor[]", &log1p_kernel);
  m.def("onehot(Tensor[] xs, float[] lo, float[] hi, int[] classes, int[] keep) -> Tensor[]", &onehot);
  m.def("firstx(Tensor[] xs, int[] X) -> Tensor[]", &firstx);
  m.def("ngram(Tensor[] xs, int[] n) -> Tensor[]", &ngram);
  m.def("firstx_jagged(Tensor[] values, Tensor[] lengths, int[] X) -> Tensor[]", &firstx_jagged);
  m.def("ngram_jagged(Tensor[] values, Tensor[] lengths, int[] n) -> Tensor[]", &ngram_jagged);
  m.def("floor_mod(Tensor h, int d, int method) -> Tensor", &floor_mod);
  m.def("fill_float_path(Tensor x, Tensor valid, float fill, int path) -> Tensor", &fill_float_path);
  m.def("limit_loop(Tensor x, Tensor y, Tensor(a!) o, int kind, int d, int reps) -> float", &limit_loop);
  m.def("chain(Tensor dense_raw, Tensor dense_valid, Tensor sparse_raw, Tensor sparse_valid, int[] src_kind, "
        "int[] src_col, int[] out_kind, int[] out_slot, int[] step_offsets, int[] codes, float[] f0, float[] f1, "
        "int[] i0, int[] i1, Tensor borders, Tensor table, int num_dense, int num_sparse) -> Tensor[]",
        &chain);
}
