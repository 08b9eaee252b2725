// CUDA registrations: every op of csrc/bindings.cpp, bound to the shared op bodies (norm_ops.cpp) with the
// CUDA kernels (norm_kernels.cuh, instantiated per input dtype in launch_*.cu). The op bodies check every
// argument first; only then does a launcher below take a device guard for the tensors' device and launch on
// that device's current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../device_ops.h"

namespace layernorm_ext {
namespace cuda {

// Each returns false, launching nothing, where its kernels do not take the call's rows' layouts (norm_kernels.cuh).
bool forward_f32(const NormForwardParams& p);
bool forward_f64(const NormForwardParams& p);
bool forward_f16(const NormForwardParams& p);
bool forward_bf16(const NormForwardParams& p);
bool backward_f32(const NormBackwardParams& p);
bool backward_f64(const NormBackwardParams& p);
bool backward_f16(const NormBackwardParams& p);
bool backward_bf16(const NormBackwardParams& p);

namespace {

bool forward_on_rows(const NormForwardParams& p) {
  switch (p.input_type) {
    case ScalarType::Float: return forward_f32(p);
    case ScalarType::Double: return forward_f64(p);
    case ScalarType::Half: return forward_f16(p);
    case ScalarType::BFloat16: return forward_bf16(p);
    default: TORCH_INTERNAL_ASSERT(false, message("layernorm_ext: unchecked input dtype ", p.input_type));
  }
}

bool backward_on_rows(const NormBackwardParams& p) {
  switch (p.out_type) {
    case ScalarType::Float: return backward_f32(p);
    case ScalarType::Double: return backward_f64(p);
    case ScalarType::Half: return backward_f16(p);
    case ScalarType::BFloat16: return backward_bf16(p);
    default: TORCH_INTERNAL_ASSERT(false, message("layernorm_ext: unchecked grad_out dtype ", p.out_type));
  }
}

}  // namespace

// Strided rows in place on the register paths; elsewhere (long rows, quantized output) copied around the kernels.
void forward(const NormForwardParams& p) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(p.device));
  launch_on_rows(p, forward_on_rows);
}

void backward(const NormBackwardParams& p) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(p.device));
  launch_on_rows(p, backward_on_rows);
}

// The input's device's stream, not the current device's: a call on cuda:1 while cuda:0 is current and capturing
// (or the reverse) must see its own stream's state.
bool stream_is_capturing(c10::DeviceIndex device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(layernorm_ext, CUDA, m) { DeviceOps<cuda::forward, cuda::backward>::register_to(m); }

}  // namespace layernorm_ext
