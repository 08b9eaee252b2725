// The ops of one device: the shared op bodies (norm_ops.cpp) bound to that device's launchers, as
// TORCH_LIBRARY_IMPL registers them (csrc/cpu/norm_cpu.cpp, csrc/cuda/norm_cuda.cpp).
#pragma once

#include <torch/library.h>

#include "norm.h"

namespace layernorm_ext {

template <ForwardLauncher kForward, BackwardLauncher kBackward>
struct DeviceOps {
  static std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm(const Tensor& input, c10::SymIntArrayRef shape,
                                                               const OptTensor& weight, const OptTensor& bias,
                                                               double eps, const OptTensor& residual,
                                                               bool residual_in_fp32, bool memory_efficient,
                                                               double weight_offset, bool cast_before_weight) {
    return layer_norm_fwd(input, shape, weight, bias, eps, residual, residual_in_fp32, memory_efficient,
                          weight_offset, cast_before_weight, kForward);
  }

  static std::tuple<Tensor, Tensor, Tensor> rms_norm(const Tensor& input, c10::SymIntArrayRef shape,
                                                     const OptTensor& weight, std::optional<double> eps,
                                                     const OptTensor& residual, bool residual_in_fp32,
                                                     bool memory_efficient, double weight_offset,
                                                     bool cast_before_weight) {
    return rms_norm_fwd(input, shape, weight, eps, residual, residual_in_fp32, memory_efficient, weight_offset,
                        cast_before_weight, kForward);
  }

  static std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& grad_out, const Tensor& saved,
                                                                const Tensor& mean, const Tensor& rstd,
                                                                c10::SymIntArrayRef shape, const OptTensor& weight,
                                                                const OptTensor& bias, bool saved_is_output,
                                                                const OptTensor& grad_residual_out,
                                                                double weight_offset) {
    return layer_norm_bwd(grad_out, saved, mean, rstd, shape, weight, bias, saved_is_output, grad_residual_out,
                          weight_offset, kBackward);
  }

  static std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& grad_out, const Tensor& saved,
                                                      const Tensor& rstd, c10::SymIntArrayRef shape,
                                                      const OptTensor& weight, bool saved_is_output,
                                                      const OptTensor& grad_residual_out, double weight_offset) {
    return rms_norm_bwd(grad_out, saved, rstd, shape, weight, saved_is_output, grad_residual_out, weight_offset,
                        kBackward);
  }

  static void layer_norm_out(const Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                             const OptTensor& bias, double eps, const Tensor& out, const OptTensor& residual,
                             const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                             bool cast_before_weight) {
    layer_norm_into(input, shape, weight, bias, eps, out, residual, residual_out, residual_in_fp32, weight_offset,
                    cast_before_weight, kForward);
  }

  static void rms_norm_out(const Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                           std::optional<double> eps, const Tensor& out, const OptTensor& residual,
                           const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                           bool cast_before_weight) {
    rms_norm_into(input, shape, weight, eps, out, residual, residual_out, residual_in_fp32, weight_offset,
                  cast_before_weight, kForward);
  }

  static void add_layer_norm_(const Tensor& input, const Tensor& residual, c10::SymIntArrayRef shape,
                              const OptTensor& weight, const OptTensor& bias, double eps, double weight_offset,
                              bool cast_before_weight) {
    add_layer_norm_inplace(input, residual, shape, weight, bias, eps, weight_offset, cast_before_weight, kForward);
  }

  static void add_rms_norm_(const Tensor& input, const Tensor& residual, c10::SymIntArrayRef shape,
                            const OptTensor& weight, std::optional<double> eps, double weight_offset,
                            bool cast_before_weight) {
    add_rms_norm_inplace(input, residual, shape, weight, eps, weight_offset, cast_before_weight, kForward);
  }

  static std::tuple<Tensor, Tensor, Tensor> layer_norm_q(const Tensor& input, c10::SymIntArrayRef shape,
                                                         const OptTensor& weight, const OptTensor& bias, double eps,
                                                         ScalarType quant_dtype, const OptTensor& scale,
                                                         const OptTensor& scale_ub, const OptTensor& residual,
                                                         bool residual_in_fp32, double weight_offset,
                                                         bool cast_before_weight, int64_t group_size,
                                                         bool scales_column_major,
                                                         std::optional<ScalarType> scales_dtype,
                                                         bool scales_swizzled) {
    return layer_norm_quant(input, shape, weight, bias, eps, quant_dtype, scale, scale_ub, residual,
                            residual_in_fp32, weight_offset, cast_before_weight, group_size, scales_column_major,
                            scales_dtype, scales_swizzled, kForward);
  }

  static std::tuple<Tensor, Tensor, Tensor> rms_norm_q(const Tensor& input, c10::SymIntArrayRef shape,
                                                       const OptTensor& weight, std::optional<double> eps,
                                                       ScalarType quant_dtype, const OptTensor& scale,
                                                       const OptTensor& scale_ub, const OptTensor& residual,
                                                       bool residual_in_fp32, double weight_offset,
                                                       bool cast_before_weight, int64_t group_size,
                                                       bool scales_column_major,
                                                       std::optional<ScalarType> scales_dtype,
                                                       bool scales_swizzled) {
    return rms_norm_quant(input, shape, weight, eps, quant_dtype, scale, scale_ub, residual, residual_in_fp32,
                          weight_offset, cast_before_weight, group_size, scales_column_major, scales_dtype,
                          scales_swizzled, kForward);
  }

  static void layer_norm_q_into(const Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                                const OptTensor& bias, double eps, const Tensor& out, const OptTensor& scale,
                                const OptTensor& scales, const OptTensor& scale_ub, const OptTensor& residual,
                                const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                                bool cast_before_weight, int64_t group_size, bool scales_swizzled) {
    layer_norm_quant_into(input, shape, weight, bias, eps, out, scale, scales, scale_ub, residual, residual_out,
                          residual_in_fp32, weight_offset, cast_before_weight, group_size, scales_swizzled, kForward);
  }

  static void rms_norm_q_into(const Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                              std::optional<double> eps, const Tensor& out, const OptTensor& scale,
                              const OptTensor& scales, const OptTensor& scale_ub, const OptTensor& residual,
                              const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                              bool cast_before_weight, int64_t group_size, bool scales_swizzled) {
    rms_norm_quant_into(input, shape, weight, eps, out, scale, scales, scale_ub, residual, residual_out,
                        residual_in_fp32, weight_offset, cast_before_weight, group_size, scales_swizzled, kForward);
  }

  static void register_to(torch::Library& m) {
    m.impl("layer_norm_fwd", &layer_norm);
    m.impl("rms_norm_fwd", &rms_norm);
    m.impl("layer_norm_bwd", &layer_norm_backward);
    m.impl("rms_norm_bwd", &rms_norm_backward);
    m.impl("layer_norm_into", &layer_norm_out);
    m.impl("rms_norm_into", &rms_norm_out);
    m.impl("add_layer_norm_", &add_layer_norm_);
    m.impl("add_rms_norm_", &add_rms_norm_);
    m.impl("layer_norm_quant", &layer_norm_q);
    m.impl("rms_norm_quant", &rms_norm_q);
    m.impl("layer_norm_quant_into", &layer_norm_q_into);
    m.impl("rms_norm_quant_into", &rms_norm_q_into);
  }
};

}  // namespace layernorm_ext
