// The interface between the CPU orchestration (norm_kernel.cpp: threads, chunks, dtype resolution) and the
// row kernels compiled once per instruction set (rows_portable.cpp, rows_avx2.cpp, rows_avx512.cpp, all from
// rows_impl.h). Plain C++ only: the ISA translation units include no torch header, and they define no symbol
// but their entry that another object could also define (rows_impl.h, Isolation), so the linker cannot give
// code that runs on a CPU without AVX-512 a copy compiled for it.
#pragma once

#include <cstdint>

#include "../row_layout.h"

namespace layernorm_ext {
namespace cpu {

enum class Dtype : int { f32 = 0, f64 = 1, bf16 = 2, f16 = 3 };
constexpr int kNumDtypes = 4;

// h = x + r, rounded to h's dtype, over n elements from each one's offset (elements from its pointer).
using AddRowFn = void (*)(const void* x, int64_t x_offset, const void* r, int64_t r_offset, void* h,
                          int64_t h_offset, int64_t n);

// Forward over rows [begin, end). Row r reads src = input (or, with a residual, h written by add_row first),
// writes out, and the statistics. weight/bias: nullptr or cols values of the compute type (float, or double
// when the rows are float64), weight_offset already added. cast_before_weight: xhat is rounded to out's dtype
// before the affine (NormForwardParams). Each row array has its layout (row_layout.h); out_rows is codes' with a
// quantized output.
struct ForwardRows {
  const void* input;
  const void* residual;  // nullptr: no fused residual
  void* residual_out;    // h
  AddRowFn add_row;
  void* out;
  const void* weight;
  const void* bias;
  void* mean;  // compute type; nullptr for RMSNorm and when no statistics are stored
  void* rstd;  // compute type; nullptr when no statistics are stored (the inference ops)
  int64_t cols;
  double eps;
  bool rms;
  bool cast_before_weight;
  // Quantized output (quant_math.h): each row is normalized into row_buffer (cols values of out's dtype, the
  // calling thread's own) and then written to codes as int8, float8_e4m3fn, float8_e5m2 (quant_code) or two
  // float4_e2m1 per byte (NVFP4), scaled by the static scale or, when scale is nullptr, by the row's dynamic scale,
  // stored to row_scales.
  void* codes;  // nullptr: out is written
  quant::Code quant_code;
  const float* scale;
  const float* scale_ub;  // nullptr: no cap
  float* row_scales;
  int64_t group_size;  // > 0: a dynamic scale per group of columns (NormForwardParams)
  uint8_t* mx_scales;  // with group_size: float8_e8m0fnu scales instead of row_scales
  uint8_t* nvfp4_scales;  // NVFP4: the blocks' float8_e4m3fn scales (scale is the global scale)
  int64_t scale_row_stride, scale_group_stride;
  bool scales_swizzled;  // (NormForwardParams)
  void* row_buffer;
  RowLayout input_rows, residual_rows, residual_out_rows, out_rows;
  // out written with non-temporal stores (where a vector's address allows them), then a store fence: set for a
  // caller's output larger than the last-level cache, which no consumer could read from there (norm_kernel.cpp).
  bool stream_out;
};
using ForwardRowsFn = void (*)(const ForwardRows& a, int64_t begin, int64_t end);

// Backward over rows [begin, end): grad_input rows, and the rows' dweight / dbias contributions added into
// the partial sums given (nullptr: not wanted), or with overwrite stored into them (their contents unset: no
// zeroing pass; the same bits as adding to zeros). The row math, the partial sums and weight/bias are float, or
// double when backward_computes_in_float says no (float64 data; rows of a few vectors, whose gradient
// cancels too much for float: for N = 1 it is proportional to 1 - xhat^2).
constexpr int64_t kFloatBackwardMinCols = 64;
// static: each object calls its own copy, never a weak symbol shared with the instruction-set objects.
static constexpr bool backward_computes_in_float(bool saved_is_double, bool grad_is_double, int64_t cols) {
  return !saved_is_double && !grad_is_double && cols >= kFloatBackwardMinCols;
}
// The backward reads x and dy of this many bytes of rows from memory, then again from cache (a group of rows in
// rows_backward.h, a block of the split rows in norm_kernel.cpp): about a quarter of L2.
constexpr int64_t kRowGroupBytes = 512 * 1024;

struct BackwardRows {
  const void* grad_out;
  const void* grad_residual_out;  // saved's dtype; nullptr if none
  const void* saved;              // h, or the forward's out when saved_is_output
  const void* mean;               // the forward's, float (double for float64 saved); unused for RMSNorm
  const void* rstd;
  const double* weight;  // when the math is double
  const double* bias;
  const float* weight_f;  // when the math is float
  const float* bias_f;
  void* grad_input;  // saved's dtype, contiguous
  RowLayout grad_out_rows, saved_rows, grad_residual_rows;
  int64_t cols;
  bool rms;
  bool saved_is_output;
  bool stats_double;
};
using BackwardRowsFn = void (*)(const BackwardRows& a, int64_t begin, int64_t end, void* dweight, void* dbias,
                                bool overwrite);

// One long row split into column ranges [c0, c1) across threads; the orchestration adds the ranges' sums in
// order. Forward: sums about center over src elements [begin, end): {sum(x - c), sum((x - c)^2)}; then
// normalize a range given the row's mean and rstd. Backward: the range's three sums (rows_backward.h,
// BackwardRow); then, given the whole row's sums, dx and the dweight/dbias terms (indexed by column).
using SegmentSumsFn = void (*)(const void* src, int64_t begin, int64_t end, double center, double* sums);
using SegmentNormalizeFn = void (*)(const ForwardRows& a, int64_t row, int64_t c0, int64_t c1, double mean,
                                    double rstd);
using BackwardSegmentSumsFn = void (*)(const BackwardRows& a, int64_t row, int64_t c0, int64_t c1, double* sums3);
using BackwardSegmentApplyFn = void (*)(const BackwardRows& a, int64_t row, int64_t c0, int64_t c1,
                                        const double* row_sums3, void* dweight, void* dbias);

// Channels-first rows (columns.h): the tensors hold a dense [images][cols][plane] block, each of the images *
// plane rows (pixels) has its cols elements plane apart, and row image * plane + p is pixel p of its image (the
// statistics' index). The kernels take the pixels [p0, p1) of one image. Forward: ForwardRows' input, out,
// weight, bias, mean, rstd, cols, eps, rms and cast_before_weight (no residual, no quantized output; the row
// layouts unused). Backward: BackwardRows' fields but grad_residual_out and the row layouts (grad_out, saved and
// grad_input share the block's layout); the pixels' dweight / dbias terms are added into dweight / dbias (double,
// cols each, nullptr: not wanted), summed first per lane in the compute type into lane_scratch (at least
// kColumnScratchBytes per column, the caller's), in blocks of kColumnBlockVectors vectors of pixels.
constexpr int64_t kColumnScratchBytes = 2 * 64;
using ForwardColumnsFn = void (*)(const ForwardRows& a, int64_t plane, int64_t image, int64_t p0, int64_t p1);
using BackwardColumnsFn = void (*)(const BackwardRows& a, int64_t plane, int64_t image, int64_t p0, int64_t p1,
                                   void* lane_scratch, double* dweight, double* dbias);

// The backward's dweight / dbias reduction: columns [0, count) of `chunks` partials (float or double, stride
// elements apart) summed in chunk order into sum, in double: 0.0 + chunk 0 + chunk 1 + ... (a -0 becomes +0).
using SumChunksFn = void (*)(const void* partials, int64_t chunks, int64_t stride, int64_t count, double* sum);

// One instruction set's kernels. Lookups return nullptr for dtype pairs no kernel exists for.
struct RowKernels {
  const char* isa;
  AddRowFn (*add_row)(Dtype x, Dtype r, Dtype h);
  ForwardRowsFn (*forward_rows)(Dtype src, Dtype out);
  BackwardRowsFn (*backward_rows)(Dtype saved, Dtype grad_out);
  SegmentSumsFn (*segment_sums)(Dtype src);
  SegmentNormalizeFn (*segment_normalize)(Dtype src, Dtype out);
  BackwardSegmentSumsFn (*backward_segment_sums)(Dtype saved, Dtype grad_out);
  BackwardSegmentApplyFn (*backward_segment_apply)(Dtype saved, Dtype grad_out);
  ForwardColumnsFn (*forward_columns)(Dtype src, Dtype out);
  BackwardColumnsFn (*backward_columns)(Dtype saved, Dtype grad_out);
  SumChunksFn (*sum_chunks)(Dtype partial);  // f32 and f64 only
  // Round float -> bfloat16 with AVX512_BF16 (on) or integer arithmetic (off, the default): the same bits. Only
  // the AVX-512 copy has the instruction; the others ignore it. Call it only on a CPU that has it.
  void (*set_native_bf16)(bool on);
};

const RowKernels& portable_row_kernels();
const RowKernels& avx2_row_kernels();
const RowKernels& avx512_row_kernels();

}  // namespace cpu
}  // namespace layernorm_ext
