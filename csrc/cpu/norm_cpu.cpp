// CPU registrations: every op of csrc/bindings.cpp, bound to the shared op bodies with the CPU kernels.
#include <torch/library.h>

#include "../norm.h"

namespace layernorm_ext {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_fwd_cpu(const Tensor& input, c10::SymIntArrayRef shape,
                                                              const OptTensor& weight, const OptTensor& bias,
                                                              double eps, const OptTensor& residual,
                                                              bool residual_in_fp32, bool memory_efficient) {
  return layer_norm_fwd(input, shape, weight, bias, eps, residual, residual_in_fp32, memory_efficient,
                        cpu::forward);
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cpu(const Tensor& input, c10::SymIntArrayRef shape,
                                                    const OptTensor& weight, std::optional<double> eps,
                                                    const OptTensor& residual, bool residual_in_fp32,
                                                    bool memory_efficient) {
  return rms_norm_fwd(input, shape, weight, eps, residual, residual_in_fp32, memory_efficient, cpu::forward);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_cpu(const Tensor& grad_out, const Tensor& saved,
                                                      const Tensor& mean, const Tensor& rstd,
                                                      c10::SymIntArrayRef shape, const OptTensor& weight,
                                                      const OptTensor& bias, bool saved_is_output,
                                                      const OptTensor& grad_residual_out) {
  return layer_norm_bwd(grad_out, saved, mean, rstd, shape, weight, bias, saved_is_output, grad_residual_out,
                        cpu::backward);
}

std::tuple<Tensor, Tensor> rms_norm_bwd_cpu(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                            c10::SymIntArrayRef shape, const OptTensor& weight,
                                            bool saved_is_output, const OptTensor& grad_residual_out) {
  return rms_norm_bwd(grad_out, saved, rstd, shape, weight, saved_is_output, grad_residual_out, cpu::backward);
}

}  // namespace

TORCH_LIBRARY_IMPL(layernorm_ext, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cpu);
}

}  // namespace layernorm_ext
