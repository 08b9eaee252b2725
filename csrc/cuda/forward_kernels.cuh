// The forward kernels: forward_rows_kernel (a row in the registers of a sub-warp, a warp or a block) and
// forward_long_kernel (a block per row, staged in shared memory or read twice), with their arguments
// (ForwardArgs, QuantArgs for the quantized output) and per-pack steps. Launched from norm_kernels.cuh.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "../quant_math.h"
#include "kernel_common.cuh"

namespace layernorm_ext {
namespace cuda {

template <typename A>
struct ForwardArgs {
  const void* input;
  const void* residual;  // nullptr: no fused add
  const void* weight;
  const void* bias;
  void* out;
  void* residual_out;
  A* mean;  // nullptr for RMSNorm
  A* rstd;
  int64_t rows;
  int64_t cols;
  int64_t units;    // cols / kVec
  double inv_cols;  // 1 / cols, rounded once on the host
  double eps;
  A weight_offset;          // the scale is weight + weight_offset
  bool cast_before_weight;  // xhat rounded to the output dtype before the affine (Llama's order)
  ScalarType residual_type;
  int lanes;         // threads per row
  int rows_per_block;
};

// Quantized output (quant_math.h): codes (int8 or float8_e4m3fn bytes) instead of out, scaled by the static
// scale or, where scale is nullptr, by the row's dynamic scale (stored to row_scales). Only the quantized
// kernel variants take it, as a parameter of their own: a larger ForwardArgs changes how ptxas allocates the
// plain kernels' registers.
struct QuantArgs {
  void* codes;
  const float* scale;
  const float* scale_ub;  // nullptr: no cap
  float* row_scales;
  bool int8;
};

// The kernels' optional QuantArgs parameter (a pack of none or one), unpacked where there is one.
__device__ __forceinline__ const QuantArgs& quant_args(const QuantArgs& q) { return q; }

// h for one pack: the input, or round_to_Th(input + residual) (written to residual_out), in the compute type.
template <typename Tin, typename Th, typename A, int kVec>
__device__ __forceinline__ void load_h(const ForwardArgs<A>& a, int64_t unit, A (&h)[kVec]) {
  load_pack<A, Tin, kVec>(a.input, unit, h);
  if (a.residual != nullptr) {
    A r[kVec];
    load_pack_dyn<A, kVec>(a.residual, a.residual_type, unit, r);
    Pack<Th, kVec> rounded;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      rounded.v[j] = from_acc<Th>(h[j] + r[j]);
      h[j] = to_acc<A>(rounded.v[j]);
    }
    reinterpret_cast<Pack<Th, kVec>*>(a.residual_out)[unit] = rounded;
  }
}

// A row's statistics as the normalization uses them: xhat = ((h - shift) - corr) * rstd (LayerNorm; h - shift
// is exact near the mean and corr the small rest of the mean) or h * rstd (RMSNorm).
template <typename A>
struct RowStats {
  A shift, corr, rstd;
};

// y = xhat * scale + bias (LayerNorm) or xhat * scale (RMSNorm), scale = weight + weight_offset, for one
// pack; with cast_before_weight xhat is rounded to the output dtype first.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void normalize_pack(const ForwardArgs<A>& a, int64_t col_unit, const A (&h)[kVec],
                                               const RowStats<A>& st, A (&y)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) y[j] = kRms ? h[j] * st.rstd : ((h[j] - st.shift) - st.corr) * st.rstd;
  if (a.weight != nullptr) {
    if (a.cast_before_weight) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = to_acc<A>(from_acc<Tin>(y[j]));
    }
    A w[kVec];
    load_pack<A, Tw, kVec>(a.weight, col_unit, w);
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] *= w[j] + a.weight_offset;
  }
  if (!kRms && a.bias != nullptr) {
    A b[kVec];
    load_pack<A, Tw, kVec>(a.bias, col_unit, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] += b[j];
  }
}

// out for one pack.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void normalize_store(const ForwardArgs<A>& a, int64_t row, int64_t col_unit,
                                                const A (&h)[kVec], const RowStats<A>& st) {
  A y[kVec];
  normalize_pack<Tin, Tw, kRms, A, kVec>(a, col_unit, h, st, y);
  store_pack<Tin, A, kVec>(a.out, row * a.units + col_unit, y);
}

// One pack of the output as the unquantized op returns it (rounded to Tin), as float: what gets quantized.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void output_floats(const ForwardArgs<A>& a, int64_t col_unit, const A (&h)[kVec],
                                              const RowStats<A>& st, float (&f)[kVec]) {
  A y[kVec];
  normalize_pack<Tin, Tw, kRms, A, kVec>(a, col_unit, h, st, y);
#pragma unroll
  for (int j = 0; j < kVec; ++j) f[j] = static_cast<float>(to_acc<A>(from_acc<Tin>(y[j])));
}

// absmax folded with the pack's |output| values.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ float fold_absmax(const ForwardArgs<A>& a, int64_t col_unit, const A (&h)[kVec],
                                             const RowStats<A>& st, float absmax) {
  float f[kVec];
  output_floats<Tin, Tw, kRms, A, kVec>(a, col_unit, h, st, f);
#pragma unroll
  for (int j = 0; j < kVec; ++j) absmax = quant::nan_max(absmax, fabsf(f[j]));
  return absmax;
}

// The quantized codes of one pack, given the row's 1 / scale.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void quantize_store(const ForwardArgs<A>& a, const QuantArgs& q, int64_t row,
                                               int64_t col_unit, const A (&h)[kVec], const RowStats<A>& st,
                                               float inv_scale) {
  float f[kVec];
  output_floats<Tin, Tw, kRms, A, kVec>(a, col_unit, h, st, f);
  Pack<uint8_t, kVec> codes;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    codes.v[j] = q.int8 ? static_cast<uint8_t>(quant::to_int8(f[j] * inv_scale)) : quant::to_e4m3fn(f[j] * inv_scale);
  }
  reinterpret_cast<Pack<uint8_t, kVec>*>(q.codes)[row * a.units + col_unit] = codes;
}

// The row's 1 / scale for its codes: the static scale's, or the dynamic one from the row's absmax (each
// thread's own, all-reduced over the row's `lanes` threads), which `writer` stores. In dynamic mode every
// thread of the block must call it (the all-reduce).
__device__ __forceinline__ float row_inv_scale(const QuantArgs& q, int64_t row, bool writer, float absmax, int lanes,
                                               AbsMax* scratch) {
  if (q.scale != nullptr) return 1.0f / *q.scale;
  absmax = row_allreduce(AbsMax{absmax}, lanes, scratch).v;
  const float scale = quant::dynamic_scale(absmax, q.scale_ub, q.int8);
  if (writer) q.row_scales[row] = scale;
  return 1.0f / scale;
}

// The row's statistics from its mean, given as shift + mean_rest (shift of the compute type, the rest in
// double), and its (biased) variance, or mean square for RMSNorm, in double. eps and the reciprocal square
// root are taken in double, so that rstd is rounded once: dx is proportional to rstd, and for short rows
// (N = 1: dx is proportional to 1 - xhat^2) sensitive to every rounding of it. The stored mean is rounded once
// too. `writer` stores them for the backward.
template <bool kRms, typename A>
__device__ __forceinline__ RowStats<A> finish_stats(const ForwardArgs<A>& a, int64_t row, bool writer, A shift,
                                                    double mean_rest, double var) {
  RowStats<A> st;
  st.shift = shift;
  st.corr = static_cast<A>(mean_rest);
  st.rstd = static_cast<A>(::rsqrt((var < 0.0 ? 0.0 : var) + a.eps));  // NaN stays NaN: it poisons the row
  if (writer && a.rstd != nullptr) {  // the inference ops store no statistics (mean and rstd both nullptr)
    if (!kRms) a.mean[row] = static_cast<A>(static_cast<double>(shift) + mean_rest);
    a.rstd[row] = st.rstd;
  }
  return st;
}

// Register path. Thread mapping: block = rows_per_block groups of `lanes` threads; group g handles row
// blockIdx.x * rows_per_block + g (grid-striding); lane l holds packs l, l + lanes, ... (kPacks of them) of
// the row in registers as the compute type. Statistics in two passes over the registers: LayerNorm
// all-reduces the row's sum for a shift (the mean, rounded), then the sums of d = h - shift and d^2 (exact
// centring: no Welford divisions, and a variance free of the mean's rounding); RMSNorm the sum of squares.
// Each lane adds its own values in the compute type, the lanes' sums are added in double. Then each lane
// normalizes the values it holds. kQuant (quantized output): the lane computes its output values twice from
// the registers, folding their absmax (all-reduced like the sums) for a dynamic scale, then stores codes.
template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, int kPacks, typename... Quant>
__global__ void __launch_bounds__(kMaxRowThreads) forward_rows_kernel(ForwardArgs<acc_t<Th>> a, Quant... quant) {
  using A = acc_t<Th>;
  constexpr bool kQuant = sizeof...(Quant) == 1;
  using Moments = Sums<double, kRms ? 1 : 2>;
  __shared__ Sums<A, 1> shift_scratch[kMaxRowThreads / 32];
  __shared__ Moments scratch[kMaxRowThreads / 32];
  const int group = threadIdx.x / a.lanes;
  const int lane = threadIdx.x % a.lanes;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * a.rows_per_block;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * a.rows_per_block; base < a.rows; base += row_step) {
    const int64_t row = base + group;
    const bool row_ok = row < a.rows;
    A h[kPacks][kVec];
    int held = 0;  // packs this lane holds (the first `held`)
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int64_t unit = static_cast<int64_t>(p) * a.lanes + lane;
      if (row_ok && unit < a.units) {
        load_h<Tin, Th, A, kVec>(a, row * a.units + unit, h[p]);
        ++held;
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) h[p][j] = A(0);
      }
    }
    A shift = A(0);
    if constexpr (!kRms) {
      A sum = A(0);  // absent packs are zeros
#pragma unroll
      for (int p = 0; p < kPacks; ++p)
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum += h[p][j];
      const Sums<A, 1> total = row_allreduce(Sums<A, 1>{{sum}}, a.lanes, shift_scratch);
      shift = static_cast<A>(static_cast<double>(total.v[0]) * a.inv_cols);
    }
    A first = A(0), second = A(0);  // LayerNorm: sum(d), sum(d^2); RMSNorm: sum(h^2)
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (p < held) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const A d = h[p][j] - shift;
          first += d;
          second += d * d;
        }
      }
    }
    double first_sum = static_cast<double>(first), second_sum = static_cast<double>(second);
    if constexpr (!std::is_same_v<A, double>) {
      // Float squares overflow beyond |d| ~ 1.8e19 (ATen's float statistics give 0 or NaN there): this lane's
      // sums again in double from its registers, only where they overflowed (or an infinity is held).
      if (second > std::numeric_limits<A>::max()) {
        first_sum = second_sum = 0.0;
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          if (p < held) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              const double d = static_cast<double>(h[p][j]) - static_cast<double>(shift);
              first_sum += d;
              second_sum += d * d;
            }
          }
        }
      }
    }
    Moments m;
    if constexpr (kRms) {
      m.v[0] = second_sum;
    } else {
      m.v[0] = first_sum;
      m.v[1] = second_sum;
    }
    m = row_allreduce(m, a.lanes, scratch);
    RowStats<A> st;
    if constexpr (kRms) {
      st = finish_stats<kRms>(a, row, row_ok && lane == 0, A(0), 0.0, m.v[0] * a.inv_cols);
    } else {
      const double rest = m.v[0] * a.inv_cols;  // mean(d): what the shift lacks of the mean
      st = finish_stats<kRms>(a, row, row_ok && lane == 0, shift, rest, m.v[1] * a.inv_cols - rest * rest);
    }
    if constexpr (!kQuant) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        if (p < held) {
          normalize_store<Tin, Tw, kRms, A, kVec>(a, row, static_cast<int64_t>(p) * a.lanes + lane, h[p], st);
        }
      }
    } else {
      // Quantized output: the output values twice from the registers, for the absmax (dynamic scale), then
      // for the codes.
      __shared__ AbsMax absmax_scratch[kMaxRowThreads / 32];
      const QuantArgs& q = quant_args(quant...);
      float absmax = 0.0f;
      if (q.scale == nullptr) {
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          if (p < held) {
            absmax = fold_absmax<Tin, Tw, kRms, A, kVec>(a, static_cast<int64_t>(p) * a.lanes + lane, h[p], st, absmax);
          }
        }
      }
      const float inv_scale = row_inv_scale(q, row, row_ok && lane == 0, absmax, a.lanes, absmax_scratch);
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        if (p < held) {
          quantize_store<Tin, Tw, kRms, A, kVec>(a, q, row, static_cast<int64_t>(p) * a.lanes + lane, h[p], st,
                                                 inv_scale);
        }
      }
    }
  }
}

// Long-row path. Thread mapping: one block of kMaxRowThreads per row (grid-striding over rows); thread t
// handles packs t, t + blockDim, ... Pass 1 reads h once, merges each pack's Welford state into the
// thread's (sum of squares for RMSNorm) and, when the row fits (dynamic shared memory given), stages h in
// shared memory as the compute type. Block all-reduce; pass 2 normalizes from shared memory, or re-reads
// the row (the input, or residual_out that the same thread wrote in pass 1). kQuant: a pass more, the same
// way, for the absmax of a dynamic scale, before the pass that stores the codes.
// A thread merges hundreds of packs one after another (2^20 columns: 256 per thread), so its statistics and
// the all-reduce are kept in double: in float the mean and rstd of such rows drift by tens of ulps, which
// shows in dweight when only a row or two contribute.
template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, typename... Quant>
__global__ void __launch_bounds__(kMaxRowThreads) forward_long_kernel(ForwardArgs<acc_t<Th>> a, bool staged,
                                                                      Quant... quant) {
  using A = acc_t<Th>;
  constexpr bool kQuant = sizeof...(Quant) == 1;
  using W = double;
  using Stat = std::conditional_t<kRms, Sums<W, 1>, Welford<W>>;
  __shared__ Stat scratch[kMaxRowThreads / 32];
  LNX_DYNAMIC_SHARED(stage_bytes);
  A* stage = reinterpret_cast<A*>(stage_bytes);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    Stat s = Stat{};
    for (int64_t unit = threadIdx.x; unit < a.units; unit += blockDim.x) {
      A h[kVec];
      load_h<Tin, Th, A, kVec>(a, row * a.units + unit, h);
      if constexpr (kRms) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) s.v[0] += static_cast<W>(h[j]) * static_cast<W>(h[j]);
      } else {
        W sum = W(0);
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum += static_cast<W>(h[j]);
        const W mean = sum * (W(1) / W(kVec));  // kVec is a power of two: exact
        W m2 = W(0);
#pragma unroll
        for (int j = 0; j < kVec; ++j) m2 += (static_cast<W>(h[j]) - mean) * (static_cast<W>(h[j]) - mean);
        s = combine(s, Welford<W>{W(kVec), mean, m2});
      }
      if (staged) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) stage[unit * kVec + j] = h[j];
      }
    }
    s = row_allreduce(s, static_cast<int>(blockDim.x), scratch);  // also orders the staging writes
    RowStats<A> st;
    if constexpr (kRms) {
      st = finish_stats<kRms>(a, row, threadIdx.x == 0, A(0), 0.0, s.v[0] * a.inv_cols);
    } else {
      const A shift = static_cast<A>(s.mean);
      st = finish_stats<kRms>(a, row, threadIdx.x == 0, shift, s.mean - static_cast<double>(shift), s.m2 * a.inv_cols);
    }
    // h of a pack again: from the stage, or re-read (residual_out was written by this very thread).
    auto reload = [&](int64_t unit, A (&h)[kVec]) {
      if (staged) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) h[j] = stage[unit * kVec + j];
      } else if (a.residual != nullptr) {
        load_pack<A, Th, kVec>(a.residual_out, row * a.units + unit, h);
      } else {
        load_pack<A, Tin, kVec>(a.input, row * a.units + unit, h);
      }
    };
    if constexpr (!kQuant) {
      for (int64_t unit = threadIdx.x; unit < a.units; unit += blockDim.x) {
        A h[kVec];
        reload(unit, h);
        normalize_store<Tin, Tw, kRms, A, kVec>(a, row, unit, h, st);
      }
    } else {
      // Quantized output: a pass for the absmax (dynamic scale), then one for the codes.
      __shared__ AbsMax absmax_scratch[kMaxRowThreads / 32];
      const QuantArgs& q = quant_args(quant...);
      float absmax = 0.0f;
      if (q.scale == nullptr) {
        for (int64_t unit = threadIdx.x; unit < a.units; unit += blockDim.x) {
          A h[kVec];
          reload(unit, h);
          absmax = fold_absmax<Tin, Tw, kRms, A, kVec>(a, unit, h, st, absmax);
        }
      }
      const float inv_scale =
          row_inv_scale(q, row, threadIdx.x == 0, absmax, static_cast<int>(blockDim.x), absmax_scratch);
      for (int64_t unit = threadIdx.x; unit < a.units; unit += blockDim.x) {
        A h[kVec];
        reload(unit, h);
        quantize_store<Tin, Tw, kRms, A, kVec>(a, q, row, unit, h, st, inv_scale);
      }
    }
    if (staged) __syncthreads();  // the next row overwrites the stage
  }
}

}  // namespace cuda
}  // namespace layernorm_ext
