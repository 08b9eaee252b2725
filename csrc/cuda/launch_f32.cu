// Instantiates the CUDA kernel family (norm_kernels.cuh) for float inputs, for every row / parameter dtype
// combination (one file per input dtype, so the builds run in parallel).
#include "norm_kernels.cuh"

namespace layernorm_ext {
namespace cuda {

bool forward_f32(const NormForwardParams& p) { return forward_for_input<float>(p); }
bool backward_f32(const NormBackwardParams& p) { return backward_for_grad<float>(p); }
LaunchPlan plan_f32(const PlanQuery& query) { return plan_for_input<float>(query); }

}  // namespace cuda
}  // namespace layernorm_ext
