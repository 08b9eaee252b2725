// The forward kernels: forward_rows_kernel (a row in the registers of a sub-warp, a warp or a block) and
// forward_long_kernel (a block per row, staged in shared memory or read twice), with their arguments
// (ForwardArgs, QuantArgs for the quantized output) and per-pack steps. Launched from norm_kernels.cuh.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "../quant_math.h"
#include "../row_layout.h"
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

// Quantized output (quant_math.h): codes (int8, float8_e4m3fn or float8_e5m2 bytes) instead of out, scaled by the static
// scale or, where scale is nullptr, by the row's dynamic scale (stored to row_scales). Only the quantized
// kernel variants take it, as a parameter of their own: a larger ForwardArgs changes how ptxas allocates the
// plain kernels' registers.
// Per group (group_units > 0; quant_math.h): each group of group_units consecutive packs of a row (a power of two
// up to 32, so that a group's packs sit in lanes of one warp, or, in a sub-warp row, in packs of its own lanes)
// gets its scale from its own absmax: float32 scales in row_scales (strided), or MX (e8m0) / NVFP4 (e4m3fn) bits in
// block_scales (strided or swizzled). NVFP4 (code kE2m1): scale is the global scale and codes hold two per byte.
struct QuantArgs {
  void* codes;
  const float* scale;
  const float* scale_ub;  // nullptr: no cap
  float* row_scales;
  quant::Code code;
  int group_units = 0;
  int64_t groups = 0;  // per row
  uint8_t* block_scales = nullptr;
  int64_t scale_row_stride = 0, scale_group_stride = 0;
  bool swizzled = false;
};
// The register path's per-group variant takes its QuantArgs as this type: per-token and per-group rows are kernels
// of their own, so that the per-token one (vLLM's rms_norm_dynamic_per_token_quant) does not pay the per-group
// path's registers (ptxas sm_90, bf16 RMSNorm rows with a float weight at 4 packs: 124 with it, 64 without, the
// rows' layouts included).
struct GroupQuantArgs : QuantArgs {};

// Strided rows (issue 24, row_layout.h): each operand's rows' layout in units (kVec elements; the launcher checks
// that the strides are whole units). The register path's variants with a residual always take it (a contiguous call
// passes packed layouts: a product per operand and row, where the packed variant shares one), so that they need no
// strided twins in the build; the plain variant has a twin that takes it beside its packed one, which indexes every
// operand at row * units. The quantized variants (per token, per group) always take it too, after their QuantArgs
// (out: the codes' rows, in packs of codes: kVec bytes, NVFP4's kVec / 2).
struct StridedRows {
  RowLayout input, residual, out, residual_out;
};

// The kernels' optional trailing parameters (none; StridedRows; or QuantArgs or GroupQuantArgs, then StridedRows),
// unpacked where there are some.
__device__ __forceinline__ const QuantArgs& quant_args(const QuantArgs& q) { return q; }
__device__ __forceinline__ const QuantArgs& quant_args(const QuantArgs& q, const StridedRows&) { return q; }

// Where a row of each operand begins, in units.
struct RowUnits {
  int64_t input, residual, out, residual_out;
};
template <typename A, typename... Extra>
__device__ __forceinline__ RowUnits row_units(const ForwardArgs<A>& a, int64_t row, const Extra&...) {
  const int64_t packed = row * a.units;
  return {packed, packed, packed, packed};
}
template <typename A>
__device__ __forceinline__ RowUnits row_units(const ForwardArgs<A>&, int64_t row, const StridedRows& s) {
  return {s.input.offset32(row), s.residual.offset32(row), s.out.offset32(row), s.residual_out.offset32(row)};
}
// Q: QuantArgs or GroupQuantArgs (a template, so that it is chosen over the packed rows' for both).
template <typename A, typename Q>
__device__ __forceinline__ RowUnits row_units(const ForwardArgs<A>& a, int64_t row, const Q&, const StridedRows& s) {
  return row_units(a, row, s);
}

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

// A row's statistics as the normalization uses them: xhat = (h - shift) * rstd - corr * rstd (LayerNorm, one fused
// multiply-add; h - shift is exact near the mean and corr the small rest of the mean) or h * rstd (RMSNorm).
template <typename A>
struct RowStats {
  A shift, corr, rstd;
};

// A pack's weight and bias as stored (bias: LayerNorm); where the tensor is absent, load_affine's ones and -0
// (LayerNorm) or zeros (RMSNorm: its normalize tests the weight pointer).
template <typename Tw, int kVec>
struct AffinePack {
  RawPack<Tw, kVec> weight, bias;
};

// kVec copies of v as the raw bits of a pack.
template <typename Tw, int kVec>
__device__ __forceinline__ RawPack<Tw, kVec> raw_filled(Tw v) {
  Pack<Tw, kVec> pack;
#pragma unroll
  for (int j = 0; j < kVec; ++j) pack.v[j] = v;
  return bits_as<RawPack<Tw, kVec>>(pack);
}

// LayerNorm's absent weight reads as ones and its absent bias as -0 (y = xhat * 1 + -0 is xhat, its sign kept), so
// that normalize_pack applies both with one fused multiply-add and no branch; RMSNorm's absent weight is a branch.
// kPresent: the caller has tested that the weight (and LayerNorm's bias) are given (plain_output): plain loads.
template <typename Tw, bool kRms, typename A, int kVec, bool kPresent = false>
__device__ __forceinline__ AffinePack<Tw, kVec> load_affine(const ForwardArgs<A>& a, int64_t col_unit) {
  AffinePack<Tw, kVec> wb{};
  if constexpr (kPresent) {
    wb.weight = reinterpret_cast<const RawPack<Tw, kVec>*>(a.weight)[col_unit];
    if constexpr (!kRms) wb.bias = reinterpret_cast<const RawPack<Tw, kVec>*>(a.bias)[col_unit];
    return wb;
  }
  if constexpr (!kRms) {
    wb.weight = raw_filled<Tw, kVec>(from_acc<Tw>(A(1)));
    wb.bias = raw_filled<Tw, kVec>(from_acc<Tw>(-A(0)));
  }
  if (a.weight != nullptr) wb.weight = reinterpret_cast<const RawPack<Tw, kVec>*>(a.weight)[col_unit];
  if (!kRms && a.bias != nullptr) wb.bias = reinterpret_cast<const RawPack<Tw, kVec>*>(a.bias)[col_unit];
  return wb;
}

// y = xhat * scale + bias (LayerNorm) or xhat * scale (RMSNorm), scale = weight + weight_offset, for one
// pack whose weight and bias are already loaded; with `cast` (a.cast_before_weight) xhat is rounded to the
// output dtype first.
// LayerNorm: xhat = fma(h - shift, rstd, -corr * rstd) (the product exact inside the fused multiply-add; corr * rstd,
// small, rounded once per row) and y = fma(xhat, weight + weight_offset, bias), with load_affine's ones and -0 for an
// absent weight or bias: two roundings after h - shift where the separate steps took four, and no branch on them.
// A weight_offset of 0 is not added (a weight of -0 keeps its sign, as in ATen). kPlain: the caller has tested
// (plain_output) that neither `cast` nor the offset applies and that the weight (and LayerNorm's bias) are given
// (nn.LayerNorm, nn.RMSNorm), once per row rather than per pack.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec, bool kPlain = false>
__device__ __forceinline__ void normalize_pack(const ForwardArgs<A>& a, const A (&h)[kVec], const RowStats<A>& st,
                                               const AffinePack<Tw, kVec>& wb, bool cast, A (&y)[kVec]) {
  cast = cast && !kPlain;
  const bool offset = !kPlain && a.weight_offset != A(0);
  if constexpr (kRms) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] = h[j] * st.rstd;
    if (kPlain || a.weight != nullptr) {
      if (cast) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) y[j] = to_acc<A>(from_acc<Tin>(y[j]));
      }
      if (offset) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) y[j] *= raw_element<A>(wb.weight, j) + a.weight_offset;
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) y[j] *= raw_element<A>(wb.weight, j);
      }
    }
  } else {
    const A scaled_corr = st.corr * st.rstd;
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] = fused_multiply_add(h[j] - st.shift, st.rstd, -scaled_corr);
    if (cast && a.weight != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = to_acc<A>(from_acc<Tin>(y[j]));
    }
    if (offset) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        y[j] = fused_multiply_add(y[j], raw_element<A>(wb.weight, j) + a.weight_offset, raw_element<A>(wb.bias, j));
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        y[j] = fused_multiply_add(y[j], raw_element<A>(wb.weight, j), raw_element<A>(wb.bias, j));
      }
    }
  }
}

// Whether a row's output takes normalize_pack's kPlain form: no cast before the weight, a weight_offset of 0, the
// weight (and LayerNorm's bias) given; tested once per row, and the weight and bias then loaded without tests.
template <bool kRms, typename A>
__device__ __forceinline__ bool plain_output(const ForwardArgs<A>& a) {
  return !a.cast_before_weight && a.weight_offset == A(0) && a.weight != nullptr && (kRms || a.bias != nullptr);
}

// out for one pack, at out's unit out_unit.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec, bool kPlain = false>
__device__ __forceinline__ void normalize_store_at(const ForwardArgs<A>& a, int64_t out_unit, const A (&h)[kVec],
                                                   const RowStats<A>& st, const AffinePack<Tw, kVec>& wb, bool cast) {
  A y[kVec];
  normalize_pack<Tin, Tw, kRms, A, kVec, kPlain>(a, h, st, wb, cast, y);
  store_pack<Tin, A, kVec>(a.out, out_unit, y);
}

// out for one pack of a packed row.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec, bool kPlain = false>
__device__ __forceinline__ void normalize_store(const ForwardArgs<A>& a, int64_t row, int64_t col_unit,
                                                const A (&h)[kVec], const RowStats<A>& st,
                                                const AffinePack<Tw, kVec>& wb, bool cast) {
  normalize_store_at<Tin, Tw, kRms, A, kVec, kPlain>(a, row * a.units + col_unit, h, st, wb, cast);
}

// One pack of the output as the unquantized op returns it (rounded to Tin), as float: what gets quantized.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void output_floats(const ForwardArgs<A>& a, const A (&h)[kVec], const RowStats<A>& st,
                                              const AffinePack<Tw, kVec>& wb, float (&f)[kVec]) {
  A y[kVec];
  normalize_pack<Tin, Tw, kRms, A, kVec>(a, h, st, wb, a.cast_before_weight, y);
#pragma unroll
  for (int j = 0; j < kVec; ++j) f[j] = static_cast<float>(to_acc<A>(from_acc<Tin>(y[j])));
}

// absmax folded with the pack's |output| values.
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ float fold_absmax(const ForwardArgs<A>& a, const A (&h)[kVec], const RowStats<A>& st,
                                             const AffinePack<Tw, kVec>& wb, float absmax) {
  float f[kVec];
  output_floats<Tin, Tw, kRms, A, kVec>(a, h, st, wb, f);
#pragma unroll
  for (int j = 0; j < kVec; ++j) absmax = quant::nan_max(absmax, fabsf(f[j]));
  return absmax;
}

// The quantized codes of one pack (code_unit: where its codes go, in units of kVec codes), given how the row's y is
// scaled (quant::scaling: vLLM's divide or multiply).
template <typename Tin, typename Tw, bool kRms, typename A, int kVec>
__device__ __forceinline__ void quantize_store(const ForwardArgs<A>& a, const QuantArgs& q, int64_t code_unit,
                                               const A (&h)[kVec], const RowStats<A>& st,
                                               const AffinePack<Tw, kVec>& wb, quant::Scaling scaling) {
  float f[kVec];
  output_floats<Tin, Tw, kRms, A, kVec>(a, h, st, wb, f);
  Pack<uint8_t, kVec> codes;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float v = quant::scaled(f[j], scaling);
    codes.v[j] = quant::encode(q.code, v);
  }
  reinterpret_cast<Pack<uint8_t, kVec>*>(q.codes)[code_unit] = codes;
}

// How the row's codes are scaled: by the static scale, or by the dynamic one from the row's absmax (each
// thread's own, all-reduced over the row's `lanes` threads), which `writer` stores. In dynamic mode every
// thread of the block must call it (the all-reduce), and a row of several warps takes one barrier: the next row
// writes `scratch` only after its statistics' barrier, which every reader of this row's has passed.
__device__ __forceinline__ quant::Scaling row_scaling(const QuantArgs& q, int64_t row, bool writer, float absmax, int lanes,
                                               AbsMax* scratch) {
  if (q.scale != nullptr) return quant::scaling(*q.scale, /*is_static=*/true, q.code);
  absmax = row_allreduce_one_barrier(AbsMax{absmax}, lanes, scratch).v;
  const float scale = quant::dynamic_scale(absmax, q.scale_ub, q.code);
  if (writer) q.row_scales[row] = scale;
  return quant::scaling(scale, /*is_static=*/false, q.code);
}

// Where the scale of (row, group) goes: the scaled matmuls' swizzled tiles (MX / NVFP4), or the strides.
__device__ __forceinline__ int64_t group_scale_index(const QuantArgs& q, int64_t row, int64_t group) {
  if (!q.swizzled) return row * q.scale_row_stride + group * q.scale_group_stride;
  return quant::swizzled_scale_index(row, group, q.groups);
}

// NVFP4's float32 global scale and its reciprocal, read once per row, not per group: for the compiler, each store
// of a block scale could change *q.scale.
struct GlobalScale {
  float value = 0.0f, inverse = 0.0f;
};
__device__ __forceinline__ GlobalScale nvfp4_global_scale(const QuantArgs& q) {
  if (q.code != quant::Code::kE2m1) return {};
  const float value = *q.scale;
  return {value, quant::reciprocal_or_zero(value)};
}

// How a group's codes are scaled, from its absmax (the same steps as the CPU's quantize_row_as); `first` (the
// thread of the group's first pack) stores its scale.
__device__ __forceinline__ quant::Scaling group_scaling(const QuantArgs& q, GlobalScale global, int64_t row,
                                                        int64_t group, float absmax, bool first) {
  const int64_t at = group_scale_index(q, row, group);
  if (q.block_scales != nullptr) {
    const bool nvfp4 = q.code == quant::Code::kE2m1;
    const uint8_t bits = nvfp4 ? quant::nvfp4_scale_bits(absmax, global.value)
                               : quant::mx_scale_bits(quant::capped(absmax, q.scale_ub), q.code);
    if (first) q.block_scales[at] = bits;
    return nvfp4 ? quant::nvfp4_scaling(bits, global.inverse) : quant::mx_scaling(bits);
  }
  const float scale = quant::dynamic_scale(absmax, q.scale_ub, q.code);
  if (first) q.row_scales[at] = scale;
  return quant::group_scaling(scale);
}

// A pack's absmax over the `width` lanes of its group (a power of two; groups aligned in the row): butterflies in
// the warp, and for a group wider than a warp (its warps in one block: every thread of the block calls this alike)
// one round through shared memory, `scratch[round & 1]` (a value per warp of the block). The caller alternates
// `round` from call to call, so that one barrier a call suffices: a thread writes a buffer again only after the
// next call's barrier, which every reader of the buffer has passed.
__device__ __forceinline__ float group_absmax(float absmax, int width, AbsMax (*scratch)[kMaxRowThreads / 32],
                                              int round) {
  absmax = warp_allreduce(AbsMax{absmax}, width < 32 ? width : 32).v;
  if (width > 32) {
    AbsMax* warps = scratch[round & 1];
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if ((threadIdx.x & 31) == 0) warps[warp] = AbsMax{absmax};
    __syncthreads();
    const int first = warp & ~(width / 32 - 1);
    AbsMax m = warps[first];
    for (int w = 1; w < width / 32; ++w) m = combine(m, warps[first + w]);
    absmax = m.v;
  }
  return absmax;
}

// A row's padding blocks of its last swizzled tile: zeros, as torch's to_blocked pads (the row's writer).
__device__ __forceinline__ void zero_swizzle_padding(const QuantArgs& q, int64_t row) {
  if (!q.swizzled) return;
  for (int64_t group = q.groups; group % 4 != 0; ++group) q.block_scales[group_scale_index(q, row, group)] = 0;
}

// The codes of one pack of a per-group row (unit: its index among the row's packs; out_unit: where the row's codes
// begin, in packs of codes: kVec bytes, NVFP4's kVec / 2), scaled by its group's scaling. NVFP4 packs two codes a
// byte (an even column in the low nibble); with single-element packs a lane takes its odd neighbour's code by a
// shuffle, so every thread of the block must call it alike (`valid`: the pack is this thread's).
template <int kVec>
__device__ __forceinline__ void store_group_codes(const QuantArgs& q, int64_t out_unit, int64_t unit, bool valid,
                                                  const float (&f)[kVec], quant::Scaling scaling) {
  const int64_t at = out_unit + unit;
  if (q.code == quant::Code::kE2m1) {
    uint8_t c[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) c[j] = quant::to_e2m1(quant::scaled(f[j], scaling));
    if constexpr (kVec == 1) {
      const unsigned odd = __shfl_xor_sync(0xffffffffu, static_cast<unsigned>(c[0]), 1);
      if (valid && (unit & 1) == 0) static_cast<uint8_t*>(q.codes)[at / 2] = static_cast<uint8_t>(c[0] | (odd << 4));
    } else {
      Pack<uint8_t, kVec / 2> bytes;
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) bytes.v[j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
      if (valid) reinterpret_cast<Pack<uint8_t, kVec / 2>*>(q.codes)[at] = bytes;
    }
    return;
  }
  if (!valid) return;
  Pack<uint8_t, kVec> codes;
#pragma unroll
  for (int j = 0; j < kVec; ++j) codes.v[j] = quant::encode(q.code, quant::scaled(f[j], scaling));
  reinterpret_cast<Pack<uint8_t, kVec>*>(q.codes)[at] = codes;
}

// The row's statistics from its mean, given as centre + rest (centre a value of the compute type near the
// mean; rest what it lacks, both in S1), and its sum of squared deviations M2 (RMSNorm: of squares) in S2.
// M2 / cols + eps is rounded once, in double, and its reciprocal square root taken in double, so that rstd is
// rounded once: dx is proportional to rstd, and for short rows (N = 1: dx is proportional to 1 - xhat^2)
// sensitive to every rounding of it. The mean is rounded once too, and what that lost (Fast2Sum, exact) is the
// correction that normalize applies after the shift. `writer` stores them for the backward.
template <typename S>
__device__ __forceinline__ S magnitude(S v) {
  return v < S(0) ? -v : v;
}

// The row's statistics from its mean, centre + rest, and M2 (RMSNorm: its sum of squares); lane 0 (writer) stores
// them. The output's RowStats: about the mean (shift: the mean rounded, corr: what the rounding lost, by a two-sum),
// or (kAbout: the caller's values are d = h - about, LayerNorm's 16-bit rows) shift 0 and corr the mean less `about`,
// (centre - about) + rest, both small against the mean and exact to a rounding.
template <bool kRms, bool kAbout = false, typename A, typename S1, typename S2>
__device__ __forceinline__ RowStats<A> finish_stats(const ForwardArgs<A>& a, int64_t row, bool writer, S1 centre,
                                                    S1 rest, S2 m2, A about = A(0)) {
  RowStats<A> st{A(0), A(0), A(0)};
  const double mean_square = static_cast<double>(m2 < S2(0) ? S2(0) : m2);  // NaN stays NaN: it poisons the row
  st.rstd = static_cast<A>(::rsqrt(::fma(mean_square, a.inv_cols, a.eps)));
  if constexpr (kAbout) {
    if (writer && a.rstd != nullptr) {
      a.mean[row] = static_cast<A>(centre + rest);
      a.rstd[row] = st.rstd;
    }
    st.corr = static_cast<A>((centre - static_cast<S1>(about)) + rest);
    return st;
  }
  if constexpr (!kRms) {
    const bool centre_larger = magnitude(centre) >= magnitude(rest);
    const S1 big = centre_larger ? centre : rest, small = centre_larger ? rest : centre;
    st.shift = static_cast<A>(big + small);
    st.corr = static_cast<A>(small - (static_cast<S1>(st.shift) - big));
  }
  if (writer && a.rstd != nullptr) {  // the inference ops store no statistics (mean and rstd both nullptr)
    if (!kRms) a.mean[row] = st.shift;
    a.rstd[row] = st.rstd;
  }
  return st;
}

// Whether a residual of dtype r promotes with the input to rows of dtype Th (norm_checks.cpp,
// residual_out_dtype): the only residual dtypes the register path reads for Th.
template <typename Th>
constexpr bool residual_fits(ScalarType r) {
  if constexpr (std::is_same_v<Th, double>) return true;
  else if constexpr (sizeof(Th) == 4) return r != ScalarType::Double;
  else if constexpr (std::is_same_v<Th, __half>) return r == ScalarType::Half;
  else return r == ScalarType::BFloat16;
}

// h of a thread's packs with a residual of dtype Tr: x (loaded, not yet converted) + the residual, rounded to
// Th and written to residual_out. The residual's loads are all issued before the first addition. The thread's
// first packs: the residual's unit first_unit, residual_out's first_out_unit.
template <typename Tr, typename Tin, typename Th, typename A, int kVec, int kPacks>
__device__ __forceinline__ void add_residual(const ForwardArgs<A>& a, int64_t first_unit, int64_t first_out_unit,
                                             const bool (&valid)[kPacks], const RawPack<Tin, kVec> (&x)[kPacks],
                                             A (&h)[kPacks][kVec]) {
  RawPack<Tr, kVec> r[kPacks];
  load_packs<Tr, kVec, kPacks>(a.residual, first_unit, a.lanes, valid, r);
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    Pack<Th, kVec> rounded;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      rounded.v[j] = from_acc<Th>(raw_element<A>(x[p], j) + raw_element<A>(r[p], j));
      h[p][j] = to_acc<A>(rounded.v[j]);
    }
    if (valid[p]) reinterpret_cast<Pack<Th, kVec>*>(a.residual_out)[first_out_unit + static_cast<int64_t>(p) * a.lanes] = rounded;
  }
}

// h of a thread's kPacks packs (the residual's units first_unit + p * a.lanes, residual_out's first_out_unit +
// p * a.lanes) from their input packs x, loaded raw: x itself, or (kResidual) x + the residual rounded to Th and
// written to residual_out. The residual's dtype is dispatched here, once for all the packs, outside their loops.
template <typename Tin, typename Th, typename A, int kVec, int kPacks, bool kResidual>
__device__ __forceinline__ void h_of_packs(const ForwardArgs<A>& a, int64_t first_unit, int64_t first_out_unit,
                                           const bool (&valid)[kPacks], const RawPack<Tin, kVec> (&x)[kPacks],
                                           A (&h)[kPacks][kVec]) {
  if constexpr (!kResidual) {
#pragma unroll
    for (int p = 0; p < kPacks; ++p)
#pragma unroll
      for (int j = 0; j < kVec; ++j) h[p][j] = raw_element<A>(x[p], j);
  } else {
    // Only the residual dtypes that promote with the input to Th (residual_fits, asserted by the launcher).
    switch (a.residual_type) {
      case ScalarType::Double:
        if constexpr (residual_fits<Th>(ScalarType::Double)) add_residual<double, Tin, Th, A, kVec, kPacks>(a, first_unit, first_out_unit, valid, x, h);
        break;
      case ScalarType::Half:
        if constexpr (residual_fits<Th>(ScalarType::Half)) add_residual<__half, Tin, Th, A, kVec, kPacks>(a, first_unit, first_out_unit, valid, x, h);
        break;
      case ScalarType::BFloat16:
        if constexpr (residual_fits<Th>(ScalarType::BFloat16)) {
          add_residual<__nv_bfloat16, Tin, Th, A, kVec, kPacks>(a, first_unit, first_out_unit, valid, x, h);
        }
        break;
      default:
        if constexpr (residual_fits<Th>(ScalarType::Float)) add_residual<float, Tin, Th, A, kVec, kPacks>(a, first_unit, first_out_unit, valid, x, h);
        break;
    }
  }
}

// Whether the register path loads a row's weight (and bias) with its input, before the statistics: where they fit
// in registers beside the row and the reduction's temporaries. ptxas for sm_90, the kernels without a residual,
// bfloat16 rows of 4 packs of 8 per thread: RMSNorm with its weight early 70 registers; LayerNorm 112 with its
// weight and bias loaded early or all together after the statistics, against 80 with each pack's loaded right
// before its use (which keeps 768 threads per SM resident instead of 512), so LayerNorm loads them late. A float
// weight stays late too: float32 RMSNorm took 72 registers with it early against 48 late (at N = 8192, 512
// threads per SM instead of 1024). (Figures of the kernels' one body then; the full-row body, 96 registers, loads
// the RMSNorm weight late: see forward_rows_kernel.)
template <typename A, typename Tw, bool kRms, int kVec, int kPacks>
constexpr bool early_affine() {
  return kRms && sizeof(Tw) == 2 && kPacks * kVec * static_cast<int>(sizeof(A) + sizeof(Tw)) <= 192;
}

// Register path. Thread mapping: block = rows_per_block groups of `lanes` threads; group g handles row
// blockIdx.x * rows_per_block + g (grid-striding); lane l holds packs l, l + lanes, ... (kPacks of them) of
// the row in registers as the compute type.
// Loads: every 16-byte load of the row (input, residual; RMSNorm's weight where early_affine, in the general body) is
// issued before the first use of any of them, as raw bits; the conversions follow (the residual's dtype is
// dispatched once per row, outside the pack loops), so that a thread keeps all its packs in flight (with the unpack
// of each pack and a run-time residual branch between two loads, a bfloat16 thread kept one 16-byte load in flight).
// Statistics, per warp first (no barrier): LayerNorm all-reduces the warp's sum for a shift (its mean, rounded; of
// its lanes' first packs for 16-bit rows), then the sums of d = h - shift and d^2 (exact centring: no Welford
// divisions, and a variance free of the mean's rounding; 16-bit rows keep d in place of h for the output);
// RMSNorm the sum of squares. Each lane adds its own values in the compute type. A row in one
// (sub-)warp is done there, the lanes' sums of squares added in double (no later round could redo an overflowed
// float sum). A row of several warps adds them in the compute type, takes one shared-memory round
// (double-buffered by row parity: one barrier per row) and merges the warps' moments about warp 0's shift
// (merge_shifted_moments); only a row whose float statistics overflowed (or that holds an infinity or NaN)
// takes them again in double, with a second round. Then each lane normalizes the values it holds. kQuant (quantized output): the lane
// computes its output values twice from the registers, folding their absmax (all-reduced over the row) for a
// dynamic scale, then stores codes.
// kResidual (a.residual given) is a compile-time flag: the kernel without one keeps no registers for the
// residual's packs and no branch on it. Extra: none (packed rows), StridedRows (each operand's rows at their own
// offsets: every plain variant with a residual, and the strided twin without), or QuantArgs (a scale per row) or
// GroupQuantArgs (a scale per group), then StridedRows (codes at out's offsets).
// Two bodies (each_row): where every lane holds all its packs of every row (kFull: 16-bit rows of the common
// hidden sizes) a pack's presence is its row's, one test; elsewhere each pack is tested. In both, the output's
// common case (no cast before the weight, weight offset 0, the weight and bias given: plain_output) is tested once
// per row. sm_90 bf16 instructions per element at N = 2048 (kernel audit, as counted since 2026-12-05): LayerNorm
// 21.1 -> 17.0, RMSNorm 11.8 -> 10.9; the registers are the kernel's, so rows that take the general body (bf16
// N = 768, 1536, 2560) have them too.
// Occupancy: one block of kMaxRowThreads per SM at least (128 registers); two (64 registers) spilled 236 bytes in
// the bfloat16 RMSNorm kernel. 16-bit rows and weights without a residual (the full-row body, and the per-token
// quantized output) at most 96 (forward_rows_registers; with a residual, 96 spilled 2 stores in RMSNorm), which
// keeps 40 KB of loads in flight per SM where their rows take 8 to 32 lanes and 2 blocks of 320 threads at N = 5120
// (the quantized bf16 LayerNorm took 102 without: 30 KB there).
template <typename Tin, typename Th, typename Tw, bool kResidual, bool kGroups>
constexpr int forward_rows_registers() {
  return !kResidual && !kGroups && sizeof(Tin) == 2 && sizeof(Th) == 2 && sizeof(Tw) == 2 ? 96 : 128;
}
template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, int kPacks, bool kResidual, typename... Extra>
__global__ void __launch_bounds__(kMaxRowThreads, 1) LNX_MAX_REGISTERS((forward_rows_registers<
    Tin, Th, Tw, kResidual, (std::is_same_v<Extra, GroupQuantArgs> || ...)>()))
    forward_rows_kernel(ForwardArgs<acc_t<Th>> a, Extra... extra) {
  using A = acc_t<Th>;
  constexpr bool kGroups = (std::is_same_v<Extra, GroupQuantArgs> || ...);
  constexpr bool kQuant = kGroups || (std::is_same_v<Extra, QuantArgs> || ...);
  constexpr bool kDouble = std::is_same_v<A, double>;
  // A row of several warps: the warps' states in the compute type (double-buffered by row parity), and in
  // double for a row whose float statistics overflowed (one buffer: the next row's first barrier separates its
  // writes from this row's reads).
  __shared__ std::conditional_t<kRms, Sums<A, 1>, ShiftedMoments<A>> scratch[2][kMaxRowThreads / 32];
  __shared__ std::conditional_t<kRms, Sums<double, 1>, ShiftedMoments<double>> wide_scratch[kDouble ? 1 : kMaxRowThreads / 32];
  // float64 LayerNorm rows of several warps: the second round's sums (see the merge below).
  constexpr int kDeviationWarps = !kRms && kDouble ? kMaxRowThreads / 32 : 1;
  __shared__ Sums<double, 1> deviations[2][kDeviationWarps];
  constexpr bool kEarlyAffine = early_affine<A, Tw, kRms, kVec, kPacks>();
  const int group = threadIdx.x / a.lanes;
  const int lane = threadIdx.x % a.lanes;
  const int warp_lanes = a.lanes < 32 ? a.lanes : 32;
  const int warps = a.lanes / 32;  // > 1: the row spans the block
  const A inv_cols = static_cast<A>(a.inv_cols);
  // LayerNorm's 16-bit rows, whose output's rounding hides a few ulps of float arithmetic: the shift is the mean of
  // the warp's first packs (all the warp's values elsewhere), and h is replaced by d = h - shift in the statistics'
  // pass, which the output then takes about the warp's shift (RowStats' corr holds the row's mean less it).
  constexpr bool kNarrowRows = !kRms && sizeof(Th) == 2;
  // Values of the row in this thread's warp (the merge's weight of the warp's moments), and the reciprocal of the
  // count of those the shift is the mean of.
  A warp_count = static_cast<A>(a.cols), inv_shift_count = inv_cols;
  if (kNarrowRows) {
    const int64_t left = a.units - (a.lanes > 32 ? lane / 32 * 32 : 0);
    inv_shift_count = reciprocal(static_cast<A>((left < 0 ? 0 : (left < warp_lanes ? left : warp_lanes)) * kVec));
  }
  if (a.lanes > 32) {
    const int64_t warp_first = lane / 32 * 32;
    int64_t count = 0;
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int64_t left = a.units - (static_cast<int64_t>(p) * a.lanes + warp_first);
      count += left < 0 ? 0 : (left < 32 ? left : 32);
    }
    warp_count = static_cast<A>(count * kVec);
    if (!kNarrowRows) inv_shift_count = reciprocal(warp_count);
  }
  int parity = 0;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * a.rows_per_block;
  // kFull: every lane holds all kPacks packs of every row (units == kPacks * lanes), so a pack's presence is its
  // row's, one test for all. Its RMSNorm weight loads late: early, its bf16 rows took 0.8 more instructions per
  // element at the same 96 registers.
  auto each_row = [&](auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    constexpr bool kEarly = kEarlyAffine && !kFull;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * a.rows_per_block; base < a.rows; base += row_step) {
      const int64_t row = base + group;
      const bool row_ok = row < a.rows;
      bool valid[kPacks];  // this lane's packs of the row (absent ones are zeros)
#pragma unroll
      for (int p = 0; p < kPacks; ++p) valid[p] = row_ok && (kFull || p * a.lanes + lane < a.units);
      const RowUnits at = row_units(a, row, extra...);
      RawPack<Tin, kVec> x[kPacks];
      load_packs<Tin, kVec, kPacks>(a.input, at.input + lane, a.lanes, valid, x);
      // The weight is needed only after the statistics: loaded now where the registers allow, its latency hidden
      // behind the row's and the reduction's.
      AffinePack<Tw, kVec> wb[kEarly ? kPacks : 1];
      if constexpr (kEarly) {
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          wb[p] = AffinePack<Tw, kVec>{};
          if (valid[p]) wb[p] = load_affine<Tw, kRms, A, kVec>(a, p * a.lanes + lane);
        }
      }
      A h[kPacks][kVec];
      h_of_packs<Tin, Th, A, kVec, kPacks, kResidual>(a, at.residual + lane, at.residual_out + lane, valid, x, h);
      A shift = A(0);
      if constexpr (!kRms) {
        // The shift, near the warp's mean, is all that exact centring needs: the sums of d below are about it. For
        // 16-bit rows the mean of the warp's first packs (within sqrt(kPacks - 1) of the warp's standard deviation
        // of its mean: at most 2 bits of the float variance's sums lost to cancellation, below the output's
        // rounding), where all the packs' sum took 24 more additions per row (bf16 N = 2048).
        A sum = A(0);  // absent packs are zeros
#pragma unroll
        for (int p = 0; p < (kNarrowRows ? 1 : kPacks); ++p)
#pragma unroll
          for (int j = 0; j < kVec; ++j) sum += h[p][j];
        Sums<A, 1> total{{sum}};
        if (warps > 1) total = warp_allreduce_32(total);  // whole warps: unrolled (a loop took 35 instructions)
        else total = warp_allreduce(total, warp_lanes);
        shift = total.v[0] * inv_shift_count;
        // 16-bit rows keep h - shift in float: a shift beyond 2^119 (or not finite) could make it overflow where
        // the row's values are finite (bf16 values of both signs near its maximum: NaN statistics), so such a row
        // is summed about 0, and its float sums overflow into the double path, which then has its values exact.
        if (kNarrowRows && !(magnitude(shift) <= A(0x1p119f))) shift = A(0);
      }
      A first = A(0), second = A(0);  // LayerNorm: sum(d), sum(d^2); RMSNorm: sum(h^2)
      // kFull: no absent pack in a row that counts, no test. (RMSNorm's absent packs add zeros, but without their
      // test its general body took 104 registers, not 96.)
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        if (kFull || valid[p]) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const A d = h[p][j] - shift;
            if constexpr (!kRms) first += d;
            second += d * d;
            if constexpr (kNarrowRows) h[p][j] = d;  // the output's FADD of h - mean saved (32 a row at bf16 N = 2048)
          }
        }
      }
      // This lane's sums in double, from its registers (float squares overflow beyond |d| ~ 1.8e19, where ATen's
      // float statistics give 0 or NaN).
      auto wide_sums = [&](double& first_wide, double& second_wide) {
        first_wide = second_wide = 0.0;
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          if (valid[p]) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              const double d = kNarrowRows ? static_cast<double>(h[p][j])  // already d
                                           : static_cast<double>(h[p][j]) - static_cast<double>(shift);
              first_wide += d;
              second_wide += d * d;
            }
          }
        }
      };
      RowStats<A> st;
      const bool writer = row_ok && lane == 0;
      if (warps <= 1) {
        // The row in one (sub-)warp: the lanes' sums of squares added in double, the lane's own taken again in
        // double where they overflowed.
        A first_sum = first;
        double second_sum = static_cast<double>(second);
        if (second > std::numeric_limits<A>::max()) {
          double first_wide;
          wide_sums(first_wide, second_sum);
          first_sum = static_cast<A>(first_wide);
        }
        if constexpr (kRms) {
          const double squares = warp_allreduce(Sums<double, 1>{{second_sum}}, warp_lanes).v[0];
          st = finish_stats<kRms>(a, row, writer, A(0), A(0), squares);
        } else {
          const SumPair<A, double> m = warp_allreduce(SumPair<A, double>{first_sum, second_sum}, warp_lanes);
          const A rest = m.s1 * inv_cols;  // mean(d): what the shift lacks of the row's mean
          const double m2 = ::fma(-static_cast<double>(m.s1), static_cast<double>(rest), m.s2);
          st = finish_stats<kRms, kNarrowRows>(a, row, writer, shift, rest, m2, shift);
        }
      } else if constexpr (kRms) {
        A squares = warp_allreduce_32(Sums<A, 1>{{second}}).v[0];
        if ((lane & 31) == 0) scratch[parity][lane / 32] = Sums<A, 1>{{squares}};
        __syncthreads();
        squares = merge_warp_sums(scratch[parity], warps);
        if (moments_finite(squares)) {
          st = finish_stats<kRms>(a, row, writer, A(0), A(0), squares);
        } else if constexpr (!kDouble) {
          cold_path();
          double first_wide, second_wide;
          wide_sums(first_wide, second_wide);
          const double wide = warp_allreduce(Sums<double, 1>{{second_wide}}, 32).v[0];
          if ((lane & 31) == 0) wide_scratch[lane / 32] = Sums<double, 1>{{wide}};
          __syncthreads();
          st = finish_stats<kRms>(a, row, writer, 0.0, 0.0, merge_warp_sums(wide_scratch, warps));
        }
      } else {
        const Sums<A, 2> m = warp_allreduce_32(Sums<A, 2>{{first, second}});
        if ((lane & 31) == 0) scratch[parity][lane / 32] = ShiftedMoments<A>{warp_count, shift, m.v[0], m.v[1]};
        __syncthreads();
        auto warp_part = [&](int i) { return scratch[parity][i]; };
        RowMoments<A> mom = kNarrowRows ? merge_shifted_moments_one_pass(warp_part, warps, inv_cols)
                                        : merge_shifted_moments(warp_part, warps, inv_cols);
        if constexpr (kDouble) {
          // The merged mean keeps an ulp or two of the warps' shifts (1.6 ulps where ATen's is 0.4, rows of 1000
          // float64): the deviations from it, summed from the registers, correct it (a second barrier, float64 only).
          const double row_shift = mom.centre + mom.rest;
          double deviation = 0.0;
#pragma unroll
          for (int p = 0; p < kPacks; ++p) {
            if (valid[p]) {
#pragma unroll
              for (int j = 0; j < kVec; ++j) deviation += h[p][j] - row_shift;
            }
          }
          deviation = warp_allreduce(Sums<double, 1>{{deviation}}, warp_lanes).v[0];
          if ((lane & 31) == 0) deviations[parity][lane / 32] = Sums<double, 1>{{deviation}};
          __syncthreads();
          const double correction = merge_warp_sums(deviations[parity], warps) * a.inv_cols;  // small: 1/cols rounded is enough
          if (correction - correction == 0.0) mom = RowMoments<A>{row_shift, correction, mom.m2};  // a non-finite row keeps its merged mean (inf, NaN)
          st = finish_stats<kRms, kNarrowRows>(a, row, writer, mom.centre, mom.rest, mom.m2, shift);
        } else if (moments_finite(mom.m2)) {
          st = finish_stats<kRms, kNarrowRows>(a, row, writer, mom.centre, mom.rest, mom.m2, shift);
        } else {
          cold_path();
          double first_wide, second_wide;
          wide_sums(first_wide, second_wide);
          const Sums<double, 2> wide = warp_allreduce(Sums<double, 2>{{first_wide, second_wide}}, 32);
          if ((lane & 31) == 0) {
            wide_scratch[lane / 32] = ShiftedMoments<double>{static_cast<double>(warp_count), static_cast<double>(shift),
                                                             wide.v[0], wide.v[1]};
          }
          __syncthreads();
          const RowMoments<double> w = merge_shifted_moments([&](int i) { return wide_scratch[i]; }, warps, a.inv_cols);
          st = finish_stats<kRms, kNarrowRows>(a, row, writer, w.centre, w.rest, w.m2, shift);
        }
      }
      parity ^= 1;  // the next row's round writes the other half: no second barrier
      auto affine = [&](int p) {
        if constexpr (kEarly) return wb[p];
        else return load_affine<Tw, kRms, A, kVec>(a, p * a.lanes + lane);  // valid[p]: the caller's test
      };
      if constexpr (!kQuant) {
        auto store_packs = [&](auto plain_tag) {
          constexpr bool kPlain = decltype(plain_tag)::value;
          if (!kFull || row_ok) {  // kFull: one test for the row's packs
#pragma unroll
            for (int p = 0; p < kPacks; ++p) {
              if (kFull || valid[p]) {
                const int col_unit = p * a.lanes + lane;  // < units: an int
                const AffinePack<Tw, kVec> wb_p = kEarly ? affine(p) : load_affine<Tw, kRms, A, kVec, kPlain>(a, col_unit);
                normalize_store_at<Tin, Tw, kRms, A, kVec, kPlain>(a, at.out + col_unit, h[p], st, wb_p,
                                                                   a.cast_before_weight);
              }
            }
          }
        };
        if (plain_output<kRms>(a)) store_packs(std::true_type{});
        else store_packs(std::false_type{});
      } else if constexpr (kGroups) {
        // Per group: each pack's absmax, all-reduced over the lanes of its group (in a sub-warp row whose groups are
        // wider than its lanes, then over the lane's packs of the group), then its codes from the registers again.
        const QuantArgs& q = quant_args(extra...);
        const int group_lanes = q.group_units < a.lanes ? q.group_units : a.lanes;
        const int group_packs = group_lanes > 32 ? 1 : q.group_units / group_lanes;  // > 1: folded over packs
        const GlobalScale global = nvfp4_global_scale(q);
        float absmax[kPacks];
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          absmax[p] = valid[p] ? fold_absmax<Tin, Tw, kRms, A, kVec>(a, h[p], st, affine(p), 0.0f) : 0.0f;
          absmax[p] = warp_allreduce(AbsMax{absmax[p]}, group_lanes < 32 ? group_lanes : 32).v;
        }
        if (group_lanes > 32) {
          // Groups of several warps' packs, in a block row (lanes a multiple of 32 but not of the group's: a group
          // may span two rounds of packs). A warp's 32 packs of a round lie in one group: their absmax goes to
          // shared memory at the place of those packs in the row (segment p * warps + warp), and each pack takes
          // its group's segments'. The next row's statistics' barrier keeps its writes from this row's reads.
          __shared__ AbsMax segments[kPacks * (kMaxRowThreads / 32)];
          const int warps = a.lanes / 32;
          if ((lane & 31) == 0) {
#pragma unroll
            for (int p = 0; p < kPacks; ++p) segments[p * warps + lane / 32] = AbsMax{absmax[p]};
          }
          __syncthreads();
          const int group_segments = q.group_units / 32;
#pragma unroll
          for (int p = 0; p < kPacks; ++p) {
            if (valid[p]) {
              const int first = (p * a.lanes + lane) / q.group_units * group_segments;
              AbsMax m = segments[first];
              for (int k = 1; k < group_segments; ++k) m = combine(m, segments[first + k]);
              absmax[p] = m.v;
            }
          }
        }
#pragma unroll
        for (int span = 1; span < kPacks; span *= 2) {
          if (span < group_packs) {
            float other[kPacks];
#pragma unroll
            for (int p = 0; p < kPacks; ++p) other[p] = absmax[p ^ span];
#pragma unroll
            for (int p = 0; p < kPacks; ++p) absmax[p] = quant::nan_max(absmax[p], other[p]);
          }
        }
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          const int64_t unit = static_cast<int64_t>(p) * a.lanes + lane;
          float f[kVec] = {};
          if (valid[p]) output_floats<Tin, Tw, kRms, A, kVec>(a, h[p], st, affine(p), f);
          const quant::Scaling scaling =
              group_scaling(q, global, row, unit / q.group_units, absmax[p], valid[p] && unit % q.group_units == 0);
          store_group_codes<kVec>(q, at.out, unit, valid[p], f, scaling);
        }
        if (writer) zero_swizzle_padding(q, row);
      } else {
        // Quantized output: the output values twice from the registers, for the absmax (dynamic scale), then
        // for the codes.
        __shared__ AbsMax absmax_scratch[kMaxRowThreads / 32];
        const QuantArgs& q = quant_args(extra...);
        float absmax = 0.0f;
        if (q.scale == nullptr) {
#pragma unroll
          for (int p = 0; p < kPacks; ++p) {
            if (valid[p]) {
              absmax = fold_absmax<Tin, Tw, kRms, A, kVec>(a, h[p], st, affine(p), absmax);
            }
          }
        }
        const quant::Scaling scaling = row_scaling(q, row, writer, absmax, a.lanes, absmax_scratch);
#pragma unroll
        for (int p = 0; p < kPacks; ++p) {
          if (valid[p]) {
            const int col_unit = p * a.lanes + lane;
            quantize_store<Tin, Tw, kRms, A, kVec>(a, q, at.out + col_unit, h[p], st, affine(p), scaling);
          }
        }
      }
    }
  };
  // The full-row body for 16-bit rows with 16-bit weights (bf16 / fp16 models), whose instructions per element
  // count most. ptxas sm_90 against the one body: float rows, float weights or h took 8 to 29 more registers with
  // it (fewer threads per SM), bf16 LayerNorm 16 (80 -> 96), RMSNorm 32 (64 -> 96). The quantized variants keep one
  // body: each would double their build time for a path of their own.
  if constexpr (!kQuant && sizeof(Tin) == 2 && sizeof(Th) == 2 && sizeof(Tw) == 2) {
    if (a.units == kPacks * a.lanes) {
      each_row(std::true_type{});
      return;
    }
  }
  each_row(std::false_type{});
}

// Long-row path. Thread mapping: a row per cluster of `cluster` = a.lanes / kMaxRowThreads blocks (1, or 2 to 16 on
// sm_90: rows that one block's shared memory cannot stage), grid-striding over rows; thread t of the cluster's
// block c is the row's thread g = c * kMaxRowThreads + t and owns packs g, g + lanes, ..., taken kLongChunk (4) at
// a time: the 16-byte loads of a chunk are all issued before any of them is used.
// Shared memory (dynamic only, so that each block of a cluster has its own): the warps' statistics and absmax (two rounds'
// worth), then the stage (when the row fits, staged): pass 1 writes each pack of h there in the rows' dtype Th (a
// bfloat16 row stays 2 bytes an element: up to ~110K columns in an sm_90 block, 2^18 on a cluster of 4), at
// slot k * kMaxRowThreads + t for the thread's k-th pack, and pass 2 reads it back.
// A thread reads back only the stage slots it wrote itself, so the next row's pass 1 may overwrite them at once:
// the stage needs neither a barrier nor a second buffer (which would halve the rows that fit). Without the
// stage, pass 2 re-reads the row (the input, or residual_out that this very thread wrote in pass 1).
// Statistics of float and half rows, kept in float per thread: each thread sums about a shift of its own (its
// first pack's mean) the packs' sum(d) and sum(d^2), d = h - shift (RMSNorm: sum(h^2)); a chunk's four packs are
// added as a tree and the chunks merged pairwise (PairwiseMerge: the running float sums of hundreds of packs
// drifted by tens of ulps). Then, still in float: recentred on lane 0's shift, added over the warp with
// butterflies, one shared-memory round (double-buffered by row parity: the row's one barrier, a cluster barrier on
// a cluster) and merged without a division (merge_shifted_moments; RMSNorm: merge_parts_sum), every thread reading
// the states of all the row's warps (on a cluster through distributed shared memory: cluster_shared). A row whose
// float statistics overflowed (or that holds an infinity or NaN) takes the same steps again in double, with a
// second barrier, from the threads' sums (those chunks that overflowed float were summed in double). float64 rows
// (never on a cluster): per-pack Welford states in double merged pairwise, a Welford all-reduce (two barriers).
// kQuant: pass 2 twice, for the absmax of a dynamic scale, then for the codes.
constexpr int kLongChunk = 4;
// Shared memory of forward_long_kernel besides the stage: its static part at most (the float64 rows' Welford
// scratch, the quantized output's absmax scratch) and the double-buffered warps' states that open its dynamic
// shared memory.
constexpr size_t kLongStaticShared = (sizeof(Welford<double>) + sizeof(AbsMax)) * (kMaxRowThreads / 32);
constexpr size_t kLongScratchBytes = 2 * (sizeof(ShiftedMoments<double>) + sizeof(AbsMax)) * (kMaxRowThreads / 32);
// Whether forward_long_kernel has the body without per-pack tests (whole chunks): RMSNorm of 16-bit rows and
// weights (its quantized variants keep one body). The planner prefers clusters that make the chunks whole for them.
template <typename Tin, typename Th, typename Tw, bool kRms>
constexpr bool kLongWholeBody = kRms && sizeof(Tin) == 2 && sizeof(Th) == 2 && sizeof(Tw) == 2;

template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, typename... Quant>
__global__ void __launch_bounds__(kMaxRowThreads) forward_long_kernel(ForwardArgs<acc_t<Th>> a, bool staged,
                                                                      bool whole_chunks, Quant... quant) {
  using A = acc_t<Th>;
  constexpr bool kQuant = sizeof...(Quant) == 1;
  constexpr bool kDouble = std::is_same_v<A, double>;
  constexpr int kChunk = kLongChunk;
  constexpr int kWarps = kMaxRowThreads / 32;
  using DoubleStat = std::conditional_t<kRms, Sums<double, 1>, Welford<double>>;  // float64 rows
  using S = std::conditional_t<kDouble, float, A>;                                 // the others' statistics
  using WarpStat = std::conditional_t<kRms, Sums<S, 1>, ShiftedMoments<S>>;
  using WideStat = std::conditional_t<kRms, Sums<double, 1>, ShiftedMoments<double>>;  // their slow path
  using ThreadSums = Sums<A, kRms ? 1 : 2>;
  // Named here, not in the row loop's generic lambda: there g++ 12 (the host emulation) failed on them (an internal
  // compiler error).
  using ThreadMerge = PairwiseMerge<ThreadSums, kDouble ? 0 : 6>;
  using WelfordMerge = PairwiseMerge<DoubleStat, kDouble ? 4 : 0>;
  constexpr size_t kAbsMaxOffset = 2 * sizeof(ShiftedMoments<double>) * kWarps;
  static_assert((2 * sizeof(WarpStat) + sizeof(WideStat)) * kWarps <= kAbsMaxOffset, "the warps' states");
  static_assert(kAbsMaxOffset + 2 * sizeof(AbsMax) * kWarps <= kLongScratchBytes, "the warps' absmax");
  __shared__ DoubleStat double_scratch[kDouble ? kWarps : 1];
  LNX_DYNAMIC_SHARED(shared_bytes);
  WarpStat (*warp_scratch)[kWarps] = reinterpret_cast<WarpStat(*)[kWarps]>(shared_bytes);
  WideStat* wide_scratch = reinterpret_cast<WideStat*>(shared_bytes + 2 * sizeof(WarpStat) * kWarps);
  AbsMax (*warp_absmax)[kWarps] = reinterpret_cast<AbsMax(*)[kWarps]>(shared_bytes + kAbsMaxOffset);
  RawPack<Th, kVec>* stage = reinterpret_cast<RawPack<Th, kVec>*>(shared_bytes + kLongScratchBytes);
  const int lanes = a.lanes;  // threads per row
  const int threads = kMaxRowThreads;
  const int cluster = lanes / threads;
  const int rank = static_cast<int>(blockIdx.x) % cluster;
  const int me = rank * threads + static_cast<int>(threadIdx.x);  // this thread's place among the row's
  const int64_t chunk_step = static_cast<int64_t>(kChunk) * lanes;
  const int64_t slot_step = static_cast<int64_t>(kChunk) * threads;
  const int warp = me / 32;
  // Packs of this thread and values of its warp (units = q lanes + r: the first r threads hold q + 1 packs).
  const int64_t even_packs = a.units / lanes, extra_lanes = a.units % lanes;
  const int64_t thread_packs = even_packs + (me < extra_lanes ? 1 : 0);
  const int64_t warp_extra = extra_lanes - 32 * warp;
  const double warp_values =
      static_cast<double>((32 * even_packs + (warp_extra < 0 ? 0 : (warp_extra < 32 ? warp_extra : 32))) * kVec);
  int parity = 0;
  const int64_t row_step = gridDim.x / cluster;
  // Two bodies, as forward_rows_kernel's: where every chunk of every thread is whole (whole_chunks, the host's:
  // units a multiple of kChunk x lanes, the power-of-two hidden sizes) no pack is tested (kFull); elsewhere each is.
  // RMSNorm of 16-bit rows and weights only: its bf16 instructions per element went 14.7-16.1 -> 11.5-12.8 (sm_90,
  // kernel audit); LayerNorm's 17.9-20.0 -> 17.5-19.9, and its other body took 2 more registers and 0.5 more
  // instructions per element (N = 262144).
  auto each_row = [&](auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    auto chunk_valid = [&](int64_t first, bool (&valid)[kChunk]) {
#pragma unroll
      for (int p = 0; p < kChunk; ++p) valid[p] = kFull || first + static_cast<int64_t>(p) * lanes < a.units;
    };
    for (int64_t row = blockIdx.x / cluster; row < a.rows; row += row_step) {
      const int64_t row_unit = row * a.units;
      // h of a chunk again (pass 2): from the stage (slot: its first pack's), or re-read.
      auto reload = [&](int64_t first, int64_t slot, const bool (&valid)[kChunk], A (&h)[kChunk][kVec]) {
        if (staged) {
#pragma unroll
          for (int p = 0; p < kChunk; ++p) {
            RawPack<Th, kVec> packed{};
            if (valid[p]) packed = stage[slot + static_cast<int64_t>(p) * threads];
#pragma unroll
            for (int j = 0; j < kVec; ++j) h[p][j] = raw_element<A>(packed, j);
          }
        } else if (a.residual != nullptr) {
          RawPack<Th, kVec> packed[kChunk];
          load_packs<Th, kVec, kChunk>(a.residual_out, row_unit + first, lanes, valid, packed);
#pragma unroll
          for (int p = 0; p < kChunk; ++p)
#pragma unroll
            for (int j = 0; j < kVec; ++j) h[p][j] = raw_element<A>(packed[p], j);
        } else {
          RawPack<Tin, kVec> packed[kChunk];
          load_packs<Tin, kVec, kChunk>(a.input, row_unit + first, lanes, valid, packed);
#pragma unroll
          for (int p = 0; p < kChunk; ++p)
#pragma unroll
            for (int j = 0; j < kVec; ++j) h[p][j] = raw_element<A>(packed[p], j);
        }
      };

      // Pass 1: h read once, staged, and summed.
      A shift = A(0);
      ThreadMerge sums;
      double wide_first = 0.0, wide_second = 0.0;  // chunks whose float squares overflowed, summed in double
      bool went_wide = false;
      WelfordMerge welford;  // float64 rows: each pack's state, merged pairwise
      for (int64_t first = me, slot = threadIdx.x; first < a.units; first += chunk_step, slot += slot_step) {
        bool valid[kChunk];
        chunk_valid(first, valid);
        RawPack<Tin, kVec> x[kChunk];
        load_packs<Tin, kVec, kChunk>(a.input, row_unit + first, lanes, valid, x);
        A h[kChunk][kVec];
        if (a.residual != nullptr) h_of_packs<Tin, Th, A, kVec, kChunk, true>(a, row_unit + first, row_unit + first, valid, x, h);
        else h_of_packs<Tin, Th, A, kVec, kChunk, false>(a, row_unit + first, row_unit + first, valid, x, h);
        if (staged) {
#pragma unroll
          for (int p = 0; p < kChunk; ++p) {
            if (!valid[p]) continue;
            RawPack<Th, kVec> packed;
            if constexpr (std::is_same_v<Tin, Th>) {
              if (a.residual == nullptr) packed = x[p];  // the input's bits as loaded
            }
            if (!std::is_same_v<Tin, Th> || a.residual != nullptr) {
              Pack<Th, kVec> rounded;  // h is a value of Th: exact
#pragma unroll
              for (int j = 0; j < kVec; ++j) rounded.v[j] = from_acc<Th>(h[p][j]);
              packed = bits_as<RawPack<Th, kVec>>(rounded);
            }
            stage[slot + static_cast<int64_t>(p) * threads] = packed;
          }
        }
        if constexpr (kDouble) {
#pragma unroll
          for (int p = 0; p < kChunk; ++p) {
            if (!valid[p]) continue;
            if constexpr (kRms) {
              DoubleStat squares{};
#pragma unroll
              for (int j = 0; j < kVec; ++j) squares.v[0] += h[p][j] * h[p][j];
              welford.add(squares);
            } else {
              double sum = 0.0;
#pragma unroll
              for (int j = 0; j < kVec; ++j) sum += h[p][j];
              const double mean = sum * (1.0 / kVec);  // kVec is a power of two: exact
              double m2 = 0.0;
#pragma unroll
              for (int j = 0; j < kVec; ++j) m2 += (h[p][j] - mean) * (h[p][j] - mean);
              welford.add(Welford<double>{double(kVec), mean, m2});
            }
          }
        } else {
          if (!kRms && first == me) {  // the thread's first pack (valid: first < units)
            A sum = A(0);
#pragma unroll
            for (int j = 0; j < kVec; ++j) sum += h[0][j];
            shift = sum * (A(1) / A(kVec));
          }
          ThreadSums part[kChunk];
#pragma unroll
          for (int p = 0; p < kChunk; ++p) {
            part[p] = ThreadSums{};
            if (valid[p]) {
#pragma unroll
              for (int j = 0; j < kVec; ++j) {
                const A d = h[p][j] - shift;
                if constexpr (!kRms) part[p].v[0] += d;
                part[p].v[kRms ? 0 : 1] += d * d;
              }
            }
          }
          static_assert(kChunk == 4, "the chunk's tree");
          ThreadSums chunk = combine(combine(part[0], part[1]), combine(part[2], part[3]));
          if (chunk.v[kRms ? 0 : 1] > std::numeric_limits<A>::max()) {
            // Float squares overflow beyond |d| ~ 1.8e19 (ATen's float statistics give 0 or NaN there), or an
            // infinity is held: this chunk's sums again in double, from the registers.
#pragma unroll
            for (int p = 0; p < kChunk; ++p) {
              if (!valid[p]) continue;
#pragma unroll
              for (int j = 0; j < kVec; ++j) {
                const double d = static_cast<double>(h[p][j]) - static_cast<double>(shift);
                wide_first += d;
                wide_second += d * d;
              }
            }
            chunk = ThreadSums{};
            went_wide = true;
          }
          sums.add(chunk);
        }
      }

      auto row_barrier = [&] {
        if (cluster == 1) __syncthreads();
        else cluster_sync();
      };
      // The row's statistics: one barrier (float64 rows: two).
      RowStats<A> st;
      const bool writer = me == 0;
      if constexpr (kDouble) {
        const DoubleStat s = row_allreduce(welford.total(), lanes, double_scratch);
        if constexpr (kRms) {
          st = finish_stats<kRms>(a, row, writer, 0.0, 0.0, s.v[0]);
        } else {
          st = finish_stats<kRms>(a, row, writer, s.mean, 0.0, s.m2);
        }
      } else {
        const ThreadSums total = sums.total();
        // The warps' states of the row: those of block c at cluster_shared(states, c), warp w of the block at
        // index w (warp c * kWarps + w of the row).
        auto row_warp = [&](const auto* states, int i) {
          return cluster == 1 ? states[i] : cluster_shared(states, static_cast<unsigned>(i / kWarps))[i % kWarps];
        };
        const int parts = lanes / 32;
        const bool lane0 = (threadIdx.x & 31) == 0;
        // A chunk whose float squares overflowed makes the row's float statistics infinite: the slow path, in double.
        const S overflowed = went_wide ? std::numeric_limits<S>::infinity() : S(0);
        if constexpr (kRms) {
          const S squares = warp_allreduce(Sums<S, 1>{{total.v[0] + overflowed}}, 32).v[0];
          if (lane0) warp_scratch[parity][threadIdx.x / 32] = Sums<S, 1>{{squares}};
          row_barrier();
          const S sum = merge_parts_sum<S>([&](int i) { return row_warp(warp_scratch[parity], i).v[0]; }, parts);
          if (moments_finite(sum)) {
            st = finish_stats<kRms>(a, row, writer, S(0), S(0), sum);
          } else {
            cold_path();
            const double wide = warp_allreduce(Sums<double, 1>{{static_cast<double>(total.v[0]) + wide_second}}, 32).v[0];
            if (lane0) wide_scratch[threadIdx.x / 32] = Sums<double, 1>{{wide}};
            row_barrier();
            const double wide_sum = merge_parts_sum<double>([&](int i) { return row_warp(wide_scratch, i).v[0]; }, parts);
            st = finish_stats<kRms>(a, row, writer, 0.0, 0.0, wide_sum);
          }
        } else {
          const A centre = __shfl_sync(0xffffffffu, shift, 0);
          S first_sum = total.v[0], second_sum = total.v[1] + overflowed;
          recentre<S>(static_cast<S>(thread_packs * kVec), shift, centre, first_sum, second_sum);
          const Sums<S, 2> m = warp_allreduce(Sums<S, 2>{{first_sum, second_sum}}, 32);
          if (lane0) warp_scratch[parity][threadIdx.x / 32] = ShiftedMoments<S>{static_cast<S>(warp_values), centre, m.v[0], m.v[1]};
          row_barrier();
          const RowMoments<S> mom = merge_shifted_moments(
              [&](int i) { return row_warp(warp_scratch[parity], i); }, parts, static_cast<S>(a.inv_cols));
          if (moments_finite(mom.m2)) {
            st = finish_stats<kRms>(a, row, writer, mom.centre, mom.rest, mom.m2);
          } else {
            cold_path();
            double first_wide = static_cast<double>(total.v[0]) + wide_first;
            double second_wide = static_cast<double>(total.v[1]) + wide_second;
            recentre<double>(static_cast<double>(thread_packs * kVec), shift, centre, first_wide, second_wide);
            const Sums<double, 2> w = warp_allreduce(Sums<double, 2>{{first_wide, second_wide}}, 32);
            if (lane0) wide_scratch[threadIdx.x / 32] = ShiftedMoments<double>{warp_values, centre, w.v[0], w.v[1]};
            row_barrier();
            const RowMoments<double> wide = merge_shifted_moments(
                [&](int i) { return row_warp(wide_scratch, i); }, parts, a.inv_cols);
            st = finish_stats<kRms>(a, row, writer, wide.centre, wide.rest, wide.m2);
          }
        }
        parity ^= 1;  // the next row's round writes the other half: no second barrier (every thread of the cluster
                      // has read this half before it reaches the next row's barrier)
      }

      // Pass 2: normalize. Each pack's weight and bias are loaded right before their use (they hit L2): loaded for
      // the whole chunk first, they took 128 registers and spilled (ptxas, sm_90, bfloat16 rows with float weights).
      // This thread's share of the row again, a chunk at a time (from the stage, or re-read): body(first, valid, h).
      // kBlockBounds: while any thread of the block has a chunk (a block-uniform loop, for butterflies in the body).
      auto for_each_chunk = [&](auto block_bounds, auto&& body) {
        constexpr bool kBlockBounds = decltype(block_bounds)::value;
        for (int64_t first = me, slot = threadIdx.x; (kBlockBounds ? first - threadIdx.x : first) < a.units;
             first += chunk_step, slot += slot_step) {
          bool valid[kChunk];
          chunk_valid(first, valid);
          A h[kChunk][kVec];
          reload(first, slot, valid, h);
          body(first, valid, h);
        }
      };
      // Every valid pack of this thread's share of the row again: body(unit, h).
      auto for_each_pack = [&](auto&& body) {
        for_each_chunk(std::false_type{}, [&](int64_t first, const bool (&valid)[kChunk], A (&h)[kChunk][kVec]) {
#pragma unroll
          for (int p = 0; p < kChunk; ++p) {
            if (valid[p]) body(first + static_cast<int64_t>(p) * lanes, h[p]);
          }
        });
      };
      if constexpr (!kQuant) {
        auto store_packs = [&](auto plain_tag) {
          for_each_pack([&](int64_t unit, A (&h)[kVec]) {
            constexpr bool kPlain = decltype(plain_tag)::value;
            normalize_store<Tin, Tw, kRms, A, kVec, kPlain>(
                a, row, unit, h, st, load_affine<Tw, kRms, A, kVec, kPlain>(a, unit), a.cast_before_weight);
          });
        };
        if (plain_output<kRms>(a)) store_packs(std::true_type{});
        else store_packs(std::false_type{});
      } else if (quant_args(quant...).group_units > 0) {
        // Per group (a group's packs in lanes of one warp): one pass, its bounds the block's (the butterflies); each
        // pack's absmax all-reduced over its group's lanes, then its codes.
        const QuantArgs& q = quant_args(quant...);
        const GlobalScale global = nvfp4_global_scale(q);
        int round = 0;  // group_absmax's: kChunk (even) a chunk, so every row starts on buffer 0
        for_each_chunk(std::true_type{}, [&](int64_t first, const bool (&valid)[kChunk], A (&h)[kChunk][kVec]) {
#pragma unroll
          for (int p = 0; p < kChunk; ++p, ++round) {
            const int64_t unit = first + static_cast<int64_t>(p) * lanes;
            float f[kVec] = {};
            float absmax = 0.0f;
            if (valid[p]) {
              output_floats<Tin, Tw, kRms, A, kVec>(a, h[p], st, load_affine<Tw, kRms, A, kVec>(a, unit), f);
#pragma unroll
              for (int j = 0; j < kVec; ++j) absmax = quant::nan_max(absmax, fabsf(f[j]));
            }
            absmax = group_absmax(absmax, q.group_units, warp_absmax, round);
            const quant::Scaling scaling =
                group_scaling(q, global, row, unit / q.group_units, absmax, valid[p] && unit % q.group_units == 0);
            store_group_codes<kVec>(q, row * a.units, unit, valid[p], f, scaling);
          }
        });
        if (writer) zero_swizzle_padding(q, row);
      } else {
        // Quantized output: a pass for the absmax (dynamic scale), then one for the codes.
        __shared__ AbsMax absmax_scratch[kMaxRowThreads / 32];
        const QuantArgs& q = quant_args(quant...);
        float absmax = 0.0f;
        if (q.scale == nullptr) {
          for_each_pack([&](int64_t unit, A (&h)[kVec]) {
            absmax = fold_absmax<Tin, Tw, kRms, A, kVec>(a, h, st, load_affine<Tw, kRms, A, kVec>(a, unit), absmax);
          });
        }
        quant::Scaling scaling;
        if constexpr (kDouble) {
          scaling = row_scaling(q, row, writer, absmax, lanes, absmax_scratch);
        } else {
          // The row's absmax over its warps (of every block of the cluster), as its statistics (parity: already
          // the next row's, a buffer of its own).
          if (q.scale == nullptr) {
            absmax = warp_allreduce(AbsMax{absmax}, 32).v;
            const AbsMax* const parts = warp_absmax[parity];
            if ((threadIdx.x & 31) == 0) warp_absmax[parity][threadIdx.x / 32] = AbsMax{absmax};
            row_barrier();
            absmax = 0.0f;
            for (int i = 0; i < lanes / 32; ++i) {  // NaN wins: any order gives the same
              const AbsMax part = cluster == 1 ? parts[i] : cluster_shared(parts, static_cast<unsigned>(i / kWarps))[i % kWarps];
              absmax = quant::nan_max(absmax, part.v);
            }
          }
          scaling = row_scaling(q, row, writer, absmax, 1, absmax_scratch);  // lanes 1: the absmax is the row's
        }
        for_each_pack([&](int64_t unit, A (&h)[kVec]) {
          quantize_store<Tin, Tw, kRms, A, kVec>(a, q, row * a.units + unit, h, st,
                                                 load_affine<Tw, kRms, A, kVec>(a, unit), scaling);
        });
      }
    }
  };
  if constexpr (kLongWholeBody<Tin, Th, Tw, kRms> && !kQuant) {
    if (whole_chunks) each_row(std::true_type{});
    else each_row(std::false_type{});
  } else {
    each_row(std::false_type{});
  }
  if (cluster > 1) cluster_sync();  // no block leaves while the others may still read its warps' states
}

}  // namespace cuda
}  // namespace layernorm_ext
