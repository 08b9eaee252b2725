// The backward kernels: backward_rows_kernel (rows in registers) and backward_long_kernel (a block per row),
// both persistent, writing per-block dweight / dbias partials that reduce_partials_kernel sums in a fixed
// order; their arguments (BackwardArgs) and per-pack steps. Launched from norm_kernels.cuh.
#pragma once

#include <cstdint>

#include "kernel_common.cuh"

namespace layernorm_ext {
namespace cuda {

template <typename A>
struct BackwardArgs {
  const void* grad_out;
  const void* grad_residual_out;  // saved's dtype; nullptr if none
  const void* saved;
  const A* mean;  // nullptr for RMSNorm
  const A* rstd;
  const void* weight;
  const void* bias;
  void* grad_input;
  A* partial_dweight;  // [gridDim.x, cols]; nullptr when not wanted
  A* partial_dbias;
  int64_t rows;
  int64_t cols;
  int64_t units;
  double inv_cols;
  A weight_offset;  // the forward's scale is weight + weight_offset
  bool saved_is_output;
  int lanes;
  int rows_per_block;
};

// For one pack: dy, d and g = dy * weight. d is saved minus the row's stored mean (LayerNorm; exact near the
// mean), saved itself (RMSNorm), or, in memory-efficient mode, xhat recovered from the forward's output as
// (out - bias) / weight.
template <typename Tg, typename Ts, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void backward_load(const BackwardArgs<A>& a, int64_t row, int64_t col_unit, A mean,
                                              A (&dy)[kVec], A (&d)[kVec], A (&g)[kVec]) {
  const int64_t unit = row * a.units + col_unit;
  load_pack<A, Tg, kVec>(a.grad_out, unit, dy);
  load_pack<A, Ts, kVec>(a.saved, unit, d);
  A w[kVec];
  if (a.weight != nullptr) {
    load_pack<A, Tw, kVec>(a.weight, col_unit, w);
#pragma unroll
    for (int j = 0; j < kVec; ++j) w[j] += a.weight_offset;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) w[j] = A(1);
  }
  if (a.saved_is_output) {
    if (!kRms && a.bias != nullptr) {
      A b[kVec];
      load_pack<A, Tw, kVec>(a.bias, col_unit, b);
#pragma unroll
      for (int j = 0; j < kVec; ++j) d[j] -= b[j];
    }
    if (a.weight != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) d[j] /= w[j];
    }
  } else if (!kRms) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) d[j] -= mean;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) g[j] = dy[j] * w[j];
}

// The row sums of the backward: sum(g), sum(g * d) and, for LayerNorm, sum(d).
template <typename A, bool kRms>
using BackwardSums = Sums<A, kRms ? 2 : 3>;

template <bool kRms, typename S, typename A, int kVec>
__device__ __forceinline__ void add_backward_terms(BackwardSums<S, kRms>& s, const A (&d)[kVec], const A (&g)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    s.v[0] += static_cast<S>(g[j]);
    s.v[1] += static_cast<S>(g[j]) * static_cast<S>(d[j]);
    if constexpr (!kRms) s.v[2] += static_cast<S>(d[j]);
  }
}

// A row's constants: xhat = (d - delta) * xscale and dx = rstd * (g - mean_g - xhat * mean_gx), evaluated as
// rstd * fma(-(d - delta), k, g - mean_g) with k = xscale * mean_gx: the product with d is exact inside the
// fused multiply-add, which matters where g - xhat * mean_gx cancels (N = 1: dx is proportional to
// 1 - xhat^2). delta = mean(d) corrects the stored (rounded) mean: xhat is then centred exactly, and
// sum(g * xhat) = rstd * (sum(g * d) - delta * sum(g)). Computed in double from the row sums, each rounded
// once to the compute type.
template <typename A>
struct RowCoefficients {
  A xscale, delta, rstd, mean_g, k;
};

__device__ __forceinline__ float fused_multiply_add(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fused_multiply_add(double a, double b, double c) { return __fma_rn(a, b, c); }

template <bool kRms, typename A, typename S>
__device__ __forceinline__ RowCoefficients<A> row_coefficients(const BackwardArgs<A>& a, A rstd,
                                                               const BackwardSums<S, kRms>& s) {
  const double inv = a.inv_cols;
  const double sum_g = static_cast<double>(s.v[0]), sum_gd = static_cast<double>(s.v[1]);
  double delta = 0.0;
  if constexpr (!kRms) delta = a.saved_is_output ? 0.0 : static_cast<double>(s.v[2]) * inv;
  const double sum_gx = a.saved_is_output ? sum_gd : static_cast<double>(rstd) * (sum_gd - delta * sum_g);
  RowCoefficients<A> c;
  c.xscale = a.saved_is_output ? A(1) : rstd;
  c.delta = static_cast<A>(delta);
  c.rstd = rstd;
  c.mean_g = kRms ? A(0) : static_cast<A>(sum_g * inv);
  c.k = static_cast<A>(sum_gx * inv * static_cast<double>(c.xscale));
  return c;
}

// For one pack: xhat from d (returned for the caller's dweight terms) and grad_input, plus the gradient
// flowing into residual_out, stored.
template <typename Ts, typename A, int kVec>
__device__ __forceinline__ void backward_store(const BackwardArgs<A>& a, int64_t row, int64_t col_unit,
                                               const RowCoefficients<A>& c, const A (&d)[kVec],
                                               const A (&g)[kVec], A (&xhat)[kVec]) {
  const int64_t unit = row * a.units + col_unit;
  A dx[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const A centred = d[j] - c.delta;
    xhat[j] = centred * c.xscale;
    dx[j] = c.rstd * fused_multiply_add(-centred, c.k, g[j] - c.mean_g);
  }
  if (a.grad_residual_out != nullptr) {
    A extra[kVec];
    load_pack<A, Ts, kVec>(a.grad_residual_out, unit, extra);
#pragma unroll
    for (int j = 0; j < kVec; ++j) dx[j] += extra[j];
  }
  store_pack<Ts, A, kVec>(a.grad_input, unit, dx);
}

template <typename A>
__device__ __forceinline__ void row_stats(const BackwardArgs<A>& a, int64_t row, bool rms, A* mean, A* rstd) {
  *rstd = load_global(a.rstd + row);
  *mean = (rms || a.mean == nullptr) ? A(0) : load_global(a.mean + row);
}

// The end of backward_rows_kernel: sum the groups' column partials and write row blockIdx.x of `out`
// ([gridDim.x, cols]). The groups (a power of two) are added pairwise, as a tree through shared memory: a
// fixed order, and an error that grows with log2(groups) rather than with their count. Every thread calls it.
template <typename A, int kPacks, int kVec>
__device__ __forceinline__ void write_block_partials(const BackwardArgs<A>& a, A (&acc)[kPacks][kVec], A* out,
                                                     A* combine_buf, int group, int lane) {
  for (int half = a.rows_per_block / 2; half >= 1; half /= 2) {
    if (group >= half && group < 2 * half) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p)
#pragma unroll
        for (int j = 0; j < kVec; ++j) combine_buf[(threadIdx.x * kPacks + p) * kVec + j] = acc[p][j];
    }
    __syncthreads();
    if (group < half) {
      const int t = (group + half) * a.lanes + lane;
#pragma unroll
      for (int p = 0; p < kPacks; ++p)
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[p][j] += combine_buf[(t * kPacks + p) * kVec + j];
    }
    __syncthreads();  // combine_buf is overwritten by the next level (or the next output)
  }
  if (group == 0) {
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int64_t col_unit = static_cast<int64_t>(p) * a.lanes + lane;
      if (col_unit < a.units) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) store_global(out + blockIdx.x * a.cols + col_unit * kVec + j, acc[p][j]);
      }
    }
  }
}

// Occupancy pinned by __launch_bounds__(threads, min blocks) so that a compiler change cannot lower it unseen
// (benchmarks/kernel_audit.py reports the compiled figures): the register path keeps a lane's raw packs of the
// row and of the weight, and two partial rows (dweight, dbias) as floats, under the 128 registers that one
// 512-thread block per SM allows.
constexpr int kBackwardRowsMinBlocks = 1;

// The long path holds one pack per array: 512-thread blocks per SM by compute type and pack width. A bare
// minimum of 2 for float rows made ptxas spend the 64 registers it then allowed (48 for float LayerNorm, which
// had 32: 4 blocks), so each variant keeps its own figure.
template <typename A, int kVec, bool kRms>
constexpr int backward_long_min_blocks() {
  if constexpr (sizeof(A) == 8) return 1;         // double rows: 40-94 registers
  else if constexpr (kVec >= 8) return 2;         // 16-bit inputs: 50-64 registers, 32 KB of dy + saved in flight
  else if constexpr (kVec == 4) return 3;  // float: 4 blocks (32 registers) spilled 8 B in LayerNorm with the
                                           // one-barrier all-reduce; 3 allow 40
  else return 4;                                  // single elements (unaligned rows): 30-32 registers
}

// The terms of element j of a lane's pack, converted from the raw packs (twice per row: for the sums, then for
// dx, rather than holding the row as floats): dy, g = dy * weight and d. d is saved minus the row's stored mean
// (LayerNorm; exact near the mean), saved itself (RMSNorm), or, kFromOutput (memory-efficient mode), xhat
// recovered from the forward's output as (out - bias) / weight. Absent weight / bias packs are zeros: w_base
// (weight_offset, or 1 without a weight) then gives the scale. The mode is a template flag of the row's code:
// as a run-time select per element, ptxas computed the division on every element of either mode.
template <bool kFromOutput, bool kRms, typename Tg, typename Ts, typename Tw, typename A, int kVec>
__device__ __forceinline__ void element_terms(const RawPack<Tg, kVec>& dy_raw, const RawPack<Ts, kVec>& saved_raw,
                                              const RawPack<Tw, kVec>& w_raw, const RawPack<Tw, kVec>& b_raw,
                                              A w_base, A mean, int j, A& dy, A& d, A& g) {
  dy = raw_element<A>(dy_raw, j);
  const A w = raw_element<A>(w_raw, j) + w_base;
  d = raw_element<A>(saved_raw, j);
  if constexpr (kFromOutput) {
    if constexpr (!kRms) d -= raw_element<A>(b_raw, j);
    d /= w;
  } else if constexpr (!kRms) {
    d -= mean;
  }
  g = dy * w;
}

// Register path, persistent. Threads to rows: rows_per_block groups of `lanes` threads per block (a sub-warp,
// a warp or the whole block per row), each group striding over rows by gridDim.x * rows_per_block; lane l owns
// packs l, l + lanes, ... (kPacks) of the columns, the same for every row. Registers: the lane's weight packs
// as raw bits, loaded once per block; per row the raw packs of dy, saved (and grad_residual_out: kResidual, a
// compile-time flag; memory-efficient LayerNorm: bias), all issued before the first use of any of them, then
// converted twice (the sums, then dx) instead of held as floats; the lane's dweight / dbias partials for its
// columns across all its rows, as floats. Reduction: the lane's sum(g), sum(g * d) (and sum(d)) in the compute
// type, all-reduced in one pass: shuffles in the warp, and for a row of several warps one shared-memory round
// (double-buffered by row parity: one barrier per row; none when the row fits in a warp). At the end the
// groups of a block add their partials in group order through shared memory and the block writes its row of
// the [gridDim.x, cols] partial buffers (reduce_partials_kernel finishes the sum in a fixed order).
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec, int kPacks, bool kResidual>
__global__ void __launch_bounds__(kMaxRowThreads, kBackwardRowsMinBlocks)
    backward_rows_kernel(BackwardArgs<acc_t<Ts>> a) {
  using A = acc_t<Ts>;
  using S = BackwardSums<A, kRms>;
  __shared__ S scratch[2][kMaxRowThreads / 32];
  LNX_DYNAMIC_SHARED(combine_bytes);  // blockDim.x * kPacks * kVec values, when rows_per_block > 1
  A* combine_buf = reinterpret_cast<A*>(combine_bytes);
  const int group = threadIdx.x / a.lanes;
  const int lane = threadIdx.x % a.lanes;
  const bool want_dweight = a.partial_dweight != nullptr;
  const bool want_dbias = a.partial_dbias != nullptr;
  bool lane_cols[kPacks];  // this lane's packs exist (the row's length need not fill the last round of lanes)
#pragma unroll
  for (int p = 0; p < kPacks; ++p) lane_cols[p] = static_cast<int64_t>(p) * a.lanes + lane < a.units;
  RawPack<Tw, kVec> w_raw[kPacks];
  {
    bool has_weight[kPacks];
#pragma unroll
    for (int p = 0; p < kPacks; ++p) has_weight[p] = lane_cols[p] && a.weight != nullptr;
    load_packs<Tw, kVec, kPacks>(a.weight, lane, a.lanes, has_weight, w_raw);
  }
  const A w_base = a.weight != nullptr ? a.weight_offset : A(1);
  A dweight[kPacks][kVec];
  A dbias[kPacks][kVec];
#pragma unroll
  for (int p = 0; p < kPacks; ++p)
#pragma unroll
    for (int j = 0; j < kVec; ++j) dweight[p][j] = dbias[p][j] = A(0);

  // One row of the group: kFromOutput as a type (both modes compiled, chosen once per row).
  int parity = 0;
  auto process_row = [&](int64_t row, auto from_output) {
    constexpr bool kFromOutput = decltype(from_output)::value;
    const bool row_ok = row < a.rows;
    bool valid[kPacks];
#pragma unroll
    for (int p = 0; p < kPacks; ++p) valid[p] = row_ok && lane_cols[p];
    const int64_t first_unit = row * a.units + lane;
    RawPack<Tg, kVec> dy_raw[kPacks];
    RawPack<Ts, kVec> saved_raw[kPacks];
    RawPack<Ts, kVec> extra_raw[kResidual ? kPacks : 1];
    RawPack<Tw, kVec> b_raw[kFromOutput && !kRms ? kPacks : 1];
    load_packs<Tg, kVec, kPacks>(a.grad_out, first_unit, a.lanes, valid, dy_raw);
    load_packs<Ts, kVec, kPacks>(a.saved, first_unit, a.lanes, valid, saved_raw);
    if constexpr (kResidual) load_packs<Ts, kVec, kPacks>(a.grad_residual_out, first_unit, a.lanes, valid, extra_raw);
    if constexpr (kFromOutput && !kRms) {
      bool has_bias[kPacks];
#pragma unroll
      for (int p = 0; p < kPacks; ++p) has_bias[p] = valid[p] && a.bias != nullptr;
      load_packs<Tw, kVec, kPacks>(a.bias, lane, a.lanes, has_bias, b_raw);
    }
    A mean = A(0), rstd = A(0);
    if (row_ok) row_stats(a, row, kRms, &mean, &rstd);
    S s{};
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (valid[p]) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          A dy, d, g;
          element_terms<kFromOutput, kRms>(dy_raw[p], saved_raw[p], w_raw[p], b_raw[kFromOutput && !kRms ? p : 0],
                                           w_base, mean, j, dy, d, g);
          s.v[0] += g;
          s.v[1] += g * d;
          if constexpr (!kRms) s.v[2] += d;
        }
      }
    }
    s = row_allreduce_one_barrier(s, a.lanes, scratch[parity]);
    parity ^= 1;
    const RowCoefficients<A> c = row_coefficients<kRms>(a, rstd, s);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (valid[p]) {
        A dx[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          A dy, d, g;
          element_terms<kFromOutput, kRms>(dy_raw[p], saved_raw[p], w_raw[p], b_raw[kFromOutput && !kRms ? p : 0],
                                           w_base, mean, j, dy, d, g);
          const A centred = d - c.delta;
          dx[j] = c.rstd * fused_multiply_add(-centred, c.k, g - c.mean_g);
          if constexpr (kResidual) dx[j] += raw_element<A>(extra_raw[p], j);
          if (want_dweight) dweight[p][j] += dy * (centred * c.xscale);
          if (want_dbias) dbias[p][j] += dy;
        }
        store_pack<Ts, A, kVec>(a.grad_input, first_unit + static_cast<int64_t>(p) * a.lanes, dx);
      }
    }
  };
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * a.rows_per_block;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * a.rows_per_block; base < a.rows; base += row_step) {
    if (a.saved_is_output) process_row(base + group, std::true_type{});
    else process_row(base + group, std::false_type{});
  }
  // Block partials: group 0 adds the other groups' values in group order, then writes the block's row.
  if (want_dweight) write_block_partials(a, dweight, a.partial_dweight, combine_buf, group, lane);
  if (want_dbias) write_block_partials(a, dbias, a.partial_dbias, combine_buf, group, lane);
}

// Long-row path, persistent: one block of kMaxRowThreads per row, striding over rows; thread t handles packs
// t, t + blockDim, ... Pass 1 reads grad_out and saved for the row sums (in double, as the forward's long
// path: a thread adds hundreds of packs), all-reduced with one barrier per row (the scratch alternates by row
// parity); pass 2 reads them again (mostly from L2), writes grad_input and adds the dweight / dbias terms into
// the block's own row of the partial buffers, which only thread t ever touches at its columns (no atomics;
// zeroed before the launch).
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads, (backward_long_min_blocks<acc_t<Ts>, kVec, kRms>()))
    backward_long_kernel(BackwardArgs<acc_t<Ts>> a) {
  using A = acc_t<Ts>;
  using S = BackwardSums<double, kRms>;
  __shared__ S scratch[2][kMaxRowThreads / 32];
  int parity = 0;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    A mean, rstd;
    row_stats(a, row, kRms, &mean, &rstd);
    S s{};
    for (int64_t col_unit = threadIdx.x; col_unit < a.units; col_unit += blockDim.x) {
      A dy[kVec], d[kVec], g[kVec];
      backward_load<Tg, Ts, Tw, kRms, A, kVec>(a, row, col_unit, mean, dy, d, g);
      add_backward_terms<kRms>(s, d, g);
    }
    s = row_allreduce_one_barrier(s, static_cast<int>(blockDim.x), scratch[parity]);
    parity ^= 1;
    const RowCoefficients<A> c = row_coefficients<kRms>(a, rstd, s);
    for (int64_t col_unit = threadIdx.x; col_unit < a.units; col_unit += blockDim.x) {
      A dy[kVec], d[kVec], g[kVec];
      backward_load<Tg, Ts, Tw, kRms, A, kVec>(a, row, col_unit, mean, dy, d, g);
      A xhat[kVec];
      backward_store<Ts, A, kVec>(a, row, col_unit, c, d, g, xhat);
      const int64_t offset = blockIdx.x * a.cols + col_unit * kVec;
      if (a.partial_dweight != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          A* partial = a.partial_dweight + offset + j;
          store_global(partial, load_global(partial) + dy[j] * xhat[j]);
        }
      }
      if (a.partial_dbias != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          A* partial = a.partial_dbias + offset + j;
          store_global(partial, load_global(partial) + dy[j]);
        }
      }
    }
  }
}

constexpr int kReduceColumns = 32;  // columns per block of reduce_partials_kernel
constexpr int kReduceSlices = 32;   // threads per column, each summing every kReduceSlices-th partial row

// Sum the [parts, cols] partial buffer over parts into a [cols] output of the parameters' dtype. Thread
// (x, y) of a (32, 32) block sums partial rows y, y + 32, ... of column blockIdx.x * 32 + x in order; the 32
// slice sums are then added pairwise (a tree). The order is fixed by the shape: the same bits on every run.
template <typename Tw, typename A>
__global__ void __launch_bounds__(kReduceColumns * kReduceSlices)
    reduce_partials_kernel(const A* partial, void* out, int64_t parts, int64_t cols) {
  __shared__ A slices[kReduceSlices][kReduceColumns];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceColumns + threadIdx.x;
  A sum = A(0);
  if (col < cols) {
    for (int64_t part = threadIdx.y; part < parts; part += kReduceSlices) sum += load_global(partial + part * cols + col);
  }
  slices[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  for (int half = kReduceSlices / 2; half >= 1; half /= 2) {
    if (threadIdx.y < half) slices[threadIdx.y][threadIdx.x] += slices[threadIdx.y + half][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < cols) store_global(static_cast<Tw*>(out) + col, from_acc<Tw>(slices[0][threadIdx.x]));
}

}  // namespace cuda
}  // namespace layernorm_ext
