// CPU kernel of `recforge::embedding_layer` (the RECom fused embedding layer), C++ with OpenMP. Built on first use by
// recforge_kernels/embedding_cpu.py, which passes the metadata layout (META_WIDTH, STEP_BASE, MAX_STEPS, STEP_WIDTH,
// M_<field>, OP_<step>) as -D flags from recforge_kernels.embedding_layout, so Python and C++ read one layout.
//
// Work is split into tasks (column x tile of rows), run by an OpenMP `parallel for` with torch's thread count. A
// task first translates its values into ids (a jagged column in its slice of the one workspace, sized by the
// columns' symbolic upper bounds; a one-value-per-row column in a small per-thread buffer that stays in L1), then
// gathers / pools the table rows straight into the output's [rows, out_off : out_off + dim] block; a pooled lookup
// prefetches the table rows of the ids a few places ahead, across bags. The hot column signatures (float
// bucketize, floor-mod, sigrid_hash, identity; gather or pool; dim 4/8/16/32/64) have their own loops; every other
// column runs the step interpreter.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>
#include <cstdlib>
#include <sys/mman.h>

#include "sigrid_hash.h"  // the fused preprocessing kernels' hash: both map an id alike

namespace {

constexpr int64_t REMOVED = std::numeric_limits<int64_t>::min();  // a Remove step dropped the element

// Output buffers of at least POOL_MIN bytes are recycled: a freed output goes back to this pool (up to
// `cap` bytes held; RECFORGE_EMBEDDING_POOL_MB, default 512) instead of to the OS, so the next call does not
// page-fault a fresh mapping (glibc maps blocks over 32 MB anew on every allocation). Sizes are rounded up
// to powers of two so requests of varying batch sizes share buffers. Buffers are 2 MB aligned and advised
// for transparent huge pages, which also keeps the TLB from missing on every row of the strided writes.
constexpr size_t POOL_MIN = 1 << 20;
constexpr size_t HUGE = 2 << 20;
struct Pool {
  std::mutex mu;
  std::vector<std::pair<size_t, void*>> free_list;
  size_t held = 0;
  size_t cap = size_t(512) << 20;
  Pool() {
    const char* env = std::getenv("RECFORGE_EMBEDDING_POOL_MB");
    if (env != nullptr) cap = size_t(std::max(0L, std::atol(env))) << 20;
  }
};
Pool& pool() { static Pool* p = new Pool(); return *p; }  // never destroyed: deleters may run at exit

void pool_free(void* ptr, size_t bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.held + bytes <= p.cap) { p.free_list.emplace_back(bytes, ptr); p.held += bytes; return; }
  }
  std::free(ptr);
}

void* pool_alloc(size_t bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> g(p.mu);
    for (size_t i = 0; i < p.free_list.size(); ++i) {
      if (p.free_list[i].first == bytes) {
        void* ptr = p.free_list[i].second;
        p.free_list.erase(p.free_list.begin() + i);
        p.held -= bytes;
        return ptr;
      }
    }
  }
  void* ptr = std::aligned_alloc(HUGE, bytes);
  TORCH_CHECK(ptr != nullptr, "embedding_layer: out of memory for a ", bytes, "-byte output");
  madvise(ptr, bytes, MADV_HUGEPAGE);
  return ptr;
}

at::Tensor new_output(int64_t batch, int64_t total_dim, const at::TensorOptions& opts) {
  const size_t raw = size_t(batch) * size_t(total_dim) * sizeof(float);
  if (raw < POOL_MIN || pool().cap == 0) return at::empty({batch, total_dim}, opts);
  size_t bytes = HUGE;
  while (bytes < raw) bytes <<= 1;
  void* ptr = pool_alloc(bytes);
  return at::from_blob(ptr, {batch, total_dim}, [bytes](void* q) { pool_free(q, bytes); }, opts);
}

int64_t set_pool_bytes(int64_t cap) {
  Pool& p = pool();
  std::lock_guard<std::mutex> g(p.mu);
  const int64_t before = (int64_t)p.cap;
  p.cap = cap < 0 ? 0 : (size_t)cap;
  while (p.held > p.cap && !p.free_list.empty()) {
    p.held -= p.free_list.back().first;
    std::free(p.free_list.back().second);
    p.free_list.pop_back();
  }
  return before;
}

int64_t g_tile_rows = 0;  // 0: automatic (see embedding_layer)

int64_t set_tile_rows(int64_t t) { const int64_t b = g_tile_rows; g_tile_rows = t < 0 ? 0 : t; return b; }

int64_t* workspace(int64_t n) {  // one per thread, grown on demand and kept
  thread_local std::vector<int64_t> ws;
  if ((int64_t)ws.size() < n) { ws.clear(); ws.shrink_to_fit(); ws.resize((size_t)n); }
  return ws.data();
}

// The ids of a one-value-per-row column live only while its task runs: they go to a small buffer of the
// running thread that every such task reuses (it stays in L1) rather than to the column's own slice of the
// workspace, which would stream 8 bytes per row and column through the caches on every call.
int64_t* row_scratch(int64_t n) {
  thread_local std::vector<int64_t> scratch;
  if ((int64_t)scratch.size() < n) scratch.resize((size_t)n);
  return scratch.data();
}

enum Dtype { DT_I64 = 0, DT_I32, DT_F32, DT_F64, DT_BOOL, DT_U8, DT_I16, DT_I8 };

inline int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kLong: return DT_I64;
    case at::kInt: return DT_I32;
    case at::kFloat: return DT_F32;
    case at::kDouble: return DT_F64;
    case at::kBool: return DT_BOOL;
    case at::kByte: return DT_U8;
    case at::kShort: return DT_I16;
    case at::kChar: return DT_I8;
    default: return -1;
  }
}

struct View {  // a raw input: element e of column col sits at base + e * s0 + col * s1
  const char* base = nullptr;
  int64_t s0 = 0, s1 = 0, n = 0;
  int dt = -1;
  inline int64_t get_i(int64_t e, int64_t col) const {
    const int64_t k = e * s0 + col * s1;
    switch (dt) {
      case DT_I64: return reinterpret_cast<const int64_t*>(base)[k];
      case DT_I32: return reinterpret_cast<const int32_t*>(base)[k];
      case DT_BOOL: return reinterpret_cast<const bool*>(base)[k] ? 1 : 0;
      case DT_U8: return reinterpret_cast<const uint8_t*>(base)[k];
      case DT_I16: return reinterpret_cast<const int16_t*>(base)[k];
      case DT_I8: return reinterpret_cast<const int8_t*>(base)[k];
      case DT_F32: return (int64_t)reinterpret_cast<const float*>(base)[k];
      default: return (int64_t)reinterpret_cast<const double*>(base)[k];
    }
  }
  inline double get_f(int64_t e, int64_t col) const {
    const int64_t k = e * s0 + col * s1;
    if (dt == DT_F32) return (double)reinterpret_cast<const float*>(base)[k];
    if (dt == DT_F64) return reinterpret_cast<const double*>(base)[k];
    return (double)get_i(e, col);
  }
};

struct Col {
  const int64_t* m;  // the metadata row
  int64_t in_value, in_col, in_lengths, lookup, empty_id, rows, dim, w_off, out_off, check, nsteps;
  int64_t ws_off = 0, nvals = 0;
  int kind = 0;  // fast path
};

enum Kind { K_GENERIC = 0, K_BUCKET_F32, K_MOD_I64, K_SIGRID_I64, K_IDENT_I64 };

inline int64_t floor_mod(int64_t x, int64_t n) {
  int64_t r = x % n;
  return r < 0 ? r + n : r;
}

inline int64_t sigrid(int64_t x, int64_t salt, int64_t m) {
  return floor_mod((int64_t)hash_128_to_64((uint64_t)salt, twang_mix64((uint64_t)x)), m);
}

// torch.bucketize: right=false -> first i with !(b[i] < x) spelled as torch does (!(b[i] >= x) moves
// right), so NaN lands at K; right=true -> !(b[i] > x). Branchless over a sorted array.
template <typename T, typename V>
inline int64_t bucket(const T* b, int64_t n, V x, bool right) {
  if (n == 0) return 0;
  const T* base = b;
  if (!right) {
    while (n > 1) { int64_t half = n >> 1; base = !(base[half] >= x) ? base + half : base; n -= half; }
    return (base - b) + (!(*base >= x) ? 1 : 0);
  }
  while (n > 1) { int64_t half = n >> 1; base = !(base[half] > x) ? base + half : base; n -= half; }
  return (base - b) + (!(*base > x) ? 1 : 0);
}

// W values of one column searched in lockstep: every search halves the same K, so the W independent
// compare-and-add chains overlap (about 2x the throughput of one search at a time).
template <bool RIGHT, int W>
inline void bucket_block(const double* b, int64_t n0, const float* x, int64_t s0, int64_t* out) {
  int64_t idx[W];
  double xv[W];
  for (int j = 0; j < W; ++j) { idx[j] = 0; xv[j] = (double)x[j * s0]; }
  if (n0 == 0) { for (int j = 0; j < W; ++j) out[j] = 0; return; }
  int64_t n = n0;
  while (n > 1) {
    const int64_t half = n >> 1;
    for (int j = 0; j < W; ++j) {
      const double v = b[idx[j] + half];
      idx[j] += (RIGHT ? !(v > xv[j]) : !(v >= xv[j])) ? half : 0;
    }
    n -= half;
  }
  for (int j = 0; j < W; ++j) {
    const double v = b[idx[j]];
    out[j] = idx[j] + ((RIGHT ? !(v > xv[j]) : !(v >= xv[j])) ? 1 : 0);
  }
}

template <bool RIGHT>
inline void bucket_run(const double* b, int64_t k, const float* x, int64_t s0, int64_t e0, int64_t e1, int64_t* ids) {
  int64_t e = e0;
  for (; e + 8 <= e1; e += 8) bucket_block<RIGHT, 8>(b, k, x + e * s0, s0, ids + (e - e0));
  for (; e < e1; ++e) bucket_block<RIGHT, 1>(b, k, x + e * s0, s0, ids + (e - e0));
}

inline bool in_span(int64_t x, int64_t lo, int64_t hi, int64_t outside) {
  const bool in = lo <= x && x <= hi;
  return outside ? !in : in;
}

struct Ctx {
  const std::vector<View>* inputs;
  const double* fbuf;
  const int64_t* ibuf;
  const float* weights;
  float* out;
  int64_t total_dim, batch;
  int64_t* ws;
  std::mutex* err_mu;
  int64_t* err_col;
  int64_t* err_id;
};

// the step interpreter: one value -> one id (or REMOVED)
inline int64_t run_steps(const Col& c, const Ctx& cx, int64_t e, const View& v) {
  const int64_t* st = c.m + STEP_BASE;
  bool is_float = v.dt == DT_F32 || v.dt == DT_F64;
  double xf = is_float ? v.get_f(e, c.in_col < 0 ? 0 : c.in_col) : 0.0;
  int64_t x = is_float ? 0 : v.get_i(e, c.in_col < 0 ? 0 : c.in_col);
  for (int64_t s = 0; s < c.nsteps; ++s, st += STEP_WIDTH) {
    const int64_t op = st[0];
    if (op == OP_BUCKETIZE) {
      const bool right = st[3] != 0;
      if (st[4] == 1) {  // float boundaries
        x = bucket(cx.fbuf + st[1], st[2], is_float ? xf : (double)x, right);
      } else {
        x = bucket(cx.ibuf + st[1], st[2], x, right);
      }
      is_float = false;
      continue;
    }
    switch (op) {
      case OP_SELECT: {
        const View& f = (*cx.inputs)[st[1]];
        const int64_t flag = f.get_i(e, st[2] < 0 ? 0 : st[2]);
        if (!(st[3] <= flag && flag <= st[4])) x = st[5];
        break;
      }
      case OP_MOD: x = floor_mod(x, st[1]); break;
      case OP_SIGRID: x = sigrid(x, st[1], st[2]); break;
      case OP_CLAMP: x = std::min(std::max(x, st[1]), st[2]); break;
      case OP_ADD: x = (int64_t)((uint64_t)x + (uint64_t)st[1]); break;
      case OP_REPLACE: if (!in_span(x, st[1], st[2], st[3])) x = st[4]; break;
      case OP_REMOVE: if (!in_span(x, st[1], st[2], st[3])) return REMOVED; break;
      default: break;
    }
  }
  return x;
}

void translate(const Col& c, const Ctx& cx, int64_t e0, int64_t e1, int64_t* ids) {
  const View& v = (*cx.inputs)[c.in_value];
  const int64_t* st = c.m + STEP_BASE;
  switch (c.kind) {
    case K_BUCKET_F32: {
      const float* x = reinterpret_cast<const float*>(v.base) + (c.in_col < 0 ? 0 : c.in_col * v.s1);
      const double* b = cx.fbuf + st[1];
      const int64_t k = st[2];
      if (st[3] != 0) bucket_run<true>(b, k, x, v.s0, e0, e1, ids); else bucket_run<false>(b, k, x, v.s0, e0, e1, ids);
      return;
    }
    case K_MOD_I64: {
      const int64_t* x = reinterpret_cast<const int64_t*>(v.base) + (c.in_col < 0 ? 0 : c.in_col * v.s1);
      const int64_t n = st[1];
      for (int64_t e = e0; e < e1; ++e) ids[e - e0] = floor_mod(x[e * v.s0], n);
      return;
    }
    case K_SIGRID_I64: {
      const int64_t* x = reinterpret_cast<const int64_t*>(v.base) + (c.in_col < 0 ? 0 : c.in_col * v.s1);
      const int64_t salt = st[1], m = st[2];
      for (int64_t e = e0; e < e1; ++e) ids[e - e0] = sigrid(x[e * v.s0], salt, m);
      return;
    }
    case K_IDENT_I64: {
      const int64_t* x = reinterpret_cast<const int64_t*>(v.base) + (c.in_col < 0 ? 0 : c.in_col * v.s1);
      for (int64_t e = e0; e < e1; ++e) ids[e - e0] = x[e * v.s0];
      return;
    }
    default:
      for (int64_t e = e0; e < e1; ++e) ids[e - e0] = run_steps(c, cx, e, v);
  }
}

inline void report(const Col& c, const Ctx& cx, int64_t col_index, int64_t id) {
  std::lock_guard<std::mutex> g(*cx.err_mu);
  if (*cx.err_col < 0) { *cx.err_col = col_index; *cx.err_id = id; }
}

constexpr int64_t PREFETCH = 8;  // ids ahead whose table rows a pooled lookup asks the memory for

template <int D>
inline void copy_row(float* dst, const float* src, int64_t d) {
  if (D > 0) { std::memcpy(dst, src, sizeof(float) * D); } else { std::memcpy(dst, src, sizeof(float) * d); }
}

template <int D>
inline void zero_row(float* dst, int64_t d) {
  if (D > 0) { std::memset(dst, 0, sizeof(float) * D); } else { std::memset(dst, 0, sizeof(float) * d); }
}

template <int D>
void gather(const Col& c, const Ctx& cx, int64_t col_index, int64_t b0, int64_t b1, const int64_t* ids) {
  const int64_t d = D > 0 ? D : c.dim;
  const float* w = cx.weights + c.w_off;
  float* out = cx.out + c.out_off;
  const int64_t rows = c.rows;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t id = ids[b - b0];
    float* o = out + b * cx.total_dim;
    if (id == REMOVED) { zero_row<D>(o, d); continue; }
    if (c.check && (id < 0 || id >= rows)) { report(c, cx, col_index, id); zero_row<D>(o, d); continue; }
    copy_row<D>(o, w + id * d, d);
  }
}

// offs[k] is where row b0 + k starts (ids[0] is element offs[0])
template <int D>
void pool(const Col& c, const Ctx& cx, int64_t col_index, int64_t b0, int64_t b1, const int64_t* ids,
          const int64_t* offs) {
  const int64_t d = D > 0 ? D : c.dim;
  const float* w = cx.weights + c.w_off;
  float* out = cx.out + c.out_off;
  const int64_t rows = c.rows;
  const int64_t base = offs[0];
  const int64_t nids = offs[b1 - b0] - base;  // the tile's ids, translated up front: prefetch across bags
  float acc_fixed[D > 0 ? D : 1];
  std::vector<float> acc_dyn(D > 0 ? 0 : d);
  float* acc = D > 0 ? acc_fixed : acc_dyn.data();
  for (int64_t b = b0; b < b1; ++b) {
    float* o = out + b * cx.total_dim;
    for (int64_t j = 0; j < d; ++j) acc[j] = 0.f;
    int64_t n = 0;
    const int64_t s = offs[b - b0] - base, e = offs[b - b0 + 1] - base;
    for (int64_t k = s; k < e; ++k) {
      const int64_t id = ids[k];
      if (id == REMOVED) continue;
      if (c.check && (id < 0 || id >= rows)) { report(c, cx, col_index, id); continue; }
      if (k + PREFETCH < nids) {
        const int64_t ahead = ids[k + PREFETCH];
        if (ahead >= 0 && ahead < rows) {  // a row of dim > 16 spans two cache lines
          __builtin_prefetch(w + ahead * d);
          if (d > 16) __builtin_prefetch(w + ahead * d + 16);
        }
      }
      const float* r = w + id * d;
      for (int64_t j = 0; j < d; ++j) acc[j] += r[j];
      ++n;
    }
    if (n == 0) {
      if (c.empty_id >= 0 && c.empty_id < rows) copy_row<D>(o, w + c.empty_id * d, d); else zero_row<D>(o, d);
      continue;
    }
    if (c.lookup == 2) { const float cnt = (float)n; for (int64_t j = 0; j < d; ++j) acc[j] /= cnt; }
    copy_row<D>(o, acc, d);
  }
}

template <int D>
void run_task_d(const Col& c, const Ctx& cx, int64_t col_index, int64_t b0, int64_t b1) {
  int64_t* ws = cx.ws + c.ws_off;
  if (c.in_lengths < 0) {
    const int64_t n = b1 - b0;
    int64_t* ids = row_scratch(2 * n + 1);
    translate(c, cx, b0, b1, ids);
    if (c.lookup == 0) { gather<D>(c, cx, col_index, b0, b1, ids); return; }
    int64_t* offs = ids + n;  // one candidate per row (a Remove may drop it)
    for (int64_t k = 0; k <= n; ++k) offs[k] = k;
    pool<D>(c, cx, col_index, b0, b1, ids, offs);
    return;
  }
  const int64_t* offs = ws + c.nvals;  // offsets[B + 1] after the ids
  const int64_t e0 = offs[b0], e1 = offs[b1];
  int64_t* ids = ws + e0;
  translate(c, cx, e0, e1, ids);
  pool<D>(c, cx, col_index, b0, b1, ids, offs + b0);
}

void run_task(const Col& c, const Ctx& cx, int64_t col_index, int64_t b0, int64_t b1) {
  switch (c.dim) {
    case 4: run_task_d<4>(c, cx, col_index, b0, b1); break;
    case 8: run_task_d<8>(c, cx, col_index, b0, b1); break;
    case 16: run_task_d<16>(c, cx, col_index, b0, b1); break;
    case 32: run_task_d<32>(c, cx, col_index, b0, b1); break;
    case 64: run_task_d<64>(c, cx, col_index, b0, b1); break;
    default: run_task_d<0>(c, cx, col_index, b0, b1);
  }
}

int fast_kind(const Col& c, const View& v) {
  const int64_t* st = c.m + STEP_BASE;
  if (c.nsteps == 0 && v.dt == DT_I64) return K_IDENT_I64;
  if (c.nsteps != 1) return K_GENERIC;
  if (st[0] == OP_BUCKETIZE && st[4] == 1 && v.dt == DT_F32) return K_BUCKET_F32;
  if (st[0] == OP_MOD && v.dt == DT_I64) return K_MOD_I64;
  if (st[0] == OP_SIGRID && v.dt == DT_I64) return K_SIGRID_I64;
  return K_GENERIC;
}

View make_view(const at::Tensor& t) {
  View v;
  v.base = reinterpret_cast<const char*>(t.data_ptr());
  v.dt = dtype_code(t);
  v.n = t.dim() > 0 ? t.size(0) : 1;
  v.s0 = t.dim() > 0 ? t.stride(0) : 0;
  v.s1 = t.dim() > 1 ? t.stride(1) : 0;
  return v;
}

std::vector<Col> decode(const at::Tensor& meta, const std::vector<View>& views, int64_t batch,
                        int64_t weights_numel, int64_t total_dim, int64_t fbuf_n, int64_t ibuf_n) {
  const int64_t C = meta.size(0);
  const int64_t* m = meta.data_ptr<int64_t>();
  std::vector<Col> cols(C);
  const int64_t ninputs = (int64_t)views.size();
  for (int64_t i = 0; i < C; ++i) {
    Col& c = cols[i];
    c.m = m + i * META_WIDTH;
    c.in_value = c.m[M_IN_VALUE]; c.in_col = c.m[M_IN_COL]; c.in_lengths = c.m[M_IN_LENGTHS];
    c.lookup = c.m[M_LOOKUP]; c.empty_id = c.m[M_EMPTY_ID]; c.rows = c.m[M_ROWS]; c.dim = c.m[M_DIM];
    c.w_off = c.m[M_W_OFF]; c.out_off = c.m[M_OUT_OFF]; c.check = c.m[M_CHECK]; c.nsteps = c.m[M_NSTEPS];
    TORCH_CHECK(c.in_value >= 0 && c.in_value < ninputs, "embedding_layer: column ", i, " reads input ",
                c.in_value, " of ", ninputs);
    TORCH_CHECK(c.in_lengths < ninputs, "embedding_layer: column ", i, " lengths input out of range");
    TORCH_CHECK(c.nsteps >= 0 && c.nsteps <= MAX_STEPS, "embedding_layer: column ", i, " has ", c.nsteps, " steps");
    TORCH_CHECK(c.dim > 0 && c.rows > 0 && c.w_off >= 0 && c.w_off + c.rows * c.dim <= weights_numel,
                "embedding_layer: column ", i, " table lies outside the packed weights");
    TORCH_CHECK(c.out_off >= 0 && c.out_off + c.dim <= total_dim, "embedding_layer: column ", i,
                " writes outside the output row");
    const View& v = views[c.in_value];
    TORCH_CHECK(v.dt >= 0, "embedding_layer: column ", i, " input has an unsupported dtype");
    c.nvals = v.n;
    if (c.in_lengths < 0) {
      TORCH_CHECK(v.n == batch, "embedding_layer: column ", i, " input has ", v.n, " rows, the batch has ", batch);
    } else {
      const View& l = views[c.in_lengths];
      TORCH_CHECK(l.n == batch && (l.dt == DT_I64 || l.dt == DT_I32), "embedding_layer: column ", i,
                  " lengths must be int64/int32 of the batch size ", batch, ", got ", l.n);
    }
    const int64_t* st = c.m + STEP_BASE;
    for (int64_t s = 0; s < c.nsteps; ++s, st += STEP_WIDTH) {
      if (st[0] == OP_BUCKETIZE) {
        const int64_t lim = st[4] == 1 ? fbuf_n : ibuf_n;
        TORCH_CHECK(st[1] >= 0 && st[2] >= 0 && st[1] + st[2] <= lim, "embedding_layer: column ", i,
                    " boundaries out of range");
      } else if (st[0] == OP_SELECT) {
        TORCH_CHECK(st[1] >= 0 && st[1] < ninputs, "embedding_layer: column ", i, " flag input out of range");
        TORCH_CHECK(views[st[1]].n == v.n, "embedding_layer: column ", i, " flag and values differ in length");
      } else if (st[0] == OP_MOD) {
        TORCH_CHECK(st[1] > 0, "embedding_layer: column ", i, " mod by ", st[1]);
      } else if (st[0] == OP_SIGRID) {
        TORCH_CHECK(st[2] > 0, "embedding_layer: column ", i, " sigrid modulus ", st[2]);
      }
    }
    if (c.in_col >= 0) {
      TORCH_CHECK(views[c.in_value].s1 != 0 || c.in_col == 0, "embedding_layer: column ", i, " reads column ",
                  c.in_col, " of a 1-D input");
    }
    c.kind = fast_kind(c, v);
  }
  return cols;
}

// workspace: each column's ids (and, jagged, its offsets[B + 1]) in one allocation, laid out by the
// columns' symbolic upper bounds ws_b * B + ws_n * len(values) + ws_c
int64_t layout(std::vector<Col>& cols, int64_t batch) {
  int64_t total = 0;
  for (size_t i = 0; i < cols.size(); ++i) {
    Col& c = cols[i];
    const int64_t ub = c.m[M_WS_B] * batch + c.m[M_WS_N] * c.nvals + c.m[M_WS_C];
    const int64_t need = (c.in_lengths < 0 ? batch : c.nvals + batch + 1);
    TORCH_CHECK(ub >= need, "embedding_layer: column ", i, " workspace bound ", ub, " < ", need,
                " elements needed (the compiled plan's symbolic bound is wrong)");
    c.ws_off = total;
    total += ub;
  }
  return total;
}

int64_t workspace_elems(std::vector<at::Tensor> inputs, at::Tensor meta, int64_t batch) {
  std::vector<View> views;
  for (auto& t : inputs) views.push_back(make_view(t));
  auto cols = decode(meta, views, batch, std::numeric_limits<int64_t>::max() / 2,
                     std::numeric_limits<int64_t>::max() / 2, std::numeric_limits<int64_t>::max() / 2,
                     std::numeric_limits<int64_t>::max() / 2);
  return layout(cols, batch);
}

at::Tensor embedding_layer(std::vector<at::Tensor> inputs, at::Tensor weights, at::Tensor fbuf, at::Tensor ibuf,
                           at::Tensor meta, int64_t batch, int64_t total_dim, int64_t num_threads) {
  TORCH_CHECK(meta.dim() == 2 && meta.size(1) == META_WIDTH && meta.scalar_type() == at::kLong &&
              meta.is_contiguous(), "embedding_layer: meta must be contiguous int64 [C, ", META_WIDTH, "]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 1,
              "embedding_layer: weights must be a contiguous float32 vector");
  TORCH_CHECK(fbuf.scalar_type() == at::kDouble && fbuf.is_contiguous(), "embedding_layer: fbuf must be float64");
  TORCH_CHECK(ibuf.scalar_type() == at::kLong && ibuf.is_contiguous(), "embedding_layer: ibuf must be int64");
  TORCH_CHECK(batch >= 0 && total_dim >= 0, "embedding_layer: negative batch or width");
  std::vector<View> views;
  views.reserve(inputs.size());
  for (auto& t : inputs) {
    TORCH_CHECK(t.device().is_cpu(), "embedding_layer: inputs must be on the CPU");
    TORCH_CHECK(t.dim() == 1 || t.dim() == 2, "embedding_layer: inputs must be 1-D or 2-D");
    views.push_back(make_view(t));
  }
  auto cols = decode(meta, views, batch, weights.numel(), total_dim, fbuf.numel(), ibuf.numel());
  at::Tensor out = new_output(batch, total_dim, weights.options());
  if (batch == 0 || cols.empty()) return out;
  const int64_t ws_n = layout(cols, batch);
  int64_t* ws = workspace(ws_n);

  // jagged columns: offsets from lengths, checked (no negative length, lengths sum to the values)
  std::vector<int64_t> jagged;
  for (size_t i = 0; i < cols.size(); ++i) if (cols[i].in_lengths >= 0) jagged.push_back((int64_t)i);
  std::vector<int64_t> bad_len(cols.size(), 0);
  for (int64_t j : jagged) {
    Col& c = cols[j];
    int64_t* offs = ws + c.ws_off + c.nvals;
    const View& l = views[c.in_lengths];
    int64_t acc = 0;
    offs[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = l.get_i(b, 0);
      if (len < 0) bad_len[j] = 1; else acc += len;
      offs[b + 1] = acc;
    }
    TORCH_CHECK_VALUE(!bad_len[j], "embedding_layer: column ", j, " has a negative length");
    TORCH_CHECK_VALUE(acc == c.nvals, "embedding_layer: column ", j, " lengths sum to ", acc, " but it has ",
                      c.nvals, " values");
  }

  const int nt = (int)std::max<int64_t>(1, num_threads > 0 ? num_threads : at::get_num_threads());
  // tasks: (column, rows [b0, b1)); enough tiles per column to feed nt threads when columns are few
  const int64_t C = (int64_t)cols.size();
  int64_t tiles = nt == 1 ? 1 : std::max<int64_t>(1, (4 * nt + C - 1) / C);
  int64_t tile = std::max<int64_t>(16, (batch + tiles - 1) / tiles);
  if (g_tile_rows > 0) tile = g_tile_rows;
  std::vector<int64_t> task_col, task_b0;
  task_col.reserve(C * ((batch + tile - 1) / tile));
  // row tile outer, column inner: a tile's output rows stay in cache while every column fills its slice
  for (int64_t b = 0; b < batch; b += tile)
    for (int64_t i = 0; i < C; ++i) { task_col.push_back(i); task_b0.push_back(b); }

  std::mutex mu;
  int64_t err_col = -1, err_id = 0;
  Ctx cx{&views, fbuf.data_ptr<double>(), ibuf.data_ptr<int64_t>(), weights.data_ptr<float>(),
         out.data_ptr<float>(), total_dim, batch, ws, &mu, &err_col, &err_id};
  const int64_t ntasks = (int64_t)task_col.size();
  if (nt == 1) {
    for (int64_t t = 0; t < ntasks; ++t)
      run_task(cols[task_col[t]], cx, task_col[t], task_b0[t], std::min(batch, task_b0[t] + tile));
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t t = 0; t < ntasks; ++t)
      run_task(cols[task_col[t]], cx, task_col[t], task_b0[t], std::min(batch, task_b0[t] + tile));
  }
  TORCH_CHECK_INDEX(err_col < 0, "embedding_layer: column ", err_col, " looked up id ", err_id,
                    " outside its table of ", err_col >= 0 ? cols[err_col].rows : 0, " rows");
  return out;
}

at::Tensor embedding_layer_op(const at::TensorList inputs, const at::Tensor& weights, const at::Tensor& fbuf,
                              const at::Tensor& ibuf, const at::Tensor& meta, c10::SymInt batch, int64_t total_dim) {
  return embedding_layer(inputs.vec(), weights, fbuf, ibuf, meta, batch.guard_int(__FILE__, __LINE__), total_dim, 0);
}

}  // namespace

// The schema is defined from Python (recforge_kernels.embedding_op); this is its CPU kernel.
TORCH_LIBRARY_IMPL(recforge, CPU, m) {
  m.impl("embedding_layer", &embedding_layer_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("embedding_layer", &embedding_layer, "fused embedding layer (CPU)");
  m.def("workspace_elems", &workspace_elems, "workspace elements the layer allocates for these inputs");
  m.def("set_tile_rows", &set_tile_rows, "rows per task (0: automatic); returns the old value");
  m.def("set_pool_bytes", &set_pool_bytes, "cap on output-buffer bytes kept for reuse (0: off); returns the old cap");
}
