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
// min_scale (vLLM's): 1 / (qmax * 512) for the float8 codes, float32's epsilon for int8, so that a row of zeros
// gets a positive scale and codes 0.
// Plain C++ (no torch header): the CPU instruction-set objects include it; every function has internal linkage.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LNX_QUANT_FN static __host__ __device__ __forceinline__
#else
#define LNX_QUANT_FN static inline
#endif

namespace layernorm_ext {
namespace quant {

constexpr float kFp8Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;
constexpr float kInt8Max = 127.0f;
constexpr float kInt8MinScale = 1.1920928955078125e-07f;  // float32's epsilon

// The codes' format.
enum class Code : uint8_t { kE4m3fn, kE5m2, kInt8 };

LNX_QUANT_FN float code_max(Code code) {
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

// float -> float8_e4m3fn bits: saturate to +-448, round to nearest even, NaN -> 0x7f (with the sign).
// Normal results (|v| >= 2^-6) round the float's mantissa to 3 bits and rebias the exponent (127 -> 7);
// subnormal ones are |v| in units of 2^-9 rounded to an integer (2^23 added: the add rounds), which also
// gives the smallest normal, 0x08, where |v| rounds up to 2^-6.
LNX_QUANT_FN uint8_t to_e4m3fn(float v) {
  v = v > kFp8Max ? kFp8Max : (v < -kFp8Max ? -kFp8Max : v);  // NaN passes
  const uint32_t x = float_bits(v);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7fffffffu;
  const uint32_t normal = ((ax + 0x7ffffu + ((ax >> 20) & 1u)) >> 20) - (120u << 3);
  const uint32_t subnormal = float_bits(bits_float(ax) * 512.0f + 8388608.0f) - 0x4b000000u;
  uint32_t magnitude = ax >= 0x3c800000u ? normal : subnormal;
  magnitude = ax > 0x7f800000u ? 0x7fu : magnitude;
  return static_cast<uint8_t>(sign | magnitude);
}

// float -> float8_e5m2 bits: saturate to +-57344, round to nearest even, NaN -> 0x7f (with the sign). As
// to_e4m3fn with 2 mantissa bits and the exponent bias 15: normal from 2^-14, subnormals in units of 2^-16.
LNX_QUANT_FN uint8_t to_e5m2(float v) {
  v = v > kE5m2Max ? kE5m2Max : (v < -kE5m2Max ? -kE5m2Max : v);  // NaN passes
  const uint32_t x = float_bits(v);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7fffffffu;
  const uint32_t normal = ((ax + 0xfffffu + ((ax >> 21) & 1u)) >> 21) - (112u << 2);
  const uint32_t subnormal = float_bits(bits_float(ax) * 65536.0f + 8388608.0f) - 0x4b000000u;
  uint32_t magnitude = ax >= 0x38800000u ? normal : subnormal;
  magnitude = ax > 0x7f800000u ? 0x7fu : magnitude;
  return static_cast<uint8_t>(sign | magnitude);
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
  return code == Code::kE5m2 ? to_e5m2(v) : to_e4m3fn(v);
}

// A row's dynamic scale from its absmax; ub: the cap (nullptr: none). NaN stays NaN.
LNX_QUANT_FN float dynamic_scale(float absmax, const float* ub, Code code) {
  if (ub != nullptr && absmax > *ub) absmax = *ub;
  const float scale = absmax / code_max(code);
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

LNX_QUANT_FN float scaled(float y, Scaling s) { return s.divide ? y / s.factor : y * s.factor; }

}  // namespace quant
}  // namespace layernorm_ext
