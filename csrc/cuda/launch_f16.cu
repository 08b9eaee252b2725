// Instantiates the CUDA kernel family (norm_kernels.cuh) for __half inputs, for every row / parameter dtype
// combination (one file per input dtype, so the builds run in parallel).
#include "norm_kernels.cuh"

namespace layernorm_ext {
namespace cuda {

bool forward_f16(const NormForwardParams& p) { return forward_for_input<__half>(p); }
bool backward_f16(const NormBackwardParams& p) { return backward_for_grad<__half>(p); }
LaunchPlan plan_f16(const PlanQuery& query) { return plan_for_input<__half>(query); }

}  // namespace cuda
}  // namespace layernorm_ext
