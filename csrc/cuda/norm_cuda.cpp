// CUDA registrations: every op of csrc/bindings.cpp, bound to the shared op bodies (norm_ops.cpp) with the
// CUDA kernels (norm_kernels.cuh, instantiated per input dtype in launch_*.cu). Each call runs under a device
// guard for its input's device and launches on that device's current stream.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../norm.h"

namespace layernorm_ext {
namespace cuda {

void forward_f32(const NormForwardParams& p);
void forward_f64(const NormForwardParams& p);
void forward_f16(const NormForwardParams& p);
void forward_bf16(const NormForwardParams& p);
void backward_f32(const NormBackwardParams& p);
void backward_f64(const NormBackwardParams& p);
void backward_f16(const NormBackwardParams& p);
void backward_bf16(const NormBackwardParams& p);

void forward(const NormForwardParams& p) {
  switch (p.input_type) {
    case ScalarType::Float: return forward_f32(p);
    case ScalarType::Double: return forward_f64(p);
    case ScalarType::Half: return forward_f16(p);
    case ScalarType::BFloat16: return forward_bf16(p);
    default: TORCH_INTERNAL_ASSERT(false, "layernorm_ext: unchecked input dtype ", p.input_type);
  }
}

void backward(const NormBackwardParams& p) {
  switch (p.out_type) {
    case ScalarType::Float: return backward_f32(p);
    case ScalarType::Double: return backward_f64(p);
    case ScalarType::Half: return backward_f16(p);
    case ScalarType::BFloat16: return backward_bf16(p);
    default: TORCH_INTERNAL_ASSERT(false, "layernorm_ext: unchecked grad_out dtype ", p.out_type);
  }
}

namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_fwd_cuda(const Tensor& input, c10::SymIntArrayRef shape,
                                                               const OptTensor& weight, const OptTensor& bias,
                                                               double eps, const OptTensor& residual,
                                                               bool residual_in_fp32, bool memory_efficient) {
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  return layer_norm_fwd(input, shape, weight, bias, eps, residual, residual_in_fp32, memory_efficient, forward);
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cuda(const Tensor& input, c10::SymIntArrayRef shape,
                                                     const OptTensor& weight, std::optional<double> eps,
                                                     const OptTensor& residual, bool residual_in_fp32,
                                                     bool memory_efficient) {
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  return rms_norm_fwd(input, shape, weight, eps, residual, residual_in_fp32, memory_efficient, forward);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_cuda(const Tensor& grad_out, const Tensor& saved,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       c10::SymIntArrayRef shape, const OptTensor& weight,
                                                       const OptTensor& bias, bool saved_is_output,
                                                       const OptTensor& grad_residual_out) {
  const c10::cuda::OptionalCUDAGuard guard(saved.device());
  return layer_norm_bwd(grad_out, saved, mean, rstd, shape, weight, bias, saved_is_output, grad_residual_out,
                        backward);
}

std::tuple<Tensor, Tensor> rms_norm_bwd_cuda(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                             c10::SymIntArrayRef shape, const OptTensor& weight,
                                             bool saved_is_output, const OptTensor& grad_residual_out) {
  const c10::cuda::OptionalCUDAGuard guard(saved.device());
  return rms_norm_bwd(grad_out, saved, rstd, shape, weight, saved_is_output, grad_residual_out, backward);
}

}  // namespace

TORCH_LIBRARY_IMPL(layernorm_ext, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
}

}  // namespace cuda
}  // namespace layernorm_ext
