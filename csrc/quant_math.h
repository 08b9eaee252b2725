// The arithmetic of the quantized outputs (the *_norm_quant ops), shared by the CPU and the CUDA kernels so that
// both give the same bits, and written out so that a composite PyTorch reference reproduces it exactly. It is
// vLLM's, bit for bit (csrc/layernorm_quant_kernels.cu, csrc/quantization/fused_kernels, the int8 kernels):
//   y      = the norm's output rounded to the input dtype (what the unquantized op returns), as float32
//   dynamic: absmax = max |y| over the row (NaN when the row holds a NaN), capped at scale_ub when given;
//            scale = max(absmax / qmax, min_scale), stored per row
//   v      = y scaled as vLLM scales on each path (scaling() below):
//            float8_e4m3fn static: y * (1 / scale)   (rms_norm_static_fp8_quant, fused_add_rms_norm_static_fp8_quant)
//            float8_e4m3fn dynamic: y / scale        (rms_norm_dynamic_per_token_quant: "for exact match with FBGemm")
//            int8 static: y / scale                  (static_scaled_int8_quant)
//            int8 dynamic: y * (1 / scale)           (rms_norm_dynamic_per_token_quant)
//   code   = float8_e4m3fn: v clamped to [-448, 448], rounded to nearest even (NaN stays NaN: vLLM's fmin / fmax
//            clamp turns it into 448);
//            float8_e5m2 (FlashInfer's norms take it): the same with [-57344, 57344], float8_e4m3fn's rules
//            otherwise (how it scales, its min_scale in proportion);
//            int8: v clamped to [-128, 127], rounded to nearest even, NaN gives 0 (as cvt.rni.sat.s8.f32).
// Per group (group_size > 0: vLLM's per-block layout, dynamic only): each group_size consecutive columns of a row
// get the dynamic scale of their own absmax, and every code scales as y * (1 / scale) (group_scaling).
// min_scale (vLLM's): 1 / (qmax * 512) for the float8 codes, float32's epsilon for int8, so that a row of zeros
// gets a positive scale and codes 0.
// NVFP4 (float4_e2m1fn_x2 codes, blocks of 16 columns): two levels, a static float32 global scale and a dynamic
// float8_e4m3fn scale per block (nvfp4_scale_bits below).
// The block scales' swizzled layout of the Blackwell scaled matmuls (swizzled_scale_index).
// Plain C++ (no torch header): the CPU instruction-set objects include it; every function has internal linkage.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LNX_QUANT_FN static __host__ __device__ __forceinline__
#else
// Always inlined: the CPU's instruction-set objects instantiate small_float_bits on their own vector types inside their
// target regions, and a call to a copy compiled for the default target (passing AVX-512 vectors) crashed.
#define LNX_QUANT_FN static inline __attribute__((always_inline))
#endif

namespace layernorm_ext {
namespace quant {

constexpr float kFp8Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;
constexpr float kInt8Max = 127.0f;
constexpr float kE2m1Max = 6.0f;
constexpr int kNvfp4Block = 16;  // NVFP4's block: 16 consecutive columns share an e4m3fn scale
constexpr float kInt8MinScale = 1.1920928955078125e-07f;  // float32's epsilon

// The codes' format.
enum class Code : uint8_t { kE4m3fn, kE5m2, kInt8, kE2m1 };

// NVFP4 codes have CPU kernels only so far (the CUDA launch refuses them): device code leaves out their branch
// here and in encode, whose mere presence changed nvcc's code for every kernel (the kernel audit's figures).
LNX_QUANT_FN float code_max(Code code) {
#if !defined(__CUDA_ARCH__)
  if (code == Code::kE2m1) return kE2m1Max;
#endif
  return code == Code::kInt8 ? kInt8Max : (code == Code::kE5m2 ? kE5m2Max : kFp8Max);
}

LNX_QUANT_FN float min_scale(Code code) {
  return code == Code::kInt8 ? kInt8MinScale : 1.0f / (code_max(code) * 512.0f);  // both exact powers of two
}

LNX_QUANT_FN uint32_t float_bits(float v) {
  uint32_t b;
  memcpy(&b, &v, 4);
  return b;
}

LNX_QUANT_FN float bits_float(uint32_t b) {
  float v;
  memcpy(&v, &b, 4);
  return v;
}

// max(m, |a|) that propagates NaN (as torch.amax): once m is NaN it stays NaN.
LNX_QUANT_FN float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

// The small float formats: bits, mantissa bits, exponent bias, largest finite value (none of them has an
// infinity), and what NaN becomes: the float8 formats' NaN code with the NaN's sign; e2m1 has no NaN, so +6
// (kNanCode, sign dropped: the saturating conversion's answer, MAX_NORM, as PTX's cvt.rn.satfinite.e2m1x2).
struct E4m3fn {
  static constexpr int kBits = 8, kMantissa = 3, kBias = 7;
  static constexpr float kMax = kFp8Max;
  static constexpr uint32_t kNanCode = 0x7f;
  static constexpr bool kNanKeepsSign = true;
};
struct E5m2 {
  static constexpr int kBits = 8, kMantissa = 2, kBias = 15;
  static constexpr float kMax = kE5m2Max;
  static constexpr uint32_t kNanCode = 0x7f;
  static constexpr bool kNanKeepsSign = true;
};
struct E2m1 {  // float4_e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
  static constexpr int kBits = 4, kMantissa = 1, kBias = 1;
  static constexpr float kMax = kE2m1Max;
  static constexpr uint32_t kNanCode = 0x7;
  static constexpr bool kNanKeepsSign = false;
};

// A float's bits and back, for one float (Lanes = ScalarLanes) or a vector of them (the CPU's lane type).
struct ScalarLanes {
  using Floats = float;
  using Bits = uint32_t;
  LNX_QUANT_FN Bits bits(Floats v) { return float_bits(v); }
  LNX_QUANT_FN Floats floats(Bits b) { return bits_float(b); }
};

// float -> bits of the small float Format (float8 or float4, in the low bits of each lane): saturate to +-kMax,
// round to nearest even, NaN -> kNanCode. Normal results (|v| >= 2^(1 - kBias)) round the float's mantissa to kMantissa
// bits and rebias the exponent (127 -> kBias); subnormal ones are |v| in units of 2^(1 - kBias - kMantissa)
// rounded to an integer (2^23 added: the add rounds), which also gives the smallest normal where |v| rounds
// up to it. Written once for a float and for the CPU's vectors of floats (GCC vector extensions: the same
// operators and ?: lane by lane).
template <class Format, class Lanes>
LNX_QUANT_FN typename Lanes::Bits small_float_bits(typename Lanes::Floats v) {
  using Floats = typename Lanes::Floats;
  using Bits = typename Lanes::Bits;
  constexpr int kShift = 23 - Format::kMantissa;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - Format::kBias) << 23;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - Format::kBias) << Format::kMantissa;
  constexpr float kSubnormalUnits = static_cast<float>(1u << (Format::kBias + Format::kMantissa - 1));
  v = v > Format::kMax ? Floats{} + Format::kMax : v;  // NaN compares false both times and passes
  v = v < -Format::kMax ? Floats{} - Format::kMax : v;
  const Bits x = Lanes::bits(v);
  Bits sign = (x >> (32 - Format::kBits)) & (1u << (Format::kBits - 1));
  const Bits ax = x & 0x7fffffffu;
  const Bits normal = ((ax + ((1u << (kShift - 1)) - 1u) + ((ax >> kShift) & 1u)) >> kShift) - kRebias;
  const Bits subnormal = Lanes::bits(Lanes::floats(ax) * kSubnormalUnits + 8388608.0f) - 0x4b000000u;
  Bits magnitude = ax >= kMinNormal ? normal : subnormal;
  magnitude = ax > 0x7f800000u ? Bits{} + Format::kNanCode : magnitude;
  if constexpr (!Format::kNanKeepsSign) sign = ax > 0x7f800000u ? Bits{} : sign;
  return sign | magnitude;
}

LNX_QUANT_FN uint8_t to_e4m3fn(float v) { return static_cast<uint8_t>(small_float_bits<E4m3fn, ScalarLanes>(v)); }
LNX_QUANT_FN uint8_t to_e5m2(float v) { return static_cast<uint8_t>(small_float_bits<E5m2, ScalarLanes>(v)); }
LNX_QUANT_FN uint8_t to_e2m1(float v) { return static_cast<uint8_t>(small_float_bits<E2m1, ScalarLanes>(v)); }

// float8_e4m3fn bits -> float (exact): normal ones rebias the exponent (7 -> 127), subnormal ones are
// mantissa * 2^-9; 0x7f / 0xff are NaN.
LNX_QUANT_FN float e4m3fn_value(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t magnitude = bits & 0x7fu;
  if (magnitude == 0x7fu) return bits_float(sign | 0x7fc00000u);
  const float value = magnitude < 8u ? static_cast<float>(magnitude) * 0x1p-9f
                                     : bits_float((magnitude << 20) + (static_cast<uint32_t>(127 - 7) << 23));
  return bits_float(float_bits(value) | sign);
}

// float -> int8: NaN -> 0, saturate to [-128, 127], round to nearest even (1.5 * 2^23 added: the add rounds).
LNX_QUANT_FN int8_t to_int8(float v) {
  v = v != v ? 0.0f : v;
  v = v > kInt8Max ? kInt8Max : (v < -128.0f ? -128.0f : v);
  const float rounded = (v + 12582912.0f) - 12582912.0f;
  return static_cast<int8_t>(static_cast<int32_t>(rounded));
}

LNX_QUANT_FN uint8_t encode(Code code, float v) {
  if (code == Code::kInt8) return static_cast<uint8_t>(to_int8(v));
#if !defined(__CUDA_ARCH__)
  if (code == Code::kE2m1) return to_e2m1(v);
#endif
  return code == Code::kE5m2 ? to_e5m2(v) : to_e4m3fn(v);
}

// absmax capped at ub (nullptr: no cap). NaN stays NaN.
LNX_QUANT_FN float capped(float absmax, const float* ub) { return ub != nullptr && absmax > *ub ? *ub : absmax; }

// A row's dynamic scale from its absmax; ub: the cap (nullptr: none). NaN stays NaN.
LNX_QUANT_FN float dynamic_scale(float absmax, const float* ub, Code code) {
  const float scale = capped(absmax, ub) / code_max(code);
  return scale < min_scale(code) ? min_scale(code) : scale;
}

// How a row's y is scaled before encoding (the table above): by factor, which is the scale where the path
// divides and 1 / scale (rounded once, per row) where it multiplies. The same float operations as vLLM's, so
// the same codes at the ties where the two differ.
struct Scaling {
  float factor;
  bool divide;
};

LNX_QUANT_FN Scaling scaling(float scale, bool is_static, Code code) {
  const bool divide = is_static == (code == Code::kInt8);
  return {divide ? scale : 1.0f / scale, divide};
}

// Per-group scales (vLLM's rms_norm_per_block_quant, every code): y * (1 / scale), the reciprocal rounded once per
// group.
LNX_QUANT_FN Scaling group_scaling(float scale) { return {1.0f / scale, false}; }

// MX block scales (OCP Microscaling Formats v1.0, 6.3; group_size 32 makes MXFP8): a power of two X = 2^e with
// e = floor(log2(absmax)) - emax of the codes' format (8 for e4m3fn, 15 for e5m2), clamped to [-127, 127], stored
// as float8_e8m0fnu bits (e + 127; a NaN absmax gives 0xff, NaN); codes are y / X (exact: a power of two),
// saturated by the encoder. floor(log2) is read from the float's exponent bits, so a zero or subnormal absmax
// takes e = -127, as torchao's MX reference does.
LNX_QUANT_FN uint8_t mx_scale_bits(float absmax, Code code) {
  if (absmax != absmax) return 0xffu;
  const int emax = code == Code::kE5m2 ? 15 : 8;
  int e = static_cast<int>((float_bits(absmax) >> 23) & 0xffu) - 127 - emax;
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return static_cast<uint8_t>(e + 127);
}

// y / 2^e as y * 2^-e (2^127 down to 2^-127, a subnormal float: exact either way); NaN for the NaN scale.
LNX_QUANT_FN Scaling mx_scaling(uint8_t scale_bits) {
  if (scale_bits == 0xffu) return {bits_float(0x7fc00000u), false};
  const int e = static_cast<int>(scale_bits) - 127;
  return {e == 127 ? bits_float(0x00400000u) : bits_float(static_cast<uint32_t>(127 - e) << 23), false};
}

// NVFP4, exactly vLLM's reference ref_nvfp4_quant (vllm tests/kernels/quantization/nvfp4_utils.py; its CUDA
// kernel csrc/quantization/fp4/nvfp4_quant_kernels.cu, FlashInfer's fp4_quantize and TransformerEngine's NVFP4
// recipe compute the same two levels), every operation in float32 and in this order:
//   block scale  s = e4m3fn(global_scale * (absmax * (1 / 6)))   1/6 rounded to float32; saturating at 448 (the
//                                                                 reference clamps to [-448, 448] before its cast)
//   codes          e2m1(y * rcp(float(s) * rcp(global_scale)))    rcp(x) = x == 0 ? 0 : 1 / x (its get_reciprocal)
// with absmax = max |y| over the block's 16 columns; e2m1 saturates at 6 (the reference clamps to [-6, 6]) and
// rounds to nearest even. Dequantized: e2m1 value * float(s) / global_scale. global_scale is static (vLLM:
// 448 * 6 / amax of the tensor), the block scales dynamic. A NaN block: scale NaN (0x7f), codes +6 (kNanCode).
LNX_QUANT_FN float reciprocal_or_zero(float x) { return x == 0.0f ? 0.0f : 1.0f / x; }

LNX_QUANT_FN uint8_t nvfp4_scale_bits(float absmax, float global_scale) {
  constexpr float kInverseE2m1Max = 1.0f / kE2m1Max;
  return to_e4m3fn(global_scale * (absmax * kInverseE2m1Max));
}

// The factor of a block's codes; inverse_global_scale = reciprocal_or_zero(global_scale), once per call.
LNX_QUANT_FN Scaling nvfp4_scaling(uint8_t scale_bits, float inverse_global_scale) {
  return {reciprocal_or_zero(e4m3fn_value(scale_bits) * inverse_global_scale), false};
}

LNX_QUANT_FN float scaled(float y, Scaling s) { return s.divide ? y / s.factor : y * s.factor; }

// The block-scale layout of the Blackwell scaled matmuls (cuBLAS's "1D block scaling factors layout", torch's
// SwizzleType.SWIZZLE_32_4_4, torch's to_blocked): the rows x blocks scale matrix padded to rows a multiple of 128
// and blocks a multiple of 4, cut into 128 x 4 tiles stored one after another (the tiles of rows 0-127 first, left
// to right), each tile's 512 bytes as 32 x 16: row r, block b of a tile at (r % 32) * 16 + (r / 32) * 4 + b.
constexpr int64_t kSwizzleTileRows = 128, kSwizzleTileBlocks = 4;

LNX_QUANT_FN int64_t swizzled_scale_rows(int64_t rows) {
  return (rows + kSwizzleTileRows - 1) / kSwizzleTileRows * kSwizzleTileRows;
}
LNX_QUANT_FN int64_t swizzled_scale_blocks(int64_t blocks) {
  return (blocks + kSwizzleTileBlocks - 1) / kSwizzleTileBlocks * kSwizzleTileBlocks;
}

// Where the scale of (row, block) goes, of a matrix of blocks blocks per row.
LNX_QUANT_FN int64_t swizzled_scale_index(int64_t row, int64_t block, int64_t blocks) {
  const int64_t tile = row / kSwizzleTileRows * (swizzled_scale_blocks(blocks) / kSwizzleTileBlocks) +
                       block / kSwizzleTileBlocks;
  const int64_t r = row % kSwizzleTileRows;
  return tile * (kSwizzleTileRows * kSwizzleTileBlocks) + (r % 32) * 16 + (r / 32) * 4 + block % kSwizzleTileBlocks;
}

}  // namespace quant
}  // namespace layernorm_ext
