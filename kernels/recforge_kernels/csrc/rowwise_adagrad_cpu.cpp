// CPU kernels of a table-batched embedding bag with exact row-wise Adagrad applied in backward
// (recforge_kernels/rowwise_adagrad.py): the same state and update as FBGEMM's
// SplitTableBatchedEmbeddingBagsCodegen (EXACT_ROWWISE_ADAGRAD, host weights, sum pooling).
//
// Layout (FBGEMM's): feature t's table starts at weights[weights_offsets[t]] and holds hash_size_cumsum[t + 1] -
// hash_size_cumsum[t] rows of D = D_offsets[t + 1] - D_offsets[t] floats; its row-wise momentum at
// momentum[momentum_offsets[t]]; bag (t, b) is indices[offsets[t * B + b] .. offsets[t * B + b + 1]) and its pooled
// vector is out[b, D_offsets[t] ..][:D].
//
// The backward sums each distinct row's gradient over its occurrences in the order they appear (bag order, so the
// same additions as FBGEMM's stable sort), then per distinct row: m += sum(g^2) / D; w -= lr * g / (sqrt(m) + eps).
// Distinct rows are found with an open-addressing table sized to the feature's lookups, not by sorting them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kAhead = 8;  // lookups (or distinct rows) ahead whose table row is prefetched

void check_inputs(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                  const at::Tensor& hash_size_cumsum, const at::Tensor& indices, const at::Tensor& offsets,
                  int64_t B) {
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "rowwise_adagrad: weights must be a contiguous float32 CPU tensor");
  TORCH_CHECK(weights_offsets.scalar_type() == at::kLong && hash_size_cumsum.scalar_type() == at::kLong,
              "rowwise_adagrad: weights_offsets and hash_size_cumsum must be int64");
  TORCH_CHECK(D_offsets.scalar_type() == at::kInt, "rowwise_adagrad: D_offsets must be int32");
  TORCH_CHECK(indices.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
              "rowwise_adagrad: indices and offsets must be int64");
  const int64_t T = weights_offsets.numel();
  TORCH_CHECK(D_offsets.numel() == T + 1 && hash_size_cumsum.numel() == T + 1,
              "rowwise_adagrad: D_offsets and hash_size_cumsum need one entry per feature plus one");
  TORCH_CHECK(B >= 0 && offsets.numel() == T * B + 1, "rowwise_adagrad: offsets has ", offsets.numel(),
              " entries, expected features x batch + 1 = ", T * B + 1);
  const auto off = offsets.contiguous();
  const int64_t* of = off.data_ptr<int64_t>();
  TORCH_CHECK(of[0] >= 0 && of[T * B] <= indices.numel(), "rowwise_adagrad: offsets span ", of[0], "..", of[T * B],
              ", outside the ", indices.numel(), " indices");
  for (int64_t i = 0; i < T * B; ++i) {
    TORCH_CHECK(of[i] <= of[i + 1], "rowwise_adagrad: offsets decrease at bag ", i, " (", of[i], " > ", of[i + 1],
                ")");
  }
}

// out[b, D_offsets[t] + d] = sum of row indices[p] of feature t over bag (t, b), in bag order.
at::Tensor forward(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                   const at::Tensor& hash_size_cumsum, const at::Tensor& indices, const at::Tensor& offsets,
                   int64_t B) {
  check_inputs(weights, weights_offsets, D_offsets, hash_size_cumsum, indices, offsets, B);
  const int64_t T = weights_offsets.numel();
  const auto w_off = weights_offsets.contiguous(), d_off = D_offsets.contiguous();
  const auto hs = hash_size_cumsum.contiguous(), idx = indices.contiguous(), off = offsets.contiguous();
  const int32_t* D_o = d_off.data_ptr<int32_t>();
  const int64_t total_D = D_o[T];
  at::Tensor out = at::zeros({B, total_D}, weights.options());
  const float* w = weights.data_ptr<float>();
  const int64_t* wo = w_off.data_ptr<int64_t>();
  const int64_t* h = hs.data_ptr<int64_t>();
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t* of = off.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t D = D_o[t + 1] - D_o[t], rows = h[t + 1] - h[t];
      const float* table = w + wo[t];
      const int64_t p_end = of[t * B + B];
      for (int64_t b = 0; b < B; ++b) {
        float* dst = o + b * total_D + D_o[t];
        for (int64_t p = of[t * B + b]; p < of[t * B + b + 1]; ++p) {
          if (p + kAhead < p_end) {  // rows are random in a table far larger than the caches
            const int64_t ahead = ix[p + kAhead];
            if (ahead >= 0 && ahead < rows) __builtin_prefetch(table + ahead * D);
          }
          const int64_t r = ix[p];
          TORCH_CHECK(r >= 0 && r < rows, "rowwise_adagrad: feature ", t, " looks up row ", r, " of a table of ",
                      rows, " rows");
          const float* src = table + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
        }
      }
    }
  });
  return out;
}

inline uint64_t mix(uint64_t x) {  // a 64-bit finalizer (splitmix64): ids that differ in high bits spread too
  x ^= x >> 31;
  x *= 0x7fb5d329728ea185ULL;
  x ^= x >> 27;
  x *= 0x81dadef4bc2dd44dULL;
  return x ^ (x >> 33);
}

// Adds grad_output's rows into each distinct looked-up row's gradient and applies exact row-wise Adagrad to the
// rows in place: weights and momentum change, nothing is returned.
void backward_update(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& weights_offsets,
                     const at::Tensor& D_offsets, const at::Tensor& hash_size_cumsum, const at::Tensor& indices,
                     const at::Tensor& offsets, const at::Tensor& momentum, const at::Tensor& momentum_offsets,
                     double learning_rate, double eps) {
  const int64_t B = grad_output.size(0);
  check_inputs(weights, weights_offsets, D_offsets, hash_size_cumsum, indices, offsets, B);
  TORCH_CHECK(momentum.scalar_type() == at::kFloat && momentum.is_contiguous(),
              "rowwise_adagrad: momentum must be a contiguous float32 tensor");
  TORCH_CHECK(momentum_offsets.scalar_type() == at::kLong && momentum_offsets.numel() == weights_offsets.numel(),
              "rowwise_adagrad: momentum_offsets must be int64, one per feature");
  const int64_t T = weights_offsets.numel();
  const auto g_out = grad_output.to(at::kFloat).contiguous();
  const auto w_off = weights_offsets.contiguous(), d_off = D_offsets.contiguous(), m_off = momentum_offsets.contiguous();
  const auto hs = hash_size_cumsum.contiguous(), idx = indices.contiguous(), off = offsets.contiguous();
  const int32_t* D_o = d_off.data_ptr<int32_t>();
  const int64_t total_D = D_o[T];
  TORCH_CHECK(g_out.dim() == 2 && g_out.size(1) == total_D, "rowwise_adagrad: grad_output must be [B, ", total_D,
              "]");
  const float* g = g_out.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  float* m = momentum.data_ptr<float>();
  const int64_t* wo = w_off.data_ptr<int64_t>();
  const int64_t* mo = m_off.data_ptr<int64_t>();
  const int64_t* h = hs.data_ptr<int64_t>();
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t* of = off.data_ptr<int64_t>();
  const float lr = static_cast<float>(learning_rate), ep = static_cast<float>(eps);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> keys;    // open-addressing table: row id per slot (-1 empty)
    std::vector<int32_t> slot_of;  // slot -> distinct row number
    std::vector<int64_t> rows_seen;
    std::vector<float> acc;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t D = D_o[t + 1] - D_o[t], rows = h[t + 1] - h[t];
      const int64_t p0 = of[t * B], p1 = of[t * B + B], n = p1 - p0;
      if (n == 0) continue;
      int64_t cap = 16;
      while (cap < 2 * n) cap <<= 1;
      keys.assign(cap, -1);
      slot_of.resize(cap);
      rows_seen.clear();
      acc.assign(std::min(n, rows) * D, 0.0f);  // one gradient per distinct row
      for (int64_t b = 0; b < B; ++b) {
        const float* src = g + b * total_D + D_o[t];
        for (int64_t p = of[t * B + b]; p < of[t * B + b + 1]; ++p) {
          const int64_t r = ix[p];
          TORCH_CHECK(r >= 0 && r < rows, "rowwise_adagrad: feature ", t, " looks up row ", r, " of a table of ",
                      rows, " rows");
          uint64_t s = mix(static_cast<uint64_t>(r)) & (cap - 1);
          while (keys[s] != -1 && keys[s] != r) s = (s + 1) & (cap - 1);
          if (keys[s] == -1) {
            keys[s] = r;
            slot_of[s] = static_cast<int32_t>(rows_seen.size());
            rows_seen.push_back(r);
          }
          float* dst = acc.data() + static_cast<int64_t>(slot_of[s]) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
        }
      }
      float* table = w + wo[t];
      float* mom = m + mo[t];
      const int64_t u = static_cast<int64_t>(rows_seen.size());
      for (int64_t k = 0; k < u; ++k) {
        if (k + kAhead < u) {
          __builtin_prefetch(table + rows_seen[k + kAhead] * D, 1);
          __builtin_prefetch(mom + rows_seen[k + kAhead], 1);
        }
        const float* gr = acc.data() + k * D;
        float sq = 0.0f;
        for (int64_t d = 0; d < D; ++d) sq += gr[d] * gr[d];
        const int64_t r = rows_seen[k];
        mom[r] += sq / static_cast<float>(D);
        const float step = lr / (std::sqrt(mom[r]) + ep);
        float* wr = table + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) wr[d] -= step * gr[d];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(recforge_rowwise_adagrad, m) {
  m.def("forward(Tensor weights, Tensor weights_offsets, Tensor D_offsets, Tensor hash_size_cumsum, Tensor indices, "
        "Tensor offsets, int B) -> Tensor");
  m.def("backward_update(Tensor grad_output, Tensor(a!) weights, Tensor weights_offsets, Tensor D_offsets, "
        "Tensor hash_size_cumsum, Tensor indices, Tensor offsets, Tensor(b!) momentum, Tensor momentum_offsets, "
        "float learning_rate, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(recforge_rowwise_adagrad, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward_update", &backward_update);
}
