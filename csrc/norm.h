// Shared declarations of layernorm_ext: the kernel parameter blocks that every device fills the same way,
// the argument checks (one place for CPU and CUDA), and the device-independent op bodies that allocate
// outputs and hand a parameter block to a device's kernel launcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymIntArrayRef.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "message.h"
#include "norm_params.h"

namespace layernorm_ext {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// What the argument checks derive from a call.
struct NormGeometry {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<int64_t> stat_shape;  // the input's leading (not normalized) dims
};

// ---- argument checks (norm_checks.cpp), ATen-like wording, shared by every device ----
bool is_supported_float(ScalarType t);
ScalarType acc_type_for(ScalarType h_type);
// dtype of h = input + residual: the promoted type, at least float32 when residual_in_fp32.
ScalarType residual_out_dtype(const Tensor& input, const Tensor& residual, bool residual_in_fp32);
// rms: rms_norm's dtype rule for the weight (any floating dtype) instead of layer_norm's.
NormGeometry check_forward_args(const char* op, const Tensor& input, at::IntArrayRef normalized_shape,
                                const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                                bool rms);
NormGeometry check_backward_args(const char* op, const Tensor& grad_out, const Tensor& saved,
                                 const OptTensor& mean, const Tensor& rstd, at::IntArrayRef normalized_shape,
                                 const OptTensor& weight, const OptTensor& bias,
                                 const OptTensor& grad_residual_out, bool saved_is_output, bool rms);
// weight_offset: finite, and nonzero only with a weight (the scale is weight + weight_offset).
void check_weight_offset(const char* op, const OptTensor& weight, double weight_offset);
// A caller's output buffer (out=, residual_out=, or the in-place ops' input / residual): on input's device,
// input's shape (or shape: NVFP4's codes, two per byte), the given dtype, its last normalized_ndim dims packed and no
// leading dim of stride 0.
void check_destination(const char* op, const char* name, const Tensor& input, const Tensor& dest,
                       int64_t normalized_ndim, ScalarType dtype, at::OptionalIntArrayRef shape = std::nullopt);
// A buffer of another shape (the per-row scales): that shape, the dtype, contiguous.
void check_destination(const char* op, const char* name, const Tensor& input, const Tensor& dest, ScalarType dtype,
                       at::IntArrayRef shape);
// The quantized-output ops: quant_dtype float8_e4m3fn, float8_e5m2, int8 or float4_e2m1fn_x2 (NVFP4, which needs
// scale: its global scale); scale (static) and scale_ub (a cap of the dynamic scale, so never with scale) float32
// tensors of one element on input's device.
// dtype_of_out: quant_dtype is an out= buffer's dtype (the *_quant_into ops), and the error says so.
void check_quant_args(const char* op, const Tensor& input, ScalarType quant_dtype, const OptTensor& scale,
                      const OptTensor& scale_ub, bool dtype_of_out = false);
// The quantized ops' scales= buffer (the dynamic per-row scales): given exactly when the scale is dynamic;
// float32, contiguous, on input's device, of scale_shape.
void check_scales_buffer(const char* op, const Tensor& input, bool static_scale, const OptTensor& scales,
                         at::IntArrayRef scale_shape);
// Per-group scales (group_size > 0): dynamic only (no scale=), a 1-D normalized_shape whose cols it divides;
// scales_column_major only with it.
// scales_dtype: float32, or float8_e8m0fnu (MX block scales: with a group_size and float8 codes). NVFP4 codes
// (float4_e2m1fn_x2): group_size 16 or 0 (meaning 16), float8_e4m3fn scales, a 1-D normalized_shape of a multiple
// of 16 elements, scale= its global scale.
// scales_swizzled (the scaled matmuls' 128 x 4 tiles): MXFP8 (float8_e8m0fnu, group_size 32) or NVFP4 block
// scales, not with scales_column_major.
void check_group_size(const char* op, at::IntArrayRef normalized_shape, int64_t group_size, bool static_scale,
                      bool scales_column_major, bool scales_swizzled, ScalarType scales_dtype,
                      ScalarType quant_dtype);
// Swizzled block scales (quant::swizzled_scale_index): [rows padded to 128, groups padded to 4].
std::array<int64_t, 2> swizzled_scales_shape(int64_t rows, int64_t groups);
// A scales= buffer for them: of scales_dtype, contiguous, of the padded matrix's element count (any shape, as
// torch._scaled_mm takes them: [padded rows, padded groups] or flat).
void check_swizzled_scales_buffer(const char* op, const Tensor& input, const OptTensor& scales, int64_t rows,
                                  int64_t groups, ScalarType scales_dtype);
// Where a scales= buffer of per-group scales (rows x groups, dims as scale_shape) puts row r's group g:
// r * row_stride + g * group_stride. Row-major (contiguous) or column-major (each group's rows contiguous, the
// groups any stride apart: vLLM's transposed scales, padded rows included); anything else is refused.
struct GroupScalesLayout {
  int64_t row_stride, group_stride;
};
GroupScalesLayout check_group_scales_buffer(const char* op, const Tensor& input, const OptTensor& scales,
                                            at::IntArrayRef scale_shape, ScalarType scales_dtype);
// An out= buffer must not share memory with what the op reads.
void check_no_overlap(const char* op, const char* name, const Tensor& dest, const char* other_name,
                      const Tensor& other);

// ---- outputs nobody reads (norm_ops.cpp) ----
// While one is alive on a thread, the next forward op called there leaves out what its caller drops unseen:
// residual_out's empty placeholder (without a residual), and with statistics=true mean and rstd too; they come
// back undefined (never to Python: only the functional ops set it, and they return the output only). They hold
// one around their forward op when every tensor is a plain one, with statistics=true when no autograd graph is
// recorded (norm_autograd.cpp). The first forward op's body that runs takes it (anything that runs later inside
// the guard, a saved-tensor hook say, gets every output).
class OutputsUnread {
 public:
  explicit OutputsUnread(bool statistics);
  ~OutputsUnread();
  OutputsUnread(const OutputsUnread&) = delete;
  OutputsUnread& operator=(const OutputsUnread&) = delete;

 private:
  uint8_t previous_;
};

// ---- device-independent op bodies (norm_ops.cpp); each device passes its launcher ----
// A launcher runs a device's kernels on a filled parameter block; the op bodies call it after every argument
// check, so nothing device-specific (a device guard, a stream) runs before a bad argument is reported.
using ForwardLauncher = void (*)(const NormForwardParams&);
using BackwardLauncher = void (*)(const NormBackwardParams&);

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                          const OptTensor& weight, const OptTensor& bias,
                                                          double eps, const OptTensor& residual,
                                                          bool residual_in_fp32, bool memory_efficient,
                                                          double weight_offset, bool cast_before_weight,
                                                          ForwardLauncher launch);
std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                const OptTensor& weight, std::optional<double> eps,
                                                const OptTensor& residual, bool residual_in_fp32,
                                                bool memory_efficient, double weight_offset,
                                                bool cast_before_weight, ForwardLauncher launch);
std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& mean,
                                                  const Tensor& rstd, c10::SymIntArrayRef normalized_shape,
                                                  const OptTensor& weight, const OptTensor& bias,
                                                  bool saved_is_output, const OptTensor& grad_residual_out,
                                                  double weight_offset, BackwardLauncher launch);
// The inference ops: the forward written into the caller's buffers, with no statistics computed into memory.
// *_into: out (input's dtype) and, with a residual, residual_out (h's dtype), sharing no memory with the
// arguments. In place (add_*_norm_): residual = input + residual, then input = norm(residual).
void layer_norm_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                     const OptTensor& bias, double eps, const Tensor& out, const OptTensor& residual,
                     const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                     bool cast_before_weight, ForwardLauncher launch);
void rms_norm_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                   std::optional<double> eps, const Tensor& out, const OptTensor& residual,
                   const OptTensor& residual_out, bool residual_in_fp32, double weight_offset, bool cast_before_weight,
                   ForwardLauncher launch);
void add_layer_norm_inplace(const Tensor& input, const Tensor& residual, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps, double weight_offset,
                            bool cast_before_weight, ForwardLauncher launch);
void add_rms_norm_inplace(const Tensor& input, const Tensor& residual, c10::SymIntArrayRef normalized_shape,
                          const OptTensor& weight, std::optional<double> eps, double weight_offset,
                          bool cast_before_weight, ForwardLauncher launch);
// Quantized output (csrc/quant_math.h): the forward's out as float8_e4m3fn, float8_e5m2 or int8 codes, with a static scale
// or a dynamic one per row, computed in the same pass and returned ([0] for a static scale), and residual_out
// with a residual ([0] without). No statistics are stored.
std::tuple<Tensor, Tensor, Tensor> layer_norm_quant(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                    const OptTensor& weight, const OptTensor& bias, double eps,
                                                    ScalarType quant_dtype, const OptTensor& scale,
                                                    const OptTensor& scale_ub, const OptTensor& residual,
                                                    bool residual_in_fp32, double weight_offset,
                                                    bool cast_before_weight, int64_t group_size,
                                                    bool scales_column_major,
                                                    std::optional<ScalarType> scales_dtype, bool scales_swizzled,
                                                    ForwardLauncher launch);
std::tuple<Tensor, Tensor, Tensor> rms_norm_quant(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                  const OptTensor& weight, std::optional<double> eps,
                                                  ScalarType quant_dtype, const OptTensor& scale,
                                                  const OptTensor& scale_ub, const OptTensor& residual,
                                                  bool residual_in_fp32, double weight_offset,
                                                  bool cast_before_weight, int64_t group_size,
                                                  bool scales_column_major,
                                                  std::optional<ScalarType> scales_dtype, bool scales_swizzled,
                                                  ForwardLauncher launch);
// The same into the caller's buffers: out (the codes: its dtype, float8_e4m3fn, float8_e5m2 or int8, is the quantized dtype),
// scales (dynamic scale only), residual_out (with a residual; it may be residual itself: h in place).
void layer_norm_quant_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                          const OptTensor& bias, double eps, const Tensor& out, const OptTensor& scale,
                          const OptTensor& scales, const OptTensor& scale_ub, const OptTensor& residual,
                          const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                          bool cast_before_weight, int64_t group_size, bool scales_swizzled,
                          ForwardLauncher launch);
void rms_norm_quant_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                         std::optional<double> eps, const Tensor& out, const OptTensor& scale, const OptTensor& scales,
                         const OptTensor& scale_ub, const OptTensor& residual, const OptTensor& residual_out,
                         bool residual_in_fp32, double weight_offset, bool cast_before_weight,
                         int64_t group_size, bool scales_swizzled, ForwardLauncher launch);
std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                        c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                        bool saved_is_output, const OptTensor& grad_residual_out,
                                        double weight_offset, BackwardLauncher launch);

// For launchers whose kernels take some of row_layout.h's layouts only (the CUDA kernels: strided rows on their
// register paths, without a quantized output): launch(p) on p's own layouts; where it declines (returns false,
// launching nothing), launch again with every operand whose rows are not packed copied into a contiguous tensor on
// p's device first, and every such output written there and copied into place afterwards.
using TryForwardLauncher = bool (*)(const NormForwardParams&);
using TryBackwardLauncher = bool (*)(const NormBackwardParams&);
void launch_on_rows(const NormForwardParams& p, TryForwardLauncher launch);
void launch_on_rows(const NormBackwardParams& p, TryBackwardLauncher launch);

// ---- autograd (norm_autograd.cpp) ----
// memory_efficient: whether a forward with these arguments may save its output for backward instead of its input,
// as far as the parameters decide (the circumstances, and the weight's and bias's values read on the host; the
// forward adds a condition on its rows' statistics, and on CUDA checks the same on the device instead, with no
// host read). weight_offset: the forward's (the scale the output was formed with is weight + weight_offset).
bool can_save_output(const Tensor& input, const OptTensor& weight, const OptTensor& bias, bool memory_efficient,
                     bool has_residual, double weight_offset = 0.0);

// ---- device kernels ----
namespace cpu {
void forward(const NormForwardParams& p);
void backward(const NormBackwardParams& p);
const char* isa_name();                   // instruction set the CPU kernels use: scalar, avx2, avx512 or avx512_bf16
std::vector<std::string> supported_isas();  // those this CPU can run, best first
std::string set_isa(const std::string& isa);  // switch (tests, benchmarks); returns the previous one
int64_t scratch_bytes();  // bytes of per-thread scratch the CPU kernels keep between calls (all threads)
// Outputs of at least `bytes` (< 0: the last-level cache's size, the default) take non-temporal stores (tests,
// benchmarks); returns the previous threshold.
int64_t set_stream_bytes(int64_t bytes);
}  // namespace cpu

#ifdef LAYERNORM_EXT_WITH_CUDA
namespace cuda {
// On device p.device and its current stream (the launcher takes the device guard); launches only, never
// synchronizes.
void forward(const NormForwardParams& p);
void backward(const NormBackwardParams& p);
bool stream_is_capturing(c10::DeviceIndex device);  // whether device's current stream is capturing a CUDA graph
}  // namespace cuda
#endif

}  // namespace layernorm_ext
