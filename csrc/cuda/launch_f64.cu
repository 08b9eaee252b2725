// Instantiates the CUDA kernel family (norm_kernels.cuh) for double inputs, for every row / parameter dtype
// combination (one file per input dtype, so the builds run in parallel).
#include "norm_kernels.cuh"

namespace layernorm_ext {
namespace cuda {

bool forward_f64(const NormForwardParams& p) { return forward_for_input<double>(p); }
bool backward_f64(const NormBackwardParams& p) { return backward_for_grad<double>(p); }
LaunchPlan plan_f64(const PlanQuery& query) { return plan_for_input<double>(query); }

}  // namespace cuda
}  // namespace layernorm_ext
