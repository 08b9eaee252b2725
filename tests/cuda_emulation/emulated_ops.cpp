// The CUDA kernel family (csrc/cuda/norm_kernels.cuh) compiled for the host against cuda_emulation.h, behind the
// shared op bodies (csrc/norm_ops.cpp): the same checks, allocations and parameter blocks as the real CUDA
// ops, but on CPU tensors. Built just in time by tests/test_cuda_emulation.py; exposes the four ops as plain
// pybind11 functions (no dispatcher registration: the real library owns torch.ops.layernorm_ext).
#include <torch/extension.h>

#include "../../csrc/cuda/norm_kernels.cuh"
#include "../../csrc/norm.h"

namespace {

using layernorm_ext::NormBackwardParams;
using layernorm_ext::NormForwardParams;
using layernorm_ext::OptTensor;
using layernorm_ext::Tensor;
namespace cuda = layernorm_ext::cuda;

bool forward_on_rows(const NormForwardParams& p) {
  switch (p.input_type) {
    case at::kFloat: return cuda::forward_for_input<float>(p);
    case at::kDouble: return cuda::forward_for_input<double>(p);
    case at::kHalf: return cuda::forward_for_input<__half>(p);
    case at::kBFloat16: return cuda::forward_for_input<__nv_bfloat16>(p);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

bool backward_on_rows(const NormBackwardParams& p) {
  switch (p.out_type) {
    case at::kFloat: return cuda::backward_for_grad<float>(p);
    case at::kDouble: return cuda::backward_for_grad<double>(p);
    case at::kHalf: return cuda::backward_for_grad<__half>(p);
    case at::kBFloat16: return cuda::backward_for_grad<__nv_bfloat16>(p);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

// As csrc/cuda/norm_cuda.cpp: strided rows in place where the kernels take them, else copied around them.
void forward(const NormForwardParams& p) { layernorm_ext::launch_on_rows(p, forward_on_rows); }
void backward(const NormBackwardParams& p) { layernorm_ext::launch_on_rows(p, backward_on_rows); }

c10::SymIntArrayRef sym(const std::vector<int64_t>& shape) {
  return c10::fromIntArrayRefSlow(at::IntArrayRef(shape));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("last_workspace_bytes", [] { return cuda::last_workspace_bytes; },
        "bytes of the last workspace request (the backward's dweight / dbias partial buffers)");
  m.def("reset_workspace_bytes", [] { cuda::last_workspace_bytes = 0; });
  m.def(
      "global_traffic",
      [] {
        std::vector<std::tuple<unsigned, unsigned, uint64_t, uint64_t>> out;
        for (const auto& t : emulation::traffic_log()) out.emplace_back(t.grid, t.threads, t.loaded, t.stored);
        return out;
      },
      "(grid, threads, bytes loaded, bytes stored) of each launch since the last reset, in order; grid 0 is a "
      "cudaMemsetAsync");
  m.def("reset_global_traffic", [] { emulation::traffic_log().clear(); });
  m.def(
      "launch_plan",
      [](bool rms, bool backward, at::ScalarType input_type, at::ScalarType row_type, at::ScalarType param_type,
         int64_t rows, int64_t cols) {
        cuda::PlanQuery q;
        q.rms = rms;
        q.backward = backward;
        q.input_type = input_type;
        q.row_type = row_type;
        q.param_type = param_type;
        q.rows = rows;
        q.cols = cols;
        q.sm_count = emulation::kSMs;
        q.max_shared_per_block = emulation::kSharedOptin;
        q.blocks_per_sm = emulation::kBlocksPerSM;
        q.compute_capability = emulation::kComputeCapability;
        cuda::LaunchPlan plan;
        switch (input_type) {
          case at::kFloat: plan = cuda::plan_for_input<float>(q); break;
          case at::kDouble: plan = cuda::plan_for_input<double>(q); break;
          case at::kHalf: plan = cuda::plan_for_input<__half>(q); break;
          case at::kBFloat16: plan = cuda::plan_for_input<__nv_bfloat16>(q); break;
          default: TORCH_CHECK(false, "unsupported dtype");
        }
        pybind11::dict d;
        d["kernel"] = plan.kernel;
        d["threads"] = plan.threads;
        d["grid"] = plan.grid;
        d["lanes"] = plan.lanes;
        d["rows_per_block"] = plan.rows_per_block;
        d["packs"] = plan.packs;
        d["vec"] = plan.vec;
        d["staged"] = plan.staged;
        d["whole_chunks"] = plan.whole_chunks;
        d["cluster"] = plan.cluster;
        d["dynamic_shared"] = plan.dynamic_shared;
        return d;
      },
      "the launchers' plan on the emulated GPU (sm_90: 3 SMs x 2 blocks, 100 KiB of shared memory per block, "
      "clusters of up to 16 blocks)");
  namespace py = pybind11;
  m.def(
      "layer_norm_fwd",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, const OptTensor& bias,
         double eps, const OptTensor& residual, bool residual_in_fp32, double weight_offset, bool cast_before_weight) {
        return layernorm_ext::layer_norm_fwd(input, sym(shape), weight, bias, eps, residual, residual_in_fp32, false,
                                             weight_offset, cast_before_weight, forward);
      },
      py::arg("input"), py::arg("shape"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("residual"),
      py::arg("residual_in_fp32"), py::arg("weight_offset") = 0.0, py::arg("cast_before_weight") = false);
  m.def(
      "rms_norm_fwd",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, std::optional<double> eps,
         const OptTensor& residual, bool residual_in_fp32, double weight_offset, bool cast_before_weight) {
        return layernorm_ext::rms_norm_fwd(input, sym(shape), weight, eps, residual, residual_in_fp32, false,
                                           weight_offset, cast_before_weight, forward);
      },
      py::arg("input"), py::arg("shape"), py::arg("weight"), py::arg("eps"), py::arg("residual"),
      py::arg("residual_in_fp32"), py::arg("weight_offset") = 0.0, py::arg("cast_before_weight") = false);
  m.def(
      "layer_norm_bwd",
      [](const Tensor& grad_out, const Tensor& saved, const Tensor& mean, const Tensor& rstd,
         const std::vector<int64_t>& shape, const OptTensor& weight, const OptTensor& bias, bool saved_is_output,
         const OptTensor& grad_residual_out, double weight_offset) {
        return layernorm_ext::layer_norm_bwd(grad_out, saved, mean, rstd, sym(shape), weight, bias, saved_is_output,
                                             grad_residual_out, weight_offset, backward);
      },
      py::arg("grad_out"), py::arg("saved"), py::arg("mean"), py::arg("rstd"), py::arg("shape"), py::arg("weight"),
      py::arg("bias"), py::arg("saved_is_output"), py::arg("grad_residual_out"), py::arg("weight_offset") = 0.0);
  m.def(
      "rms_norm_bwd",
      [](const Tensor& grad_out, const Tensor& saved, const Tensor& rstd, const std::vector<int64_t>& shape,
         const OptTensor& weight, bool saved_is_output, const OptTensor& grad_residual_out, double weight_offset) {
        return layernorm_ext::rms_norm_bwd(grad_out, saved, rstd, sym(shape), weight, saved_is_output,
                                           grad_residual_out, weight_offset, backward);
      },
      py::arg("grad_out"), py::arg("saved"), py::arg("rstd"), py::arg("shape"), py::arg("weight"),
      py::arg("saved_is_output"), py::arg("grad_residual_out"), py::arg("weight_offset") = 0.0);
  m.def(
      "rms_norm_into",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, std::optional<double> eps,
         const Tensor& out, const OptTensor& residual, const OptTensor& residual_out) {
        layernorm_ext::rms_norm_into(input, sym(shape), weight, eps, out, residual, residual_out, false, 0.0, false,
                                     forward);
      });
  m.def(
      "layer_norm_into",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, const OptTensor& bias,
         double eps, const Tensor& out, const OptTensor& residual, const OptTensor& residual_out) {
        layernorm_ext::layer_norm_into(input, sym(shape), weight, bias, eps, out, residual, residual_out, false, 0.0,
                                       false, forward);
      });
  m.def("add_rms_norm_", [](const Tensor& input, const Tensor& residual, const std::vector<int64_t>& shape,
                            const OptTensor& weight, std::optional<double> eps) {
    layernorm_ext::add_rms_norm_inplace(input, residual, sym(shape), weight, eps, 0.0, false, forward);
  });
  m.def(
      "layer_norm_quant",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, const OptTensor& bias,
         double eps, at::ScalarType quant_dtype, const OptTensor& scale, const OptTensor& scale_ub,
         const OptTensor& residual, int64_t group_size, bool scales_column_major,
         std::optional<at::ScalarType> scales_dtype, bool scales_swizzled) {
        return layernorm_ext::layer_norm_quant(input, sym(shape), weight, bias, eps, quant_dtype, scale, scale_ub,
                                               residual, false, 0.0, false, group_size, scales_column_major,
                                               scales_dtype, scales_swizzled, forward);
      },
      py::arg("input"), py::arg("shape"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("quant_dtype"),
      py::arg("scale"), py::arg("scale_ub"), py::arg("residual"), py::arg("group_size") = 0,
      py::arg("scales_column_major") = false, py::arg("scales_dtype") = py::none(), py::arg("scales_swizzled") = false);
  m.def(
      "rms_norm_quant",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, std::optional<double> eps,
         at::ScalarType quant_dtype, const OptTensor& scale, const OptTensor& scale_ub, const OptTensor& residual,
         int64_t group_size, bool scales_column_major, std::optional<at::ScalarType> scales_dtype,
         bool scales_swizzled) {
        return layernorm_ext::rms_norm_quant(input, sym(shape), weight, eps, quant_dtype, scale, scale_ub, residual,
                                             false, 0.0, false, group_size, scales_column_major, scales_dtype,
                                             scales_swizzled, forward);
      },
      py::arg("input"), py::arg("shape"), py::arg("weight"), py::arg("eps"), py::arg("quant_dtype"), py::arg("scale"),
      py::arg("scale_ub"), py::arg("residual"), py::arg("group_size") = 0, py::arg("scales_column_major") = false,
      py::arg("scales_dtype") = py::none(), py::arg("scales_swizzled") = false);
  m.def(
      "rms_norm_quant_into",
      [](const Tensor& input, const std::vector<int64_t>& shape, const OptTensor& weight, std::optional<double> eps,
         const Tensor& out, const OptTensor& scale, const OptTensor& scales, const OptTensor& residual,
         const OptTensor& residual_out, bool residual_in_fp32, int64_t group_size) {
        layernorm_ext::rms_norm_quant_into(input, sym(shape), weight, eps, out, scale, scales, std::nullopt, residual,
                                           residual_out, residual_in_fp32, 0.0, false, group_size, false, forward);
      },
      py::arg("input"), py::arg("shape"), py::arg("weight"), py::arg("eps"), py::arg("out"), py::arg("scale"),
      py::arg("scales"), py::arg("residual") = py::none(), py::arg("residual_out") = py::none(),
      py::arg("residual_in_fp32") = false, py::arg("group_size") = 0);
  m.def("add_layer_norm_", [](const Tensor& input, const Tensor& residual, const std::vector<int64_t>& shape,
                              const OptTensor& weight, const OptTensor& bias, double eps) {
    layernorm_ext::add_layer_norm_inplace(input, residual, sym(shape), weight, bias, eps, 0.0, false, forward);
  });
}
