// The backward kernels: backward_rows_kernel (rows in registers, persistent; backward_cluster_kernel: the same on
// a thread-block cluster per row, sm_90) and, for rows beyond the registers,
// backward_long_sums_kernel (a block per row: each row's two or three sums, turned into its coefficients) then
// backward_long_kernel (a block per column slice and group of rows: dx, and dweight / dbias in registers). Both
// paths write dweight / dbias partials, one row per block (rows) or per row group (long), that
// reduce_partials_kernel sums in a fixed order; their arguments (BackwardArgs) and per-pack steps. Launched
// from norm_kernels.cuh.
#pragma once

#include <cstdint>

#include "../row_layout.h"
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
  A* partial_dweight;  // [gridDim.x (rows path) or row groups (long path), cols]; nullptr when not wanted
  A* partial_dbias;
  int64_t rows;
  int64_t cols;
  int64_t units;
  double inv_cols;
  A weight_offset;  // the forward's scale is weight + weight_offset
  bool saved_is_output;
  int lanes;
  int rows_per_block;  // long path: rows per row group of backward_long_kernel (the last one may hold fewer)
};
// The long path's rows' terms, [rows, 4] (mean, delta, mean_g, k), are a kernel argument of their own: one more
// field in BackwardArgs made ptxas spill 8 bytes in backward_rows_kernel<float, ..., 4, 4> (sm_90).

// Strided rows (issue 24, row_layout.h): the layouts of the rows read, in units (grad_input is packed). The register
// path's variant with grad_residual_out always takes it (a contiguous call passes packed layouts), so that it needs
// no strided twin in the build; the variant without one has a twin that takes it beside its packed one, which
// indexes every operand at row * units.
struct StridedGradRows {
  RowLayout grad_out, saved, grad_residual_out;
};

// Where a row of each operand read begins, in units.
struct GradRowUnits {
  int64_t grad_out, saved, grad_residual_out;
};
template <typename A>
__device__ __forceinline__ GradRowUnits grad_row_units(const BackwardArgs<A>& a, int64_t row) {
  const int64_t packed = row * a.units;
  return {packed, packed, packed};
}
template <typename A>
__device__ __forceinline__ GradRowUnits grad_row_units(const BackwardArgs<A>& a, int64_t row, const StridedGradRows& s) {
  return {s.grad_out.offset32(row), s.saved.offset32(row), s.grad_residual_out.offset32(row)};
}

// The row sums of the backward: sum(g), sum(g * d) and, for LayerNorm, sum(d).
template <typename A, bool kRms>
using BackwardSums = Sums<A, kRms ? 2 : 3>;

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

// dx of one element from its centred d = d - delta and g, the gradient into x before grad_residual_out.
template <typename A>
__device__ __forceinline__ A grad_input_term(const RowCoefficients<A>& c, A centred, A g) {
  return c.rstd * fused_multiply_add(-centred, c.k, g - c.mean_g);
}

template <typename A>
__device__ __forceinline__ void row_stats(const BackwardArgs<A>& a, int64_t row, bool rms, A* mean, A* rstd) {
  *rstd = load_global(a.rstd + row);
  *mean = (rms || a.mean == nullptr) ? A(0) : load_global(a.mean + row);
}

// The end of backward_rows_kernel: sum the groups' column partials and write row `part` of `out` (the block's, or
// on a cluster the cluster's: [parts, cols]). The groups (a power of two) are added pairwise, as a tree through shared memory: a
// fixed order, and an error that grows with log2(groups) rather than with their count. Every thread calls it.
template <typename A, int kPacks, int kVec>
__device__ __forceinline__ void write_block_partials(const BackwardArgs<A>& a, A (&acc)[kPacks][kVec], A* out,
                                                     A* combine_buf, int group, int lane, int64_t part) {
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
        for (int j = 0; j < kVec; ++j) store_global(out + part * a.cols + col_unit * kVec + j, acc[p][j]);
      }
    }
  }
}

// Occupancy pinned by __launch_bounds__(threads, min blocks) so that a compiler change cannot lower it unseen
// (benchmarks/kernel_audit.py reports the compiled figures): the register path keeps a lane's raw packs of the
// row and of the weight, and two partial rows (dweight, dbias) as floats, under the 128 registers that one
// 512-thread block per SM allows.
constexpr int kBackwardRowsMinBlocks = 1;

// The long path's two kernels, both in blocks of kLongThreads. backward_long_sums_kernel: kLongPacks packs of
// dy, saved and weight per thread in flight; backward_long_kernel: kLongPacks rows of dy, saved (and
// grad_residual_out) per thread in flight and its columns' dweight / dbias in registers. kLongPacks: 32 bytes of
// saved (2 packs of 16-bit rows, 1 of float rows read with 16-bit dy), at most 4 single elements. Float rows: 3
// blocks per SM (80 registers), 2 with grad_residual_out (at 64 registers, 4 blocks, ptxas spilled 16-216 bytes
// per thread in either kernel); double rows: 2 blocks (128 registers), 1 where a pack holds 8 of them (16-bit
// dy with double rows: at 128 registers the column pass spilled 24-56 bytes).
template <typename Ts, int kVec>
constexpr int kLongPacks = 32 / static_cast<int>(sizeof(Ts)) / kVec < 1   ? 1
                           : 32 / static_cast<int>(sizeof(Ts)) / kVec > 4 ? 4
                                                                           : 32 / static_cast<int>(sizeof(Ts)) / kVec;
constexpr int kLongThreads = 256;
constexpr int64_t kLongGroupRows = 64;  // at most: a thread adds at most this many rows' terms in float
template <typename A, int kVec, bool kResidual>
constexpr int backward_long_min_blocks() {
  if constexpr (sizeof(A) == 8) return kVec >= 8 ? 1 : 2;
  else return kResidual ? 2 : 3;
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
// kCluster (backward_cluster_kernel, sm_90): a row too long for one block's registers spans a thread-block cluster
// of a.lanes / kMaxRowThreads blocks of kMaxRowThreads (one row per cluster, rows_per_block 1): thread t of block c
// is lane c * kMaxRowThreads + t, the row's all-reduce takes one round through distributed shared memory (the cluster's
// barrier), and the cluster writes one row of the partial buffers, each block its own columns. So a long row is read
// once (the two-pass long path reads dy and saved twice).
template <typename A>
constexpr size_t kClusterScratchBytes = 2 * sizeof(Sums<A, 3>) * (kMaxRowThreads / 32);

template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec, int kPacks, bool kResidual, bool kCluster,
          typename... Strided>
__device__ __forceinline__ void backward_rows(const BackwardArgs<acc_t<Ts>>& a, const Strided&... strided) {
  using A = acc_t<Ts>;
  using S = BackwardSums<A, kRms>;
  // The warps' sums, double-buffered by row parity; on a cluster in dynamic shared memory (kClusterScratchBytes),
  // each block's own, which its cluster's blocks read.
  __shared__ S block_scratch[kCluster ? 1 : 2][kMaxRowThreads / 32];
  LNX_DYNAMIC_SHARED(combine_bytes);  // blockDim.x * kPacks * kVec values, when rows_per_block > 1
  A* combine_buf = reinterpret_cast<A*>(combine_bytes);
  S(*scratch)[kMaxRowThreads / 32] = block_scratch;
  if constexpr (kCluster) scratch = reinterpret_cast<S(*)[kMaxRowThreads / 32]>(combine_bytes);
  const int cluster = kCluster ? a.lanes / kMaxRowThreads : 1;  // blocks of kMaxRowThreads on a cluster
  const int group = kCluster ? 0 : threadIdx.x / a.lanes;
  const int lane = kCluster ? static_cast<int>(blockIdx.x) % cluster * kMaxRowThreads + threadIdx.x
                            : threadIdx.x % a.lanes;
  const bool want_dweight = a.partial_dweight != nullptr;
  const bool want_dbias = a.partial_dbias != nullptr;
  // 16-bit rows only: with the third body, float and double rows with grad_residual_out spilled 2-3 times the stores.
  const bool both_partials = sizeof(Ts) == 2 && want_dweight && (kRms || want_dbias);
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

  // One row of the group, its variant chosen once per row: kFromOutput (the memory-efficient mode) and kBothPartials
  // (dweight and dbias (RMSNorm: dweight) both wanted, the default mode's common case) as types: three bodies.
  // Tested per pack instead, the partials took 12 instructions a pack (bf16 LayerNorm).
  int parity = 0;
  auto process_row = [&](int64_t row, auto from_output, auto both_partials) {
    constexpr bool kFromOutput = decltype(from_output)::value;
    constexpr bool kBothPartials = decltype(both_partials)::value;
    const bool row_ok = row < a.rows;
    bool valid[kPacks];
#pragma unroll
    for (int p = 0; p < kPacks; ++p) valid[p] = row_ok && lane_cols[p];
    const int64_t first_unit = row * a.units + lane;  // grad_input's
    const GradRowUnits at = grad_row_units(a, row, strided...);
    RawPack<Tg, kVec> dy_raw[kPacks];
    RawPack<Ts, kVec> saved_raw[kPacks];
    RawPack<Ts, kVec> extra_raw[kResidual ? kPacks : 1];
    RawPack<Tw, kVec> b_raw[kFromOutput && !kRms ? kPacks : 1];
    // Only valid packs are read below: no zeros for the others (8 instructions a row, bf16 LayerNorm), but in double
    // rows (without them, ptxas spilled 14-16 stores where 7-9, sm_90).
    constexpr bool kZeros = sizeof(A) == 8;
    load_packs<Tg, kVec, kPacks, kZeros>(a.grad_out, at.grad_out + lane, a.lanes, valid, dy_raw);
    load_packs<Ts, kVec, kPacks, kZeros>(a.saved, at.saved + lane, a.lanes, valid, saved_raw);
    if constexpr (kResidual) {
      load_packs<Ts, kVec, kPacks, kZeros>(a.grad_residual_out, at.grad_residual_out + lane, a.lanes, valid,
                                           extra_raw);
    }
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
    if constexpr (kCluster) s = cluster_allreduce<kMaxRowThreads>(s, a.lanes / 32, scratch[parity]);
    // Double rows' butterflies stay a loop: unrolled, with their packs' zeros skipped, ptxas spilled twice the stores.
    else s = row_allreduce_one_barrier<sizeof(A) == 4>(s, a.lanes, scratch[parity]);
    parity ^= 1;
    RowCoefficients<A> c = row_coefficients<kRms>(a, rstd, s);
    // LayerNorm of one element: dx is 0, but nvcc fuses g = dy * w into g - mean_g, whose exact product then misses
    // the rounded one in mean_g (an H200: dx 2e-5 in float32). Only in the single-element variant: rounding g as
    // written (__fmul_rn) cost every kernel an instruction per element, and a per-row test 0.5 in the cluster
    // kernel, over the audit's 28 for the bfloat16 backward.
    if constexpr (!kRms && kVec == 1 && kPacks == 1 && !kCluster) {
      if (a.cols == 1) c.rstd = A(0);
    }
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
          dx[j] = grad_input_term(c, centred, g);
          if constexpr (kResidual) dx[j] += raw_element<A>(extra_raw[p], j);
          if (kBothPartials || want_dweight) dweight[p][j] += dy * (centred * c.xscale);
          if (!kRms && (kBothPartials || want_dbias)) dbias[p][j] += dy;
        }
        store_pack<Ts, A, kVec>(a.grad_input, first_unit + static_cast<int64_t>(p) * a.lanes, dx);
      }
    }
  };
  const int64_t row_step = static_cast<int64_t>(gridDim.x / cluster) * a.rows_per_block;
  const int64_t part = blockIdx.x / cluster;  // the block's (or cluster's) row of the partial buffers
  for (int64_t base = part * a.rows_per_block; base < a.rows; base += row_step) {
    if (a.saved_is_output) process_row(base + group, std::true_type{}, std::false_type{});
    else if (both_partials) process_row(base + group, std::false_type{}, std::true_type{});
    else process_row(base + group, std::false_type{}, std::false_type{});
  }
  // Block partials: group 0 adds the other groups' values in group order, then writes the block's row.
  if (want_dweight) write_block_partials(a, dweight, a.partial_dweight, combine_buf, group, lane, part);
  if (want_dbias) write_block_partials(a, dbias, a.partial_dbias, combine_buf, group, lane, part);
  if constexpr (kCluster) cluster_sync();  // no block leaves while the others may still read its scratch
}

// Strided: none (packed rows), or StridedGradRows.
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec, int kPacks, bool kResidual, typename... Strided>
__global__ void __launch_bounds__(kMaxRowThreads, kBackwardRowsMinBlocks)
    backward_rows_kernel(BackwardArgs<acc_t<Ts>> a, Strided... strided) {
  backward_rows<Tg, Ts, Tw, kRms, kVec, kPacks, kResidual, false>(a, strided...);
}

template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec, int kPacks, bool kResidual>
__global__ void __launch_bounds__(kMaxRowThreads, kBackwardRowsMinBlocks)
    backward_cluster_kernel(BackwardArgs<acc_t<Ts>> a) {
  backward_rows<Tg, Ts, Tw, kRms, kVec, kPacks, kResidual, true>(a);
}

// Long rows, pass 1 (backward_long_sums_kernel), persistent: one block of kLongThreads per row, striding over
// rows by gridDim.x. Thread t takes packs t, t + blockDim, ... of dy, saved and the weight, kLongPacks at a
// time, all of a batch's loads issued before any use. Registers: the batch's raw packs and the thread's sums
// sum(g), sum(g * d) (and sum(d)) in the compute type, each batch's sums merged pairwise (PairwiseMerge: an
// error growing with log2(batches), not with their count). Reduction: the block's all-reduce with one barrier (the
// scratch alternates by row parity), then the row's coefficients in double (row_coefficients), and thread 0
// stores them: row_terms[row] = (mean, delta, mean_g, k). dx and dweight come from pass 2.
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec>
__global__ void __launch_bounds__(kLongThreads, (backward_long_min_blocks<acc_t<Ts>, kVec, false>()))
    backward_long_sums_kernel(BackwardArgs<acc_t<Ts>> a, acc_t<Ts>* row_terms) {
  using A = acc_t<Ts>;
  using S = BackwardSums<A, kRms>;
  constexpr int kPacks = kLongPacks<Ts, kVec>;
  __shared__ S scratch[2][kLongThreads / 32];
  const A w_base = a.weight != nullptr ? a.weight_offset : A(1);
  const int threads = static_cast<int>(blockDim.x);
  int parity = 0;
  auto process_row = [&](int64_t row, auto from_output) {
    constexpr bool kFromOutput = decltype(from_output)::value;
    A mean, rstd;
    row_stats(a, row, kRms, &mean, &rstd);
    PairwiseMerge<S, 2> sums;
    for (int64_t first = threadIdx.x; first < a.units; first += static_cast<int64_t>(kPacks) * threads) {
      bool valid[kPacks], has_weight[kPacks], has_bias[kPacks];
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        valid[p] = first + static_cast<int64_t>(p) * threads < a.units;
        has_weight[p] = valid[p] && a.weight != nullptr;
        has_bias[p] = valid[p] && a.bias != nullptr;
      }
      RawPack<Tg, kVec> dy_raw[kPacks];
      RawPack<Ts, kVec> saved_raw[kPacks];
      RawPack<Tw, kVec> w_raw[kPacks];
      RawPack<Tw, kVec> b_raw[kFromOutput && !kRms ? kPacks : 1];
      load_packs<Tg, kVec, kPacks>(a.grad_out, row * a.units + first, threads, valid, dy_raw);
      load_packs<Ts, kVec, kPacks>(a.saved, row * a.units + first, threads, valid, saved_raw);
      load_packs<Tw, kVec, kPacks>(a.weight, first, threads, has_weight, w_raw);
      if constexpr (kFromOutput && !kRms) load_packs<Tw, kVec, kPacks>(a.bias, first, threads, has_bias, b_raw);
      S batch{};
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        if (valid[p]) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            A dy, d, g;
            element_terms<kFromOutput, kRms>(dy_raw[p], saved_raw[p], w_raw[p], b_raw[kFromOutput && !kRms ? p : 0],
                                             w_base, mean, j, dy, d, g);
            batch.v[0] += g;
            batch.v[1] += g * d;
            if constexpr (!kRms) batch.v[2] += d;
          }
        }
      }
      sums.add(batch);
    }
    const S s = row_allreduce_one_barrier(sums.total(), threads, scratch[parity]);
    parity ^= 1;
    const RowCoefficients<A> c = row_coefficients<kRms>(a, rstd, s);
    if (threadIdx.x == 0) {
      const A terms[4] = {mean, c.delta, c.mean_g, c.k};
      store_pack<A, A, 4>(row_terms, row, terms);
    }
  };
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    if (a.saved_is_output) process_row(row, std::true_type{});
    else process_row(row, std::false_type{});
  }
}

// Long rows, pass 2 (backward_long_kernel): block b owns column slice b % slices (blockDim.x packs: thread t
// takes pack slice * blockDim.x + t) of the rows of group b / slices (rows_per_block consecutive rows), and walks
// them kLongPacks at a time: every load of those rows (dy, saved, grad_residual_out: kResidual, a
// compile-time flag; row_terms and rstd) issued before any use. Registers: the thread's weight (and, in
// memory-efficient LayerNorm, bias) pack, loaded once; its columns' dweight / dbias partials in the compute
// type across all the rows of its group. Writes dx of each row, then ONE partial per (row group, column) in
// each buffer: reduce_partials_kernel sums the groups in a fixed order. No reduction across threads, no barrier.
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec, bool kResidual>
__global__ void __launch_bounds__(kLongThreads, (backward_long_min_blocks<acc_t<Ts>, kVec, kResidual>()))
    backward_long_kernel(BackwardArgs<acc_t<Ts>> a, const acc_t<Ts>* row_terms) {
  using A = acc_t<Ts>;
  constexpr int kRows = kLongPacks<Ts, kVec>;
  const int64_t slices = (a.units + blockDim.x - 1) / blockDim.x;
  const int64_t group = blockIdx.x / slices;
  const int64_t col_unit = (blockIdx.x % slices) * blockDim.x + threadIdx.x;
  if (col_unit >= a.units) return;  // the last slice's idle threads: nothing waits for them
  const int64_t row_begin = group * a.rows_per_block;
  const int64_t row_end = row_begin + a.rows_per_block < a.rows ? row_begin + a.rows_per_block : a.rows;
  const int units = static_cast<int>(a.units);  // the row stride, in packs
  const A w_base = a.weight != nullptr ? a.weight_offset : A(1);
  auto run = [&](auto from_output) {
    constexpr bool kFromOutput = decltype(from_output)::value;
    RawPack<Tw, kVec> w_raw[1], b_raw[1];
    {
      const bool has_weight[1] = {a.weight != nullptr};
      const bool has_bias[1] = {kFromOutput && !kRms && a.bias != nullptr};
      load_packs<Tw, kVec, 1>(a.weight, col_unit, 0, has_weight, w_raw);
      load_packs<Tw, kVec, 1>(a.bias, col_unit, 0, has_bias, b_raw);
    }
    A dweight[kVec], dbias[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) dweight[j] = dbias[j] = A(0);
    for (int64_t first = row_begin; first < row_end; first += kRows) {
      bool valid[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) valid[r] = first + r < row_end;
      RawPack<Tg, kVec> dy_raw[kRows];
      RawPack<Ts, kVec> saved_raw[kRows];
      RawPack<Ts, kVec> extra_raw[kResidual ? kRows : 1];
      const int64_t first_unit = first * a.units + col_unit;
      load_packs<Tg, kVec, kRows>(a.grad_out, first_unit, units, valid, dy_raw);
      load_packs<Ts, kVec, kRows>(a.saved, first_unit, units, valid, saved_raw);
      if constexpr (kResidual) load_packs<Ts, kVec, kRows>(a.grad_residual_out, first_unit, units, valid, extra_raw);
      RawPack<A, 4> terms[kRows];
      A rstd[kRows];
      load_packs<A, 4, kRows>(row_terms, first, 1, valid, terms);
#pragma unroll
      for (int r = 0; r < kRows; ++r) rstd[r] = valid[r] ? load_global(a.rstd + first + r) : A(0);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (!valid[r]) continue;
        RowCoefficients<A> c;
        const A mean = raw_element<A>(terms[r], 0);
        c.delta = raw_element<A>(terms[r], 1);
        c.mean_g = raw_element<A>(terms[r], 2);
        c.k = raw_element<A>(terms[r], 3);
        c.rstd = rstd[r];
        c.xscale = kFromOutput ? A(1) : rstd[r];
        A dx[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          A dy, d, g;
          element_terms<kFromOutput, kRms>(dy_raw[r], saved_raw[r], w_raw[0], b_raw[0], w_base, mean, j, dy, d, g);
          const A centred = d - c.delta;
          dx[j] = grad_input_term(c, centred, g);
          if constexpr (kResidual) dx[j] += raw_element<A>(extra_raw[r], j);
          dweight[j] += dy * (centred * c.xscale);
          if constexpr (!kRms) dbias[j] += dy;
        }
        store_pack<Ts, A, kVec>(a.grad_input, first_unit + static_cast<int64_t>(r) * a.units, dx);
      }
    }
    if (a.partial_dweight != nullptr) store_pack<A, A, kVec>(a.partial_dweight + group * a.cols, col_unit, dweight);
    if (!kRms && a.partial_dbias != nullptr) store_pack<A, A, kVec>(a.partial_dbias + group * a.cols, col_unit, dbias);
  };
  if (a.saved_is_output) run(std::true_type{});
  else run(std::false_type{});
}

constexpr int kReduceColumns = 32;  // columns per block of reduce_partials_kernel
constexpr int kReduceSlices = 32;   // threads per column, each summing every kReduceSlices-th partial row

// Sum the [parts, cols] partial buffer over parts into a [cols] output of the parameters' dtype. Thread
// (x, y) of a (32, 32) block sums partial rows y, y + 32, ... of column blockIdx.x * 32 + x in order; the 32
// slice sums are then added pairwise (a tree). The order is fixed by the shape: the same bits on every run.
// The sums are in double, rounded once: in float, a slice's ~parts / 32 additions at the column's full magnitude
// were most of dweight's error (H200, 131073 rows of 8 bf16: 1.7e-4 against ATen's 7e-5).
template <typename Tw, typename A>
__global__ void __launch_bounds__(kReduceColumns * kReduceSlices)
    reduce_partials_kernel(const A* partial, void* out, int64_t parts, int64_t cols) {
  __shared__ double slices[kReduceSlices][kReduceColumns];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceColumns + threadIdx.x;
  double sum = 0.0;
  if (col < cols) {
    for (int64_t part = threadIdx.y; part < parts; part += kReduceSlices) {
      sum += static_cast<double>(load_global(partial + part * cols + col));
    }
  }
  slices[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  for (int half = kReduceSlices / 2; half >= 1; half /= 2) {
    if (threadIdx.y < half) slices[threadIdx.y][threadIdx.x] += slices[threadIdx.y + half][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < cols) {
    store_global(static_cast<Tw*>(out) + col, from_acc<Tw>(static_cast<A>(slices[0][threadIdx.x])));
  }
}

}  // namespace cuda
}  // namespace layernorm_ext
