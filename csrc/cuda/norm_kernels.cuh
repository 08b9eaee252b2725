// The CUDA kernel family of layernorm_ext: one templated forward and one templated backward serve LayerNorm
// and RMSNorm (template flag kRms), every dtype combination and the fused residual add (a runtime pointer).
// Instantiated by launch_{f32,f64,f16,bf16}.cu, one file per input dtype so that the builds run in parallel.
//
// Mapping, chosen on the host by plan_rows() from the row length in vectors ("units": 16-byte packs when every
// pointer is aligned and cols is a multiple of the pack width, single elements otherwise):
//   - short rows (<= 32 threads x 4 packs): a sub-warp of 4/8/16 lanes or a warp per row, several rows per
//     block of 128 threads, the row held in registers;
//   - medium rows: one block of 64..512 threads per row (a multiple of 32), the row held in registers;
//   - long rows (beyond the registers of 512 threads): one block per row; the forward stages the row in
//     shared memory when it fits, else reads it twice (the second read mostly from L2); the backward reads
//     twice and keeps its dweight/dbias partials in a global buffer row owned by the block.
// Statistics: rows in registers take two passes over them (LayerNorm: the sum for a shift, the rounded mean;
// then the sums of h - shift and of its square; RMSNorm: the sum of squares). Each thread adds its own
// values in the compute type; the threads' sums are added in double over __shfl_xor_sync butterflies, always
// lower lane first so every lane gets the same bits, then across warps through shared memory in warp order.
// Long rows merge per-thread Welford states (count, mean, M2) in double with Chan's formula. rstd is rounded
// once from a double variance. The backward corrects xhat for the stored mean's rounding (delta = mean(d)).
#pragma once

//
// Platform: the real CUDA toolchain, or (LAYERNORM_EXT_CUDA_EMULATION, tests only) a header that runs these
// very kernels on the host, one std::thread per CUDA thread (tests/cuda_emulation/cuda_emulation.h). The
// kernels reach the GPU only through LNX_LAUNCH, LNX_DYNAMIC_SHARED, current_stream() and workspace().
#ifdef LAYERNORM_EXT_CUDA_EMULATION
#include "cuda_emulation.h"  // found through the test build's include path
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

// kernel<<<grid, block, shared bytes, stream>>>(args...)
#define LNX_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<grid, block, shared_bytes, stream>>>
// The block's dynamic shared memory as `unsigned char name[]`, 16-byte aligned.
#define LNX_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

namespace layernorm_ext {
namespace cuda {
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }
// Scratch memory from torch's caching allocator, ordered on the current stream (safe in CUDA graphs).
inline c10::DataPtr workspace(size_t bytes) { return c10::cuda::CUDACachingAllocator::get()->allocate(bytes); }
}  // namespace cuda
}  // namespace layernorm_ext
#endif

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../norm_params.h"
#include "../quant_math.h"

namespace layernorm_ext {
namespace cuda {

// ---- element types -------------------------------------------------------------------------------------

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A, typename T>
__device__ __forceinline__ A to_acc(T v) {
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<A>(__half2float(v));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return static_cast<A>(__bfloat162float(v));
  } else {
    return static_cast<A>(v);
  }
}

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A v) {
  if constexpr (std::is_same_v<T, __half>) {
    if constexpr (std::is_same_v<A, double>) return __double2half(v);
    else return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if constexpr (std::is_same_v<A, double>) return __double2bfloat16(v);
    else return __float2bfloat16_rn(v);
  } else {
    return static_cast<T>(v);
  }
}

// kVec elements of T, aligned for one vector access (16 bytes at most per instruction).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec < 16 ? sizeof(T) * kVec : 16) Pack {
  T v[kVec];
};

template <typename A, typename T, int kVec>
__device__ __forceinline__ void load_pack(const void* base, int64_t unit, A (&out)[kVec]) {
  const Pack<T, kVec> pack = reinterpret_cast<const Pack<T, kVec>*>(base)[unit];
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = to_acc<A>(pack.v[j]);
}

template <typename T, typename A, int kVec>
__device__ __forceinline__ void store_pack(void* base, int64_t unit, const A (&in)[kVec]) {
  Pack<T, kVec> pack;
#pragma unroll
  for (int j = 0; j < kVec; ++j) pack.v[j] = from_acc<T>(in[j]);
  reinterpret_cast<Pack<T, kVec>*>(base)[unit] = pack;
}

// A pack of a tensor whose dtype is known only at run time (the residual: any float dtype). The branch is
// uniform across the grid.
template <typename A, int kVec>
__device__ __forceinline__ void load_pack_dyn(const void* base, ScalarType type, int64_t unit, A (&out)[kVec]) {
  switch (type) {
    case ScalarType::Double: load_pack<A, double, kVec>(base, unit, out); break;
    case ScalarType::Half: load_pack<A, __half, kVec>(base, unit, out); break;
    case ScalarType::BFloat16: load_pack<A, __nv_bfloat16, kVec>(base, unit, out); break;
    default: load_pack<A, float, kVec>(base, unit, out); break;
  }
}

// Correctly rounded reciprocal as a single instruction (the long path's Welford merges): a division would call
// a slow-path subroutine whose call frame costs registers (and spills). rstd is taken as ::rsqrt in double.
__device__ __forceinline__ float reciprocal(float v) { return __frcp_rn(v); }
__device__ __forceinline__ double reciprocal(double v) { return __drcp_rn(v); }

// ---- reductions ------------------------------------------------------------------------------------------

// Welford state of a set of values: count, mean, sum of squared deviations from the mean.
template <typename A>
struct Welford {
  A n, mean, m2;
};

// Chan's merge; `a` is always the lower-indexed part, so the result is the same whichever lane computes it.
template <typename A>
__device__ __forceinline__ Welford<A> combine(const Welford<A>& a, const Welford<A>& b) {
  const A n = a.n + b.n;
  if (n == A(0)) return {A(0), A(0), A(0)};
  const A b_share = b.n * reciprocal(n);
  const A delta = b.mean - a.mean;
  return {n, a.mean + delta * b_share, a.m2 + b.m2 + delta * delta * a.n * b_share};
}

// K running sums (RMSNorm forward: the sum of squares; backward: sum(g), sum(g * d) and, for LayerNorm,
// sum(d)). Addition commutes exactly, so butterflies give every lane the same bits.
template <typename A, int K>
struct Sums {
  A v[K];
};

template <typename A, int K>
__device__ __forceinline__ Sums<A, K> combine(const Sums<A, K>& x, const Sums<A, K>& y) {
  Sums<A, K> r;
#pragma unroll
  for (int k = 0; k < K; ++k) r.v[k] = x.v[k] + y.v[k];
  return r;
}

template <typename A>
__device__ __forceinline__ Welford<A> shfl_xor(const Welford<A>& s, int offset) {
  return {__shfl_xor_sync(0xffffffffu, s.n, offset), __shfl_xor_sync(0xffffffffu, s.mean, offset),
          __shfl_xor_sync(0xffffffffu, s.m2, offset)};
}

template <typename A, int K>
__device__ __forceinline__ Sums<A, K> shfl_xor(const Sums<A, K>& s, int offset) {
  Sums<A, K> r;
#pragma unroll
  for (int k = 0; k < K; ++k) r.v[k] = __shfl_xor_sync(0xffffffffu, s.v[k], offset);
  return r;
}

// A row's max |y| for the dynamic quantization scale; NaN wins (quant_math.h), so any order gives the same.
struct AbsMax {
  float v;
};

__device__ __forceinline__ AbsMax combine(const AbsMax& x, const AbsMax& y) { return {quant::nan_max(x.v, y.v)}; }

__device__ __forceinline__ AbsMax shfl_xor(const AbsMax& s, int offset) {
  return {__shfl_xor_sync(0xffffffffu, s.v, offset)};
}

// All-reduce over the `lanes` threads of one row: a power of two up to 32 (a sub-warp, aligned inside its
// warp), or a multiple of 32 spanning the whole block. Every thread of the block must call it. `scratch`:
// shared memory for one Stat per warp.
template <typename Stat>
__device__ __forceinline__ Stat row_allreduce(Stat s, int lanes, Stat* scratch) {
  const int warp_lanes = lanes < 32 ? lanes : 32;
  for (int offset = 1; offset < warp_lanes; offset <<= 1) {
    const Stat other = shfl_xor(s, offset);
    const bool upper = (threadIdx.x & offset) != 0;
    s = upper ? combine(other, s) : combine(s, other);
  }
  if (lanes > 32) {
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) scratch[warp] = s;
    __syncthreads();
    s = scratch[0];
    for (int w = 1; w < lanes / 32; ++w) s = combine(s, scratch[w]);
    __syncthreads();  // scratch may be reused by the next reduction
  }
  return s;
}

// ---- forward ---------------------------------------------------------------------------------------------

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

constexpr int kMaxRowThreads = 512;   // threads per row of the register paths, and block size of the long path
constexpr int kSmallRowsBlock = 128;  // block size when a (sub-)warp handles a row

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

// ---- backward --------------------------------------------------------------------------------------------

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
  *rstd = a.rstd[row];
  *mean = (rms || a.mean == nullptr) ? A(0) : a.mean[row];
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
        for (int j = 0; j < kVec; ++j) out[blockIdx.x * a.cols + col_unit * kVec + j] = acc[p][j];
      }
    }
  }
}

// Register path, persistent. Thread mapping as forward_rows_kernel (rows_per_block groups of `lanes`
// threads, lane l owns packs l, l + lanes, ...), but the grid is sized to the GPU and each group strides over
// rows. Registers: the row's grad_out, d and g for the lane's packs, and the lane's dweight / dbias partials
// for its columns across all its rows. One all-reduce per row of (sum g, sum g*d, sum d). At the end the
// groups of a block add their partials in group order through shared memory and the block writes one row of
// the [gridDim.x, cols] partial buffers (reduce_partials_kernel finishes the sum in a fixed order).
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec, int kPacks>
__global__ void __launch_bounds__(kMaxRowThreads) backward_rows_kernel(BackwardArgs<acc_t<Ts>> a) {
  using A = acc_t<Ts>;
  using S = BackwardSums<A, kRms>;
  __shared__ S scratch[kMaxRowThreads / 32];
  LNX_DYNAMIC_SHARED(combine_bytes);  // blockDim.x * kPacks * kVec values, when rows_per_block > 1
  A* combine_buf = reinterpret_cast<A*>(combine_bytes);
  const int group = threadIdx.x / a.lanes;
  const int lane = threadIdx.x % a.lanes;
  const bool want_dweight = a.partial_dweight != nullptr;
  const bool want_dbias = a.partial_dbias != nullptr;
  A dweight[kPacks][kVec];
  A dbias[kPacks][kVec];
#pragma unroll
  for (int p = 0; p < kPacks; ++p)
#pragma unroll
    for (int j = 0; j < kVec; ++j) dweight[p][j] = dbias[p][j] = A(0);

  const int64_t row_step = static_cast<int64_t>(gridDim.x) * a.rows_per_block;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * a.rows_per_block; base < a.rows; base += row_step) {
    const int64_t row = base + group;
    const bool row_ok = row < a.rows;
    A mean = A(0), rstd = A(0);
    if (row_ok) row_stats(a, row, kRms, &mean, &rstd);
    A dy[kPacks][kVec], d[kPacks][kVec], g[kPacks][kVec];
    S s{};
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int64_t col_unit = static_cast<int64_t>(p) * a.lanes + lane;
      if (row_ok && col_unit < a.units) {
        backward_load<Tg, Ts, Tw, kRms, A, kVec>(a, row, col_unit, mean, dy[p], d[p], g[p]);
        add_backward_terms<kRms>(s, d[p], g[p]);
      }
    }
    s = row_allreduce(s, a.lanes, scratch);
    const RowCoefficients<A> c = row_coefficients<kRms>(a, rstd, s);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int64_t col_unit = static_cast<int64_t>(p) * a.lanes + lane;
      if (row_ok && col_unit < a.units) {
        A xhat[kVec];
        backward_store<Ts, A, kVec>(a, row, col_unit, c, d[p], g[p], xhat);
        if (want_dweight) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) dweight[p][j] += dy[p][j] * xhat[j];
        }
        if (want_dbias) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) dbias[p][j] += dy[p][j];
        }
      }
    }
  }
  // Block partials: group 0 adds the other groups' values in group order, then writes the block's row.
  if (want_dweight) write_block_partials(a, dweight, a.partial_dweight, combine_buf, group, lane);
  if (want_dbias) write_block_partials(a, dbias, a.partial_dbias, combine_buf, group, lane);
}

// Long-row path, persistent: one block of kMaxRowThreads per row, striding over rows; thread t handles packs
// t, t + blockDim, ... Pass 1 reads grad_out and saved for the row sums (in double, as the forward's long
// path: a thread adds hundreds of packs); pass 2 reads them again (mostly from L2), writes grad_input and adds
// the dweight / dbias terms into the block's own row of the partial buffers, which only thread t ever touches
// at its columns (no atomics; zeroed before the launch).
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads) backward_long_kernel(BackwardArgs<acc_t<Ts>> a) {
  using A = acc_t<Ts>;
  using S = BackwardSums<double, kRms>;
  __shared__ S scratch[kMaxRowThreads / 32];
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    A mean, rstd;
    row_stats(a, row, kRms, &mean, &rstd);
    S s{};
    for (int64_t col_unit = threadIdx.x; col_unit < a.units; col_unit += blockDim.x) {
      A dy[kVec], d[kVec], g[kVec];
      backward_load<Tg, Ts, Tw, kRms, A, kVec>(a, row, col_unit, mean, dy, d, g);
      add_backward_terms<kRms>(s, d, g);
    }
    s = row_allreduce(s, static_cast<int>(blockDim.x), scratch);
    const RowCoefficients<A> c = row_coefficients<kRms>(a, rstd, s);
    for (int64_t col_unit = threadIdx.x; col_unit < a.units; col_unit += blockDim.x) {
      A dy[kVec], d[kVec], g[kVec];
      backward_load<Tg, Ts, Tw, kRms, A, kVec>(a, row, col_unit, mean, dy, d, g);
      A xhat[kVec];
      backward_store<Ts, A, kVec>(a, row, col_unit, c, d, g, xhat);
      const int64_t offset = blockIdx.x * a.cols + col_unit * kVec;
      if (a.partial_dweight != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) a.partial_dweight[offset + j] += dy[j] * xhat[j];
      }
      if (a.partial_dbias != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) a.partial_dbias[offset + j] += dy[j];
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
__global__ void reduce_partials_kernel(const A* partial, void* out, int64_t parts, int64_t cols) {
  __shared__ A slices[kReduceSlices][kReduceColumns];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceColumns + threadIdx.x;
  A sum = A(0);
  if (col < cols) {
    for (int64_t part = threadIdx.y; part < parts; part += kReduceSlices) sum += partial[part * cols + col];
  }
  slices[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  for (int half = kReduceSlices / 2; half >= 1; half /= 2) {
    if (threadIdx.y < half) slices[threadIdx.y][threadIdx.x] += slices[threadIdx.y + half][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < cols) static_cast<Tw*>(out)[col] = from_acc<Tw>(slices[0][threadIdx.x]);
}

// ---- host side: planning and launching -------------------------------------------------------------------

struct RowPlan {
  bool long_path = false;
  int lanes = 0;           // threads per row
  int rows_per_block = 1;  // > 1 only when lanes <= 32
  int packs = 0;           // packs per lane (register paths)
};

// Choose the register mapping for rows of `units` packs, with at most max_packs packs per lane; a long path
// when even kMaxRowThreads lanes cannot hold the row.
inline RowPlan plan_rows(int64_t units, int max_packs) {
  RowPlan plan;
  const int small_packs = std::min(max_packs, 4);
  if (units <= 32 * small_packs) {
    int lanes = 4;
    while (lanes < 32 && static_cast<int64_t>(lanes) * small_packs < units) lanes *= 2;
    int packs = 1;
    while (static_cast<int64_t>(packs) * lanes < units) packs *= 2;
    plan.lanes = lanes;
    plan.packs = packs;
    plan.rows_per_block = kSmallRowsBlock / lanes;
    return plan;
  }
  int64_t best_waste = -1;
  for (int packs : {4, 2, 8, 1}) {  // ties go to the earlier entry: 4 packs balance registers and lanes
    if (packs > max_packs) continue;
    const int64_t lanes = (units + packs - 1) / packs;
    const int64_t lanes_rounded = (lanes + 31) / 32 * 32;
    if (lanes_rounded > kMaxRowThreads) continue;
    const int64_t waste = lanes_rounded * packs - units;
    if (best_waste < 0 || waste < best_waste) {
      best_waste = waste;
      plan.lanes = static_cast<int>(lanes_rounded);
      plan.packs = packs;
    }
  }
  if (best_waste < 0) plan.long_path = true;
  return plan;
}

// Packs per lane a kernel may hold: the forward keeps one row (<= 32 values per lane), the backward three
// rows and two partial rows (<= 16 values per lane); half that in double. Unaligned rows (kVec = 1) use
// at most 4 packs.
template <typename A, int kVec>
constexpr int max_packs(bool backward) {
  constexpr bool kDouble = std::is_same_v<A, double>;
  const int values = backward ? (kDouble ? 8 : 16) : (kDouble ? 16 : 32);
  const int packs = values / kVec;
  const int cap = kVec == 1 ? 4 : 8;  // element-wise accesses: 8 separate 64-bit addresses per array spill
  return packs < cap ? packs : cap;
}

inline bool aligned(const void* p, size_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int device_attribute(cudaDeviceAttr attr) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

inline int64_t grid_for(int64_t groups) { return std::max<int64_t>(1, std::min<int64_t>(groups, 1 << 30)); }

// Persistent grids: as many blocks as fit on the GPU at once, no more than there are row groups.
template <typename Kernel>
int64_t persistent_grid(Kernel kernel, int threads, size_t smem, int64_t groups) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * device_attribute(cudaDevAttrMultiProcessorCount);
  return std::max<int64_t>(1, std::min(groups, resident));
}


template <int kMaxPacks, typename F>
void with_packs(int packs, F&& f) {
  switch (packs) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (kMaxPacks >= 2) { f(std::integral_constant<int, 2>{}); break; } [[fallthrough]];
    case 4: if constexpr (kMaxPacks >= 4) { f(std::integral_constant<int, 4>{}); break; } [[fallthrough]];
    case 8: if constexpr (kMaxPacks >= 8) { f(std::integral_constant<int, 8>{}); break; } [[fallthrough]];
    default: TORCH_INTERNAL_ASSERT(false, "layernorm_ext: no kernel for ", packs, " packs per lane");
  }
}

template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, bool kQuant>
void launch_forward_vec(const NormForwardParams& p, cudaStream_t stream) {
  using A = acc_t<Th>;
  ForwardArgs<A> a;
  a.input = p.input;
  a.residual = p.residual;
  a.weight = p.weight;
  a.bias = p.bias;
  a.out = p.out;
  a.residual_out = p.residual_out;
  a.mean = static_cast<A*>(p.mean);
  a.rstd = static_cast<A*>(p.rstd);
  a.rows = p.rows;
  a.cols = p.cols;
  a.units = p.cols / kVec;
  a.inv_cols = 1.0 / static_cast<double>(p.cols);
  a.eps = p.eps;
  a.weight_offset = static_cast<A>(p.weight_offset);
  a.cast_before_weight = p.cast_before_weight;
  a.residual_type = p.residual_type;
  const QuantArgs q{p.codes, p.scale, p.scale_ub, p.row_scales, p.quant_type == ScalarType::Char};
  constexpr int kMax = max_packs<A, kVec>(false);
  const RowPlan plan = plan_rows(a.units, kMax);
  if (!plan.long_path) {
    a.lanes = plan.lanes;
    a.rows_per_block = plan.rows_per_block;
    const int threads = plan.lanes * plan.rows_per_block;
    const int64_t grid = grid_for((p.rows + plan.rows_per_block - 1) / plan.rows_per_block);
    with_packs<kMax>(plan.packs, [&](auto packs) {
      if constexpr (kQuant) {
        auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, decltype(packs)::value, QuantArgs>;
        LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, 0, stream)(a, q);
      } else {
        auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, decltype(packs)::value>;
        LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, 0, stream)(a);
      }
    });
  } else {
    a.lanes = kMaxRowThreads;
    a.rows_per_block = 1;
    const size_t stage = static_cast<size_t>(p.cols) * sizeof(A);
    // The kernel's static shared memory: its all-reduce scratch (a double Welford state or sum per warp) and
    // the quantized output's absmax scratch.
    constexpr size_t kStaticShared = (sizeof(Welford<double>) + sizeof(AbsMax)) * (kMaxRowThreads / 32);
    const bool staged =
        stage <= static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)) - kStaticShared;
    const unsigned grid = static_cast<unsigned>(grid_for(p.rows));
    auto launch = [&](auto kernel, auto... quant) {
      if (staged) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(stage)));
      }
      LNX_LAUNCH(kernel, grid, kMaxRowThreads, staged ? stage : 0, stream)(a, staged, quant...);
    };
    if constexpr (kQuant) {
      launch(forward_long_kernel<Tin, Th, Tw, kRms, kVec, QuantArgs>, q);
    } else {
      launch(forward_long_kernel<Tin, Th, Tw, kRms, kVec>);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Elements per 16-byte pack of T (at most 8).
template <typename T>
constexpr int pack_width() {
  return 16 / sizeof(T) < 8 ? static_cast<int>(16 / sizeof(T)) : 8;
}

// Whether a tensor of element_size-byte elements can be accessed in packs of kVec elements.
template <int kVec>
bool pack_aligned(const void* p, size_t element_size) {
  return aligned(p, std::min<size_t>(16, element_size * kVec));
}

// Calls f(rms, width) with the call's kernel variant as types: RMSNorm or LayerNorm; packs of kVec elements
// when every pointer allows them, else single elements.
template <int kVec, typename F>
void with_variant(bool rms, bool vectorized, F&& f) {
  auto with_width = [&](auto rms_tag) {
    if (vectorized) f(rms_tag, std::integral_constant<int, kVec>{});
    else f(rms_tag, std::integral_constant<int, 1>{});
  };
  if (rms) with_width(std::true_type{});
  else with_width(std::false_type{});
}

template <typename Tin, typename Th, typename Tw>
void launch_forward(const NormForwardParams& p) {
  constexpr int kVec = pack_width<Tin>();
  const bool vectorized = p.cols % kVec == 0 && pack_aligned<kVec>(p.input, sizeof(Tin)) &&
                          pack_aligned<kVec>(p.out, sizeof(Tin)) && pack_aligned<kVec>(p.weight, sizeof(Tw)) &&
                          pack_aligned<kVec>(p.bias, sizeof(Tw)) &&
                          pack_aligned<kVec>(p.residual, c10::elementSize(p.residual_type)) &&
                          pack_aligned<kVec>(p.residual_out, sizeof(Th)) && pack_aligned<kVec>(p.codes, 1);
  // Quantized output is a kernel variant of its own (kQuant), so that the plain kernels' registers are not
  // sized for its extra pass.
  with_variant<kVec>(p.rms, vectorized, [&](auto rms, auto width) {
    if (p.codes != nullptr) {
      launch_forward_vec<Tin, Th, Tw, decltype(rms)::value, decltype(width)::value, true>(p, current_stream());
    } else {
      launch_forward_vec<Tin, Th, Tw, decltype(rms)::value, decltype(width)::value, false>(p, current_stream());
    }
  });
}

template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec>
void launch_backward_vec(const NormBackwardParams& p, cudaStream_t stream) {
  using A = acc_t<Ts>;
  BackwardArgs<A> a;
  a.grad_out = p.grad_out;
  a.grad_residual_out = p.grad_residual_out;
  a.saved = p.saved;
  a.mean = static_cast<const A*>(p.mean);
  a.rstd = static_cast<const A*>(p.rstd);
  a.weight = p.weight;
  a.bias = p.bias;
  a.grad_input = p.grad_input;
  a.rows = p.rows;
  a.cols = p.cols;
  a.units = p.cols / kVec;
  a.inv_cols = 1.0 / static_cast<double>(p.cols);
  a.weight_offset = static_cast<A>(p.weight_offset);
  a.saved_is_output = p.saved_is_output;
  constexpr int kMax = max_packs<A, kVec>(true);
  const RowPlan plan = plan_rows(a.units, kMax);

  int64_t grid = 0;
  int threads = 0;
  size_t smem = 0;
  auto rows_kernel_for = [&](auto packs) {
    return backward_rows_kernel<Tg, Ts, Tw, kRms, kVec, decltype(packs)::value>;
  };
  if (!plan.long_path) {
    a.lanes = plan.lanes;
    a.rows_per_block = plan.rows_per_block;
    threads = plan.lanes * plan.rows_per_block;
    smem = plan.rows_per_block > 1 ? static_cast<size_t>(threads) * plan.packs * kVec * sizeof(A) : 0;
    const int64_t groups = (p.rows + plan.rows_per_block - 1) / plan.rows_per_block;
    with_packs<kMax>(plan.packs, [&](auto packs) { grid = persistent_grid(rows_kernel_for(packs), threads, smem, groups); });
  } else {
    a.lanes = kMaxRowThreads;
    a.rows_per_block = 1;
    threads = kMaxRowThreads;
    grid = persistent_grid(backward_long_kernel<Tg, Ts, Tw, kRms, kVec>, threads, 0, p.rows);
  }

  // Partial buffers, [grid, cols] each for dweight and (LayerNorm with a bias) dbias, from the caching allocator
  // on the current stream (graph-safe). grid <= the row groups, so the workspace is
  // (dweight + dbias) * min(row groups, resident blocks) * cols * sizeof(A) bytes (README, "Workspace").
  const bool want_dweight = p.grad_weight != nullptr;
  const bool want_dbias = !kRms && p.grad_bias != nullptr;
  const size_t partial_elements = static_cast<size_t>(grid) * p.cols;
  const size_t buffers = static_cast<size_t>(want_dweight) + static_cast<size_t>(want_dbias);
  c10::DataPtr scratch;
  if (buffers > 0) {
    scratch = workspace(buffers * partial_elements * sizeof(A));
    A* base = static_cast<A*>(scratch.get());
    a.partial_dweight = want_dweight ? base : nullptr;
    a.partial_dbias = want_dbias ? base + (want_dweight ? partial_elements : 0) : nullptr;
    if (plan.long_path) {
      C10_CUDA_CHECK(cudaMemsetAsync(base, 0, buffers * partial_elements * sizeof(A), stream));
    }
  } else {
    a.partial_dweight = nullptr;
    a.partial_dbias = nullptr;
  }

  if (!plan.long_path) {
    with_packs<kMax>(plan.packs, [&](auto packs) {
      auto kernel = rows_kernel_for(packs);
      LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, smem, stream)(a);
    });
  } else {
    auto kernel = backward_long_kernel<Tg, Ts, Tw, kRms, kVec>;
    LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, 0, stream)(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const dim3 reduce_block(kReduceColumns, kReduceSlices);
  auto reduce = reduce_partials_kernel<Tw, A>;
  const unsigned reduce_grid = static_cast<unsigned>((p.cols + kReduceColumns - 1) / kReduceColumns);
  if (want_dweight) {
    LNX_LAUNCH(reduce, reduce_grid, reduce_block, 0, stream)(a.partial_dweight, p.grad_weight, grid, p.cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (want_dbias) {
    LNX_LAUNCH(reduce, reduce_grid, reduce_block, 0, stream)(a.partial_dbias, p.grad_bias, grid, p.cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename Tg, typename Ts, typename Tw>
void launch_backward(const NormBackwardParams& p) {
  constexpr int kVec = pack_width<Tg>();
  const bool vectorized = p.cols % kVec == 0 && pack_aligned<kVec>(p.grad_out, sizeof(Tg)) &&
                          pack_aligned<kVec>(p.saved, sizeof(Ts)) && pack_aligned<kVec>(p.grad_input, sizeof(Ts)) &&
                          pack_aligned<kVec>(p.grad_residual_out, sizeof(Ts)) &&
                          pack_aligned<kVec>(p.weight, sizeof(Tw)) && pack_aligned<kVec>(p.bias, sizeof(Tw));
  with_variant<kVec>(p.rms, vectorized, [&](auto rms, auto width) {
    launch_backward_vec<Tg, Ts, Tw, decltype(rms)::value, decltype(width)::value>(p, current_stream());
  });
}

// ---- dtype dispatch --------------------------------------------------------------------------------------

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<Th>{}, Tag<Tw>{}) for the compiled combinations with input (or grad_out) dtype Tin: the row
// dtype is Tin, float32 (for half inputs) or float64; the parameters are Tin's or float32 (for half inputs).
template <typename Tin, typename F>
void dispatch_row_and_param_types(ScalarType row_type, ScalarType param_type, F&& f) {
  constexpr bool kHalfInput = std::is_same_v<Tin, __half> || std::is_same_v<Tin, __nv_bfloat16>;
  auto with_param = [&](auto row_tag) {
    if (kHalfInput && param_type == ScalarType::Float) {
      if constexpr (kHalfInput) f(row_tag, Tag<float>{});
    } else {
      f(row_tag, Tag<Tin>{});
    }
  };
  if (row_type == ScalarType::Double) {
    with_param(Tag<double>{});
  } else if (row_type == ScalarType::Float) {
    if constexpr (!std::is_same_v<Tin, double>) with_param(Tag<float>{});
    else TORCH_INTERNAL_ASSERT(false, "layernorm_ext: float64 input with float32 rows");
  } else {
    if constexpr (kHalfInput) with_param(Tag<Tin>{});
    else TORCH_INTERNAL_ASSERT(false, "layernorm_ext: half rows for a wider input");
  }
}

template <typename Tin>
void forward_for_input(const NormForwardParams& p) {
  dispatch_row_and_param_types<Tin>(p.h_type, p.weight_type, [&](auto h_tag, auto w_tag) {
    launch_forward<Tin, typename decltype(h_tag)::type, typename decltype(w_tag)::type>(p);
  });
}

template <typename Tg>
void backward_for_grad(const NormBackwardParams& p) {
  dispatch_row_and_param_types<Tg>(p.saved_type, p.weight_type, [&](auto s_tag, auto w_tag) {
    launch_backward<Tg, typename decltype(s_tag)::type, typename decltype(w_tag)::type>(p);
  });
}

}  // namespace cuda
}  // namespace layernorm_ext
