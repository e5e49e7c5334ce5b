// CPU kernels of DLRM's dot interaction (recforge_kernels/interaction.py), forward and backward, one pass per row.
//
// Row b's vectors are v[0] = dense[b] and v[1..F] = sparse[b, 0..F-1] (D floats each). The forward writes
// out[b] = [dense[b], dot(v[i], v[j]) for i < j in row-major order] (torch.triu_indices(F + 1, F + 1, 1), as
// torchrec's InteractionArch orders them) straight into one [B, D + (F + 1) F / 2] tensor: no [B, F+1, F+1] Gram
// matrix, no gather of its upper triangle, no concatenation. The backward accumulates
// grad v[i] += g_ij v[j] and grad v[j] += g_ij v[i] in a per-row buffer that stays in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>
#include <algorithm>
#include <vector>

namespace {

constexpr int64_t L = 8;  // rows per block: one SIMD lane per row, so no dot product needs a horizontal sum

// A block of up to L rows transposed into x[(i * d + k) * L + l] = vector i's element k of row l (v[0] = dense,
// v[1..F] = sparse); rows past `rows` are zero.
template <typename T>
void load_block(const T* dense, const T* sparse, int64_t b, int64_t rows, int64_t f, int64_t d, T* x) {
  const int64_t n = f + 1;
  for (int64_t l = 0; l < L; ++l) {
    if (l >= rows) {
      for (int64_t e = 0; e < n * d; ++e) x[e * L + l] = 0;
      continue;
    }
    const T* dv = dense + (b + l) * d;
    for (int64_t k = 0; k < d; ++k) x[k * L + l] = dv[k];
    const T* sv = sparse + (b + l) * f * d;
    for (int64_t e = 0; e < f * d; ++e) x[(d + e) * L + l] = sv[e];
  }
}

template <typename T, int64_t DC>
void forward_rows(const T* dense, const T* sparse, T* out, int64_t b0, int64_t b1, int64_t f, int64_t d_rt) {
  const int64_t d = DC > 0 ? DC : d_rt;
  const int64_t n = f + 1, pairs = n * (n - 1) / 2, width = d + pairs;
  std::vector<T> xs(n * d * L), ys(pairs * L);
  for (int64_t b = b0; b < b1; b += L) {
    const int64_t rows = std::min(L, b1 - b);
    T* __restrict x = xs.data();
    T* __restrict y = ys.data();
    load_block(dense, sparse, b, rows, f, d, x);
    int64_t p = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = x + i * d * L;
      for (int64_t j = i + 1; j < n; ++j, ++p) {
        const T* xj = x + j * d * L;
        T acc[L] = {};
        for (int64_t k = 0; k < d; ++k) {
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) acc[l] += xi[k * L + l] * xj[k * L + l];
        }
        for (int64_t l = 0; l < L; ++l) y[p * L + l] = acc[l];
      }
    }
    for (int64_t l = 0; l < rows; ++l) {
      T* o = out + (b + l) * width;
      const T* dv = dense + (b + l) * d;
      for (int64_t k = 0; k < d; ++k) o[k] = dv[k];
      for (int64_t q = 0; q < pairs; ++q) o[d + q] = y[q * L + l];
    }
  }
}

// grad v[i] = sum_{j != i} g_ij v[j] (g_ij = g_ji, the pair's output gradient), plus the dense passthrough for v[0];
// a block of L rows at a time, one lane per row, as the forward; vector i's gradient is accumulated in registers
// (d x L values: 16 AVX2 / 8 AVX-512 registers at d = 16).
template <typename T, int64_t DC>
void backward_rows(const T* grad, const T* dense, const T* sparse, T* gdense, T* gsparse, int64_t b0, int64_t b1,
                   int64_t f, int64_t d_rt) {
  const int64_t d = DC > 0 ? DC : d_rt;
  const int64_t n = f + 1, pairs = n * (n - 1) / 2, width = d + pairs;
  std::vector<T> xs(n * d * L), gs(pairs * L), accs(d * L);
  std::vector<int64_t> pair_of(n * n, -1);
  for (int64_t i = 0, p = 0; i < n; ++i)
    for (int64_t j = i + 1; j < n; ++j, ++p) pair_of[i * n + j] = pair_of[j * n + i] = p;
  for (int64_t b = b0; b < b1; b += L) {
    const int64_t rows = std::min(L, b1 - b);
    T* __restrict x = xs.data();
    T* __restrict g = gs.data();
    load_block(dense, sparse, b, rows, f, d, x);
    for (int64_t l = 0; l < L; ++l) {
      if (l >= rows) {
        for (int64_t p = 0; p < pairs; ++p) g[p * L + l] = 0;
        continue;
      }
      const T* gr = grad + (b + l) * width + d;
      for (int64_t p = 0; p < pairs; ++p) g[p * L + l] = gr[p];
    }
    for (int64_t i = 0; i < n; ++i) {
      T acc_fixed[DC > 0 ? DC * L : 1];
      T* __restrict acc = DC > 0 ? acc_fixed : accs.data();
      for (int64_t e = 0; e < d * L; ++e) acc[e] = 0;
      for (int64_t j = 0; j < n; ++j) {
        if (j == i) continue;
        const T* gij = g + pair_of[i * n + j] * L;
        const T* xj = x + j * d * L;
        for (int64_t k = 0; k < d; ++k) {
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) acc[k * L + l] += gij[l] * xj[k * L + l];
        }
      }
      for (int64_t l = 0; l < rows; ++l) {
        if (i == 0) {
          const T* gr = grad + (b + l) * width;
          for (int64_t k = 0; k < d; ++k) gdense[(b + l) * d + k] = acc[k * L + l] + gr[k];
        } else {
          T* dst = gsparse + ((b + l) * f + i - 1) * d;
          for (int64_t k = 0; k < d; ++k) dst[k] = acc[k * L + l];
        }
      }
    }
  }
}

void check(const at::Tensor& dense, const at::Tensor& sparse) {
  TORCH_CHECK(dense.dim() == 2, "dot_interaction: dense must be [B, D], got ", dense.sizes());
  TORCH_CHECK(sparse.dim() == 3, "dot_interaction: sparse must be [B, F, D], got ", sparse.sizes());
  TORCH_CHECK(sparse.size(0) == dense.size(0) && sparse.size(2) == dense.size(1),
              "dot_interaction: dense ", dense.sizes(), " and sparse ", sparse.sizes(), " disagree on B or D");
  TORCH_CHECK(dense.scalar_type() == sparse.scalar_type(), "dot_interaction: dense and sparse dtypes differ");
  TORCH_CHECK(dense.device().is_cpu() && sparse.device().is_cpu(), "dot_interaction: CPU tensors only");
}

constexpr int64_t GRAIN = 64;  // rows per parallel task

at::Tensor forward(at::Tensor dense, at::Tensor sparse) {
  check(dense, sparse);
  dense = dense.contiguous();
  sparse = sparse.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1), n = F + 1;
  auto out = at::empty({B, D + n * (n - 1) / 2}, dense.options());
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "dot_interaction_forward", [&] {
    const auto* dp = dense.data_ptr<scalar_t>();
    const auto* sp = sparse.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
      if (D == 16) forward_rows<scalar_t, 16>(dp, sp, op, b0, b1, F, D);
      else forward_rows<scalar_t, 0>(dp, sp, op, b0, b1, F, D);
    });
  });
  return out;
}

std::vector<at::Tensor> backward(at::Tensor grad, at::Tensor dense, at::Tensor sparse) {
  check(dense, sparse);
  dense = dense.contiguous();
  sparse = sparse.contiguous();
  grad = grad.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1), n = F + 1;
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == B && grad.size(1) == D + n * (n - 1) / 2,
              "dot_interaction_backward: grad must be [", B, ", ", D + n * (n - 1) / 2, "], got ", grad.sizes());
  TORCH_CHECK(grad.scalar_type() == dense.scalar_type(), "dot_interaction_backward: grad dtype differs");
  auto gdense = at::empty_like(dense);
  auto gsparse = at::empty_like(sparse);
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "dot_interaction_backward", [&] {
    const auto* gp = grad.data_ptr<scalar_t>();
    const auto* dp = dense.data_ptr<scalar_t>();
    const auto* sp = sparse.data_ptr<scalar_t>();
    auto* gdp = gdense.data_ptr<scalar_t>();
    auto* gsp = gsparse.data_ptr<scalar_t>();
    at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
      if (D == 16) backward_rows<scalar_t, 16>(gp, dp, sp, gdp, gsp, b0, b1, F, D);
      else backward_rows<scalar_t, 0>(gp, dp, sp, gdp, gsp, b0, b1, F, D);
    });
  });
  return {gdense, gsparse};
}

}  // namespace

TORCH_LIBRARY(recforge_interaction, m) {
  m.def("forward(Tensor dense, Tensor sparse) -> Tensor");
  m.def("backward(Tensor grad, Tensor dense, Tensor sparse) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(recforge_interaction, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
