// The kernel parameter blocks: what every device's kernels are handed, filled the same way by the
// device-independent op bodies (norm_ops.cpp). Only c10's ScalarType here, so the CUDA translation units can
// include it without the whole of ATen.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "quant_math.h"
#include "row_layout.h"

namespace layernorm_ext {

using c10::ScalarType;

// The codes' format of a quantized output's dtype (norm_checks.cpp admits these four).
inline quant::Code quant_code(ScalarType quant_type) {
  if (quant_type == ScalarType::Char) return quant::Code::kInt8;
  if (quant_type == ScalarType::Float4_e2m1fn_x2) return quant::Code::kE2m1;
  return quant_type == ScalarType::Float8_e5m2 ? quant::Code::kE5m2 : quant::Code::kE4m3fn;
}

// One forward call: rows x cols. input, residual, out (or codes) and residual_out each have their rows' layout
// (row_layout.h: every row's cols elements consecutive, the rows anywhere); the statistics and row_scales are
// contiguous. h = input (+ residual) is the row that gets normalized; with a residual it is written to
// residual_out in h_type. mean is unused for RMSNorm.
struct NormForwardParams {
  const void* input = nullptr;
  const void* residual = nullptr;  // nullptr: no fused residual add
  const void* weight = nullptr;    // nullptr: no affine scale
  const void* bias = nullptr;      // nullptr: no shift (always nullptr for RMSNorm)
  void* out = nullptr;             // input_type
  // out is the caller's buffer (out=, in place), written where it is, not a new tensor: its pages are mapped
  // already (the CPU kernels may then stream their stores past the cache; a new one's pages fault in first).
  bool out_given = false;
  void* residual_out = nullptr;    // h_type; nullptr when residual is nullptr
  void* mean = nullptr;            // acc_type; nullptr for RMSNorm and when no statistics are stored
  void* rstd = nullptr;            // acc_type; nullptr when no statistics are stored (the inference ops)
  int device = -1;                 // the tensors' device index (-1: the CPU)
  ScalarType input_type = ScalarType::Float;
  ScalarType residual_type = ScalarType::Float;
  ScalarType h_type = ScalarType::Float;
  ScalarType weight_type = ScalarType::Float;  // weight and bias share it
  ScalarType acc_type = ScalarType::Float;     // Float, or Double when h_type is Double
  int64_t rows = 0;
  int64_t cols = 0;
  double eps = 0.0;
  bool rms = false;
  // The numerics of the module being reproduced: the affine scale is weight + weight_offset (1 for Gemma's
  // `1 + weight`, zero-centred gamma), and cast_before_weight rounds xhat to the output dtype before the
  // affine (Llama's order: `weight * xhat.to(input_dtype)`), where otherwise xhat * weight + bias is rounded
  // once. Both need a weight (the op body checks it); rounding to a float32/float64 output changes nothing.
  double weight_offset = 0.0;
  bool cast_before_weight = false;
  // Quantized output (the *_norm_quant ops, csrc/quant_math.h): codes replaces out, one byte per element,
  // float8_e4m3fn, float8_e5m2 or int8 (quant_type). With scale (one float32 on the device) the scale is static; without
  // it each row's scale is computed from its absmax (capped by scale_ub when given) and written to
  // row_scales (float32, one per row).
  void* codes = nullptr;  // nullptr: out is written instead
  ScalarType quant_type = ScalarType::Float8_e4m3fn;
  const float* scale = nullptr;
  const float* scale_ub = nullptr;
  float* row_scales = nullptr;
  // Per-group dynamic scales (group_size > 0, dividing cols): the scale of row r's group g is at
  // row_scales[r * scale_row_stride + g * scale_group_stride] (row-major or column-major, see norm_checks.cpp).
  int64_t group_size = 0;
  uint8_t* mx_scales = nullptr;  // per group, float8_e8m0fnu MX scales (quant_math.h) instead of row_scales
  // NVFP4 (quant_type float4_e2m1fn_x2, group_size 16): codes two per byte (an even column in the low nibble, the
  // rows cols / 2 bytes: out_rows counts bytes), scale the global scale, the blocks' float8_e4m3fn scales here.
  uint8_t* nvfp4_scales = nullptr;
  int64_t scale_row_stride = 1;
  int64_t scale_group_stride = 0;
  // MX / NVFP4 block scales in the scaled matmuls' 128 x 4 tiles (quant::swizzled_scale_index) instead of the
  // strides; the padding of the tiles' last band of rows is zeroed before the launch, each row's padding blocks by
  // the kernel.
  bool scales_swizzled = false;
  RowLayout input_rows, residual_rows, out_rows, residual_out_rows;  // out_rows: out's, or codes'
  // > 0: channels-first rows (CPU only, no residual, no quantized output; norm_ops.cpp, column_plane): input and
  // out are a dense [rows / plane images][cols][plane] block each, row r being pixel r % plane of image r / plane,
  // its elements plane apart; the row layouts are unused.
  int64_t plane = 0;
};

// One backward call. saved is h (saved_is_output = false) or the forward's out (true, the memory-efficient
// mode, which recovers xhat = (out - bias) / weight). grad_input has saved_type and is contiguous; grad_out,
// saved and grad_residual_out have their rows' layouts (row_layout.h).
struct NormBackwardParams {
  const void* grad_out = nullptr;           // out_type
  const void* grad_residual_out = nullptr;  // saved_type (converted by the op body), added to grad_input
  const void* saved = nullptr;
  const void* mean = nullptr;  // acc_type; nullptr for RMSNorm
  const void* rstd = nullptr;  // acc_type
  const void* weight = nullptr;
  const void* bias = nullptr;
  void* grad_input = nullptr;   // saved_type
  void* grad_weight = nullptr;  // weight_type; nullptr when weight is nullptr
  void* grad_bias = nullptr;    // weight_type; nullptr when bias is nullptr
  int device = -1;              // the tensors' device index (-1: the CPU)
  ScalarType out_type = ScalarType::Float;
  ScalarType saved_type = ScalarType::Float;
  ScalarType weight_type = ScalarType::Float;
  ScalarType acc_type = ScalarType::Float;
  int64_t rows = 0;
  int64_t cols = 0;
  bool rms = false;
  bool saved_is_output = false;
  double weight_offset = 0.0;  // the forward's: the scale is weight + weight_offset (its gradient, dweight's)
  RowLayout grad_out_rows, saved_rows, grad_residual_rows;
  // > 0: channels-first rows, as the forward's: grad_out, saved and grad_input all so; no grad_residual_out.
  int64_t plane = 0;
};

}  // namespace layernorm_ext
