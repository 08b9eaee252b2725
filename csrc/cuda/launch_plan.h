// The dispatcher's choice for one call, as data: which kernel, block, grid and dynamic shared memory. The CUDA
// launchers (norm_kernels.cuh) take their configuration from it, and bindings.cpp returns it to Python for any
// shape without a GPU (layernorm_ext._C.cuda_launch_plan; benchmarks/kernel_audit.py reads it). Plain C++,
// so that the host compiler's translation units can include it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace layernorm_ext {
namespace cuda {

// What a plan needs from the device, asked only where the choice depends on it: the launchers ask the current
// device, a plan query answers with the caller's figures.
struct DeviceLimits {
  std::function<int64_t()> max_shared_per_block;  // bytes a block may opt in to
  // Blocks of `kernel` resident on the whole GPU at once (persistent grids): blocks per SM x SMs.
  std::function<int64_t(const void* kernel, int threads, size_t shared_bytes)> resident_blocks;
  // Whether `kernel` may be launched on thread-block clusters: the device is sm_90 or newer and the kernel's
  // code was compiled for it (the long forward splits rows that one block cannot stage over a cluster).
  std::function<bool(const void* kernel)> has_clusters;
  // Clusters of `cluster` blocks of `kernel` resident on the whole GPU at once (a cluster's blocks share a GPC, so
  // fewer than resident_blocks / cluster can be): the persistent cluster grids.
  std::function<int64_t(const void* kernel, int threads, size_t shared_bytes, int cluster)> resident_clusters;
};

struct LaunchPlan {
  std::string kernel;  // the function and its template arguments, spelled as in the demangled symbol
  int threads = 0;     // per block
  int64_t grid = 0;
  size_t dynamic_shared = 0;
  int lanes = 0;           // threads per row
  int rows_per_block = 1;  // > 1 when a (sub-)warp handles a row
  int packs = 0;           // packs per lane (register paths; 0 on the long paths)
  int vec = 1;             // elements per pack
  bool staged = false;     // long forward: the row staged in shared memory
  bool whole_chunks = false;  // long forward: units a multiple of kLongChunk x lanes (no thread's chunk partial)
  int cluster = 1;         // blocks per thread-block cluster (long forward on sm_90: the blocks of one row)
  bool persistent = false; // grid capped at the resident blocks, each block striding over rows
  int64_t row_groups = 0;  // rows / rows_per_block (long backward: / group_rows), rounded up
  int64_t group_rows = 0;  // long backward: rows per row group of backward_long_kernel
  std::string sums_kernel; // long backward: the row sums pass launched before `kernel`, and its grid
  int64_t sums_grid = 0;
};

// A call to plan for: the op's variant and dtypes (row_type: the dtype of h and the statistics' rows; for the
// backward, the saved tensor's), the shape, and whether every pointer allows 16-byte packs.
struct PlanQuery {
  bool rms = false;
  bool backward = false;
  bool quantized = false;  // forward with quantized output
  bool vectorized = true;
  c10::ScalarType input_type = c10::ScalarType::Float;  // input (forward) or grad_out (backward)
  c10::ScalarType row_type = c10::ScalarType::Float;
  c10::ScalarType param_type = c10::ScalarType::Float;
  int64_t rows = 0;
  int64_t cols = 0;
  int sm_count = 0;
  int64_t max_shared_per_block = 0;
  int blocks_per_sm = 0;  // resident blocks per SM of the chosen kernel; 0: unknown, persistent grid uncapped
  int compute_capability = 0;  // major * 10 + minor (90: sm_90, clusters); 0: unknown, no clusters
};

// Defined per input dtype in launch_{f32,f64,f16,bf16}.cu, with the launchers' own code.
LaunchPlan plan_f32(const PlanQuery& query);
LaunchPlan plan_f64(const PlanQuery& query);
LaunchPlan plan_f16(const PlanQuery& query);
LaunchPlan plan_bf16(const PlanQuery& query);

}  // namespace cuda
}  // namespace layernorm_ext
