// Instantiates the CUDA kernel family (norm_kernels.cuh) for __nv_bfloat16 inputs, for every row / parameter dtype
// combination (one file per input dtype, so the builds run in parallel).
#include "norm_kernels.cuh"

namespace layernorm_ext {
namespace cuda {

bool forward_bf16(const NormForwardParams& p) { return forward_for_input<__nv_bfloat16>(p); }
bool backward_bf16(const NormBackwardParams& p) { return backward_for_grad<__nv_bfloat16>(p); }
LaunchPlan plan_bf16(const PlanQuery& query) { return plan_for_input<__nv_bfloat16>(query); }

}  // namespace cuda
}  // namespace layernorm_ext
