// What the CUDA kernels of layernorm_ext share (forward_kernels.cuh, backward_kernels.cuh, norm_kernels.cuh):
// the platform (the CUDA toolchain or the tests' host emulation), element types and packs, and the row
// reductions (Welford, Sums, AbsMax states and their all-reduce over a row's threads).
#pragma once

// Platform: the real CUDA toolchain, or (LAYERNORM_EXT_CUDA_EMULATION, tests only) a header that runs these
// very kernels on the host, each CUDA thread a fiber on the calling thread (tests/cuda_emulation/cuda_emulation.h). The
// kernels reach the GPU only through LNX_LAUNCH, LNX_DYNAMIC_SHARED, current_stream() and workspace().
#ifdef LAYERNORM_EXT_CUDA_EMULATION
#include "cuda_emulation.h"  // found through the test build's include path
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cooperative_groups.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

// kernel<<<grid, block, shared bytes, stream>>>(args...)
#define LNX_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<grid, block, shared_bytes, stream>>>
// The block's dynamic shared memory as `unsigned char name[]`, 16-byte aligned.
#define LNX_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
// Global memory traffic, counted by the host emulation (bytes per launch, tests/test_cuda_emulation.py); nothing
// on the GPU.
#define LNX_COUNT_LOAD(bytes) ((void)0)
#define LNX_COUNT_STORE(bytes) ((void)0)
// Device code with thread-block clusters and distributed shared memory (sm_90 on).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LNX_CLUSTERS 1
#else
#define LNX_CLUSTERS 0
#endif

namespace layernorm_ext {
namespace cuda {
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }
// Scratch memory from torch's caching allocator, ordered on the current stream (safe in CUDA graphs).
inline c10::DataPtr workspace(size_t bytes) { return c10::cuda::CUDACachingAllocator::get()->allocate(bytes); }
}  // namespace cuda
}  // namespace layernorm_ext
#endif

// A kernel's register cap beside __launch_bounds__: nvcc 13 only (13.0 honours it on the templated kernels: the
// capped bf16 RMSNorm forward spilled at 96 where it took 104 without). nvcc 13.0 rejects the two qualifiers
// together on a non-template kernel ("cannot be applied to the same kernel"), so this leans on the templates; the
// cap alone (__maxnreg__ without __launch_bounds__) is the sounder form, to move to. Older nvcc and the host
// emulation go by the bounds alone.
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 13
#define LNX_MAX_REGISTERS(n) __maxnreg__(n)
#else
#define LNX_MAX_REGISTERS(n)
#endif

#include <cstdint>
#include <cstring>
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

// a * b + c rounded once (the compiler contracts only a product and a sum of one expression).
__device__ __forceinline__ float fused_multiply_add(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fused_multiply_add(double a, double b, double c) { return __fma_rn(a, b, c); }

// kVec elements of T, aligned for one vector access (16 bytes at most per instruction).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec < 16 ? sizeof(T) * kVec : 16) Pack {
  T v[kVec];
};

template <typename A, typename T, int kVec>
__device__ __forceinline__ void load_pack(const void* base, int64_t unit, A (&out)[kVec]) {
  LNX_COUNT_LOAD(sizeof(Pack<T, kVec>));
  const Pack<T, kVec> pack = reinterpret_cast<const Pack<T, kVec>*>(base)[unit];
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = to_acc<A>(pack.v[j]);
}

template <typename T, typename A, int kVec>
__device__ __forceinline__ void store_pack(void* base, int64_t unit, const A (&in)[kVec]) {
  LNX_COUNT_STORE(sizeof(Pack<T, kVec>));
  Pack<T, kVec> pack;
#pragma unroll
  for (int j = 0; j < kVec; ++j) pack.v[j] = from_acc<T>(in[j]);
  reinterpret_cast<Pack<T, kVec>*>(base)[unit] = pack;
}

// kVec elements of T as loaded: the raw bits in 32-bit words (16-bit ones for a single half element). A load
// fills whole registers that nothing touches until the element's first use; a Pack of 16-bit elements is split
// into a register per element right at the load, which makes the next load wait for this one's data.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec < 16 ? sizeof(T) * kVec : 16) RawPack {
  static constexpr int kBytes = static_cast<int>(sizeof(T)) * kVec;
  using Word = std::conditional_t<kBytes % 4 == 0, uint32_t, uint16_t>;
  Word w[kBytes / sizeof(Word)];
};

template <typename To, typename From>
__device__ __forceinline__ To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}

// Element j of a raw pack in the compute type A (bfloat16 -> float is a shift of its bits: exact).
template <typename A, typename T, int kVec>
__device__ __forceinline__ A raw_element(const RawPack<T, kVec>& r, int j) {
  if constexpr (sizeof(T) == 2) {
    using Word = typename RawPack<T, kVec>::Word;
    const uint32_t word = r.w[j * 2 / static_cast<int>(sizeof(Word))];
    const bool high = sizeof(Word) == 4 && (j & 1) != 0;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return static_cast<A>(bits_as<float>(high ? (word & 0xffff0000u) : (word << 16)));
    } else {
      return static_cast<A>(__half2float(__ushort_as_half(static_cast<unsigned short>(high ? word >> 16 : word & 0xffffu))));
    }
  } else if constexpr (sizeof(T) == 4) {
    return static_cast<A>(bits_as<float>(r.w[j]));
  } else {
    return static_cast<A>(bits_as<double>(static_cast<uint64_t>(r.w[2 * j + 1]) << 32 | r.w[2 * j]));
  }
}

// The kPacks raw packs of a thread, units first_unit + p * stride: the loads are issued one after another, none
// waits for another's data. Packs not `valid` are zeros, or (kZeroAbsent false: the caller reads only valid packs)
// left as they were.
template <typename T, int kVec, int kPacks, bool kZeroAbsent = true>
__device__ __forceinline__ void load_packs(const void* base, int64_t first_unit, int stride,
                                           const bool (&valid)[kPacks], RawPack<T, kVec> (&out)[kPacks]) {
  const RawPack<T, kVec>* packs = reinterpret_cast<const RawPack<T, kVec>*>(base) + first_unit;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    // zeros first, then a predicated load: a select after the load would wait for it
    if constexpr (kZeroAbsent) out[p] = RawPack<T, kVec>{};
    if (valid[p]) {
      LNX_COUNT_LOAD(sizeof(RawPack<T, kVec>));
      out[p] = packs[static_cast<int64_t>(p) * stride];
    }
  }
}

// One value of global memory, loaded or stored (per-row statistics, partial sums), counted like the packs.
template <typename T>
__device__ __forceinline__ T load_global(const T* p) {
  LNX_COUNT_LOAD(sizeof(T));
  return *p;
}

template <typename T>
__device__ __forceinline__ void store_global(T* p, T v) {
  LNX_COUNT_STORE(sizeof(T));
  *p = v;
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

// A LayerNorm warp's sum(d) in the compute type and sum(d^2) in S2 (double where no second round can follow).
template <typename S1, typename S2>
struct SumPair {
  S1 s1;
  S2 s2;
};

template <typename S1, typename S2>
__device__ __forceinline__ SumPair<S1, S2> combine(const SumPair<S1, S2>& x, const SumPair<S1, S2>& y) {
  return {x.s1 + y.s1, x.s2 + y.s2};
}

template <typename S1, typename S2>
__device__ __forceinline__ SumPair<S1, S2> shfl_xor(const SumPair<S1, S2>& s, int offset) {
  return {__shfl_xor_sync(0xffffffffu, s.s1, offset), __shfl_xor_sync(0xffffffffu, s.s2, offset)};
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

// Butterfly all-reduce over `width` lanes (a power of two up to 32, aligned inside the warp); no barrier. A
// run-time width is a loop of 7 instructions a step (sm_90); unrolled under predicates instead, it took 16 more
// registers in the bfloat16 LayerNorm forward (80 -> 96).
template <typename Stat>
__device__ __forceinline__ Stat warp_allreduce(Stat s, int width) {
  for (int offset = 1; offset < width; offset <<= 1) {
    const Stat other = shfl_xor(s, offset);
    const bool upper = (threadIdx.x & offset) != 0;
    s = upper ? combine(other, s) : combine(s, other);
  }
  return s;
}

// The same over a whole warp, unrolled: where the width is 32 on one side of a run-time branch, the compiler
// merged the two calls into the loop.
template <typename Stat>
__device__ __forceinline__ Stat warp_allreduce_32(Stat s) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const Stat other = shfl_xor(s, offset);
    s = (threadIdx.x & offset) != 0 ? combine(other, s) : combine(s, other);
  }
  return s;
}

// All-reduce over the `lanes` threads of one row: a power of two up to 32 (a sub-warp, aligned inside its
// warp), or a multiple of 32 spanning the whole block. Every thread of the block must call it. `scratch`:
// shared memory for one Stat per warp.
template <typename Stat>
__device__ __forceinline__ Stat row_allreduce(Stat s, int lanes, Stat* scratch) {
  s = warp_allreduce(s, lanes < 32 ? lanes : 32);
  if (lanes > 32) {
    const int warp = threadIdx.x / 32;
    const int warps = lanes / 32;
    if ((threadIdx.x & 31) == 0) scratch[warp] = s;
    __syncthreads();
    if ((warps & (warps - 1)) == 0) {
      // A tree over the warps' states (lane w of each group of `warps` lanes takes warp w's): log2(warps)
      // additions per state, where a running merge gave the last warp's 1 / warps of the weight after warps - 1
      // roundings (a float64 row of 32767 copies of 1/3: rstd 4 ulps off).
      s = warp_allreduce(scratch[threadIdx.x & (warps - 1)], warps);
    } else {
      s = scratch[0];
      for (int w = 1; w < warps; ++w) s = combine(s, scratch[w]);
    }
    __syncthreads();  // scratch may be reused by the next reduction
  }
  return s;
}

// A thread's running merge of many states, pairwise: level[k] holds the merge of 2^k consecutive states (a
// binary counter, kept in registers by unrolling), and every 2^kLevels states go into `top` as one. A state then
// meets about kLevels + states / 2^kLevels merges rather than one per state before it: a float64 row of 2^17
// copies of 0.1 over 1024 threads (128 states each) had its rstd 10 ulps off with a running merge.
// kLevels = 0 is the running merge itself. The order of merges depends on the count only (deterministic).
template <typename Stat, int kLevels>
struct PairwiseMerge {
  Stat top{};
  Stat level[kLevels > 0 ? kLevels : 1];
  int count = 0;  // states held in level[], as binary digits

  __device__ __forceinline__ void add(Stat s) {
    if constexpr (kLevels == 0) {
      top = combine(top, s);
    } else {
      bool placed = false;
#pragma unroll
      for (int k = 0; k < kLevels; ++k) {
        if (!placed) {
          if ((count >> k) & 1) {
            s = combine(level[k], s);  // level[k] holds the earlier states: the lower-indexed part first
          } else {
            level[k] = s;
            placed = true;
          }
        }
      }
      if (!placed) top = combine(top, s);
      count = (count + 1) & ((1 << kLevels) - 1);
    }
  }
  // Everything added, earliest first.
  __device__ __forceinline__ Stat total() const {
    Stat out = top;
#pragma unroll
    for (int k = kLevels - 1; k >= 0; --k) {
      if ((count >> k) & 1) out = combine(out, level[k]);
    }
    return out;
  }
};

// Smallest power of two >= v (v <= 2^16), without a loop: the loop took 0.1-0.7 more instructions per element in the
// bf16 LayerNorm forward's merge of 2-16 warps (kernel audit, sm_90).
__device__ __forceinline__ int pow2_at_least(int v) {
  unsigned x = v > 1 ? static_cast<unsigned>(v - 1) : 0u;
  x |= x >> 1;
  x |= x >> 2;
  x |= x >> 4;
  x |= x >> 8;
  return static_cast<int>(x + 1);
}

// The row's sum from its `warps` warps' sums in shared memory: lane w of each group of pow2(warps) lanes takes
// warp w's and the group adds them with butterflies, a fixed order that gives every thread the same bits (one
// barrier, the caller's, before).
template <typename S>
__device__ __forceinline__ S merge_warp_sums(const Sums<S, 1>* scratch, int warps) {
  const int width = pow2_at_least(warps);
  const int part = threadIdx.x & (width - 1);
  return warp_allreduce(Sums<S, 1>{{part < warps ? scratch[part].v[0] : S(0)}}, width).v[0];
}

// All-reduce over the `lanes` threads of one row with at most one barrier: butterflies inside the warp, then
// (a row of several warps) one shared-memory round: lane w of each group of pow2(warps) lanes takes warp w's
// value and the group adds them with butterflies, a fixed order that gives every thread the same bits.
// `scratch` holds one Stat per warp; no second barrier is needed where the next write to it cannot meet this
// round's reads: the caller alternates between two such buffers from row to row, or (row_scaling's absmax) a
// barrier of the block lies between (the next row's statistics' round). Every thread of the block must call it.
// kUnrolled: the butterflies of a whole warp unrolled (the backward's sums: the loop's 3 instructions a step saved;
// in the quantized forward's absmax, ptxas took 10-26 more registers with it).
template <bool kUnrolled = false, typename Stat>
__device__ __forceinline__ Stat row_allreduce_one_barrier(Stat s, int lanes, Stat* scratch) {
  if (kUnrolled && lanes >= 32) s = warp_allreduce_32(s);
  else s = warp_allreduce(s, lanes < 32 ? lanes : 32);
  if (lanes > 32) {
    const int warps = lanes / 32;
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x / 32] = s;
    __syncthreads();
    const int width = pow2_at_least(warps);
    const int part = threadIdx.x & (width - 1);
    s = warp_allreduce(part < warps ? scratch[part] : Stat{}, width);
  }
  return s;
}

// A part of a row (a thread's values, a warp's) as sums about a shift of its own: its count, the shift (a value
// of the rows' compute type), and the sums of d = h - shift and of d^2, in S. Parts with different shifts merge
// without a division (merge_shifted_moments). S is float for float and half rows: the sums of a row that
// overflow it (|d| beyond ~1.8e19, or an infinity or NaN held) are taken again in double, the row's slow path.
template <typename S>
struct ShiftedMoments {
  S n, shift, s1, s2;
};

// The sums of n values about `shift` (s1 = sum(d), s2 = sum(d^2)) recentred on `centre`, exactly as algebra:
// with delta = shift - centre, sum(d + delta) = s1 + n delta and sum((d + delta)^2) = s2 + delta (s1 + s1').
template <typename S>
__device__ __forceinline__ void recentre(S n, S shift, S centre, S& s1, S& s2) {
  const S delta = shift - centre;
  const S moved = s1 + n * delta;
  s2 += delta * (s1 + moved);
  s1 = moved;
}

// A row's mean as centre + rest (centre: a value of the row, near the mean; rest: what it lacks, small) and its
// sum of squared deviations from the mean, M2.
template <typename S>
struct RowMoments {
  S centre, rest, m2;
};

// The row's moments from `parts` ShiftedMoments, part(i) for i < parts, about part 0's shift (the centre):
// rest = sum(n (shift - centre) + s1) / cols, M2 = sum(s2 + dev (2 s1 + n dev)) with dev = shift - centre - rest.
// Up to 32 parts, lane w of each group of pow2(parts) lanes takes part w; beyond, lane l of the warp parts l,
// l + 32, ... in turn; the lanes add with butterflies: every thread gets the same bits. One barrier per row
// (the caller's, before).
template <typename S, typename Part>
__device__ __forceinline__ RowMoments<S> merge_shifted_moments(Part part, int parts, S inv_cols) {
  const int width = parts < 32 ? pow2_at_least(parts) : 32;
  const int first = threadIdx.x & (width - 1);
  const S centre = part(0).shift;
  S total = S(0);
  for (int i = first; i < parts; i += width) {
    const ShiftedMoments<S> w = part(i);
    total += w.n * (w.shift - centre) + w.s1;
  }
  const S rest = warp_allreduce(Sums<S, 1>{{total}}, width).v[0] * inv_cols;
  S deviations = S(0);  // absent parts add nothing (no 0 * inf)
  for (int i = first; i < parts; i += width) {
    const ShiftedMoments<S> w = part(i);
    const S dev = (w.shift - centre) - rest;
    deviations += w.s2 + dev * (S(2) * w.s1 + w.n * dev);
  }
  return {centre, rest, warp_allreduce(Sums<S, 1>{{deviations}}, width).v[0]};
}

// The same in one all-reduce of two sums: the sums of squares about the centre, sum(s2 + a (2 s1 + n a)) with
// a = shift - centre, added beside the rest's, and M2 = that - rest x sum. The centre is within a few of
// the row's standard deviations of its mean (parts' shifts near their own means), so the cancellation costs a
// few bits of the float sums: for 16-bit rows only, whose output's rounding hides them (one loop of shuffles and
// of shared-memory reads fewer: 0.5 instructions per element of the bf16 LayerNorm forward, 8-16 warps).
template <typename S, typename Part>
__device__ __forceinline__ RowMoments<S> merge_shifted_moments_one_pass(Part part, int parts, S inv_cols) {
  const int width = parts < 32 ? pow2_at_least(parts) : 32;
  const int first = threadIdx.x & (width - 1);
  const S centre = part(0).shift;
  Sums<S, 2> sums{{S(0), S(0)}};
  for (int i = first; i < parts; i += width) {
    const ShiftedMoments<S> w = part(i);
    const S a = w.shift - centre;
    sums.v[0] += w.n * a + w.s1;
    sums.v[1] += w.s2 + a * (S(2) * w.s1 + w.n * a);
  }
  sums = warp_allreduce(sums, width);
  const S rest = sums.v[0] * inv_cols;
  return {centre, rest, fused_multiply_add(-rest, sums.v[0], sums.v[1])};
}

// The row's sum from `parts` sums part(i), the same way.
template <typename S, typename Part>
__device__ __forceinline__ S merge_parts_sum(Part part, int parts) {
  const int width = parts < 32 ? pow2_at_least(parts) : 32;
  S total = S(0);
  for (int i = threadIdx.x & (width - 1); i < parts; i += width) total += part(i);
  return warp_allreduce(Sums<S, 1>{{total}}, width).v[0];
}

// Opens the path a row takes only when its float statistics overflowed (or it holds an infinity or NaN): a
// performance-monitor trigger (SASS PMTRIG, no effect on the results), by which a profile and the kernel audit
// (benchmarks/kernel_audit.py, which measures the hot path) tell the slow path from the hot one.
__device__ __forceinline__ void cold_path() {
#if defined(__CUDA_ARCH__)
  asm volatile("pmevent 0;");
#endif
}

// Whether float statistics held: a sum that overflowed float (or an infinity or NaN of the row) leaves M2 not
// finite, and the row's statistics are taken again in double (a branch that every thread of the row takes alike:
// they all hold the same bits).
template <typename S>
__device__ __forceinline__ bool moments_finite(S m2) {
  return !std::is_same_v<S, float> || m2 <= std::numeric_limits<float>::max();
}

// ---- thread-block clusters (sm_90) ----------------------------------------------------------------------

// A barrier over every thread of the block's cluster; it orders their shared-memory accesses, distributed ones
// included. Only for launches on clusters (launch_on_clusters), where the device code has them (LNX_CLUSTERS).
__device__ __forceinline__ void cluster_sync() {
#if LNX_CLUSTERS
  cooperative_groups::this_cluster().sync();
#elif defined(__CUDA_ARCH__)
  __trap();  // the plan launches clusters only for kernels compiled for sm_90 on
#endif
}

// `p`, in this block's shared memory, as the same variable in the shared memory of block `rank` of the cluster.
template <typename T>
__device__ __forceinline__ const T* cluster_shared(const T* p, unsigned rank) {
#if LNX_CLUSTERS
  return cooperative_groups::this_cluster().map_shared_rank(const_cast<T*>(p), rank);
#else
  return p;
#endif
}

// All-reduce over a row that spans a cluster of blocks of kBlockThreads (`parts` warps, every thread of the cluster
// calling it): butterflies in each warp, then one round through distributed shared memory (the cluster's barrier):
// each lane adds every 32nd warp's value in warp order, and the warp's butterfly adds the lanes', the same order in
// every warp, so every thread gets the same bits. `scratch`: this block's one Stat per warp, alternated by the
// caller from row to row. The block size is a constant: a run-time one cost three integer divisions per row.
template <int kBlockThreads, typename Stat>
__device__ __forceinline__ Stat cluster_allreduce(Stat s, int parts, Stat* scratch) {
  constexpr int kBlockWarps = kBlockThreads / 32;
  s = warp_allreduce_32(s);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x / 32] = s;
  cluster_sync();
  Stat sum{};
  for (int i = threadIdx.x & 31; i < parts; i += 32) {
    sum = combine(sum, cluster_shared(scratch, static_cast<unsigned>(i / kBlockWarps))[i % kBlockWarps]);
  }
  return warp_allreduce_32(sum);
}

// The launch configuration of `kernel` on clusters of `cluster` blocks (1 to 16), for cudaLaunchKernelEx and
// cudaOccupancyMaxActiveClusters; beyond 8 it first lets the kernel take non-portable cluster sizes.
struct ClusterLaunch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attribute{};
  ClusterLaunch(const void* kernel, unsigned grid, unsigned threads, size_t shared_bytes, cudaStream_t stream,
                unsigned cluster) {
    if (cluster > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config points at attribute
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// kernel<<<grid, threads, shared_bytes, stream>>>(args...) on clusters of `cluster` blocks.
template <typename... Params, typename... Args>
void launch_on_clusters(void (*kernel)(Params...), unsigned grid, unsigned threads, size_t shared_bytes,
                        cudaStream_t stream, unsigned cluster, Args... args) {
  const ClusterLaunch launch(reinterpret_cast<const void*>(kernel), grid, threads, shared_bytes, stream, cluster);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, args...));
}

constexpr int kMaxRowThreads = 512;   // threads per row of the register paths, and block size of the long path

}  // namespace cuda
}  // namespace layernorm_ext
