// Every schema of torch.ops.layernorm_ext lives here, plus the autocast policy and the pybind11 module (build
// information, and the functional API's eager entry points of python_functions.cpp, which call the ops through
// the dispatcher like torch.ops does).
//
// Forward ops return the per-row statistics the backward needs (float32, float64 for float64 rows), and,
// when a residual is fused in, h = input + residual as residual_out. Outputs a variant does not produce are
// empty tensors of shape [0] (a schema cannot return None). memory_efficient only tells the autograd formula
// (layernorm_ext/ops.py) to save the output instead of the input; kernels ignore it. rms_norm_fwd's eps=None
// means, as in ATen's rms_norm, the machine epsilon of the compute type: float32 for float16/bfloat16/float32
// rows, float64 for float64 rows. weight_offset and cast_before_weight give the numerics of other norm modules:
// the scale is weight + weight_offset (1: Gemma's `1 + weight`, zero-centred gamma), and cast_before_weight
// rounds xhat to the input dtype before the affine (Llama's `weight * xhat.to(input_dtype)`); the backward ops
// take the forward's weight_offset. Device kernels register in csrc/cpu and
// csrc/cuda with TORCH_LIBRARY_IMPL and never change these schemas.
#include <ATen/autocast_mode.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/version.h>

#include "norm.h"
#ifdef LAYERNORM_EXT_WITH_CUDA
#include "cuda/launch_plan.h"
#endif

// The schemas. Not TORCH_LIBRARY: its static initializer would run at dlopen, and in a second copy of this
// library loaded into the process (a JIT build beside the prebuilt one, a user's own cpp_extension.load of these
// sources) the dispatcher's "Only a single TORCH_LIBRARY ..." error escapes it and std::terminate aborts Python.
// define_schemas_once (from the module init) turns that into an ImportError.
static void define_schemas(torch::Library& m) {
  m.def(
      "layer_norm_fwd(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "Tensor? residual=None, bool residual_in_fp32=False, bool memory_efficient=False, float weight_offset=0., "
      "bool cast_before_weight=False) -> (Tensor out, Tensor residual_out, Tensor mean, Tensor rstd)");
  m.def(
      "rms_norm_fwd(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps, "
      "Tensor? residual=None, bool residual_in_fp32=False, bool memory_efficient=False, float weight_offset=0., "
      "bool cast_before_weight=False) -> (Tensor out, Tensor residual_out, Tensor rstd)");
  // saved is h (the normalized input) or, with saved_is_output, the forward's out (memory-efficient mode).
  // grad_residual_out, when given, is added to grad_input (the gradient of h).
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, SymInt[] normalized_shape, "
      "Tensor? weight, Tensor? bias, bool saved_is_output=False, Tensor? grad_residual_out=None, "
      "float weight_offset=0.) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "rms_norm_bwd(Tensor grad_out, Tensor saved, Tensor rstd, SymInt[] normalized_shape, Tensor? weight, "
      "bool saved_is_output=False, Tensor? grad_residual_out=None, float weight_offset=0.) "
      "-> (Tensor grad_input, Tensor grad_weight)");
  // The inference ops: the forward ops written into the caller's buffers, storing no statistics, with no
  // autograd (as ATen's out= ops, they refuse arguments that require grad). *_into: out= (and residual_out=,
  // h in its dtype, with a residual), sharing no memory with the arguments. add_*_norm_: the inference engines'
  // fused add + norm in place: residual = input + residual (residual must have h's dtype), input = norm(it).
  m.def(
      "layer_norm_into(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "Tensor(a!) out, Tensor? residual=None, Tensor(b!)? residual_out=None, bool residual_in_fp32=False, "
      "float weight_offset=0., bool cast_before_weight=False) -> ()");
  m.def(
      "rms_norm_into(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps, Tensor(a!) out, "
      "Tensor? residual=None, Tensor(b!)? residual_out=None, bool residual_in_fp32=False, "
      "float weight_offset=0., bool cast_before_weight=False) -> ()");
  m.def(
      "add_layer_norm_(Tensor(a!) input, Tensor(b!) residual, SymInt[] normalized_shape, Tensor? weight=None, "
      "Tensor? bias=None, float eps=1e-05, float weight_offset=0., bool cast_before_weight=False) -> ()");
  m.def(
      "add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, SymInt[] normalized_shape, Tensor? weight=None, "
      "float? eps=None, float weight_offset=0., bool cast_before_weight=False) -> ()");
  // Quantized output (csrc/quant_math.h has the arithmetic): the forward written as float8_e4m3fn, float8_e5m2 or int8
  // codes (out), with a static scale (one float32) or, without one, a dynamic scale per row from the row's
  // absmax, capped by scale_ub, returned as scales (shaped as the rows, 1 for each normalized dim; [0] for a
  // static scale); with group_size > 0 a dynamic scale per group of group_size columns instead (shaped as the
  // rows, then the groups; scales_column_major: each group's scales of all rows contiguous, vLLM's transposed
  // layout); scales_dtype float8_e8m0fnu makes them MX block scales (powers of two, OCP MX: MXFP8 with
  // group_size 32), float32 otherwise (with scales=, the buffer's dtype). quant_dtype float4_e2m1fn_x2 is NVFP4:
  // scale is then its global scale (required), out [..., N / 2] (two codes per byte) and scales the float8_e4m3fn
  // scales of the blocks of 16 columns ([..., N / 16]; group_size 16 or 0). scales_swizzled writes MXFP8 / NVFP4 block
  // scales in the scaled matmuls' 128 x 4 tiles instead (torch's SWIZZLE_32_4_4: [rows padded to 128, blocks
  // padded to 4], the padding zeros; the _into ops: a buffer of as many elements). residual_out is h with a
  // residual ([0] without). No statistics, no autograd (inference ops).
  m.def(
      "layer_norm_quant(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "ScalarType quant_dtype, Tensor? scale=None, Tensor? scale_ub=None, Tensor? residual=None, "
      "bool residual_in_fp32=False, float weight_offset=0., bool cast_before_weight=False, int group_size=0, "
      "bool scales_column_major=False, ScalarType? scales_dtype=None, bool scales_swizzled=False) -> (Tensor out, Tensor scales, Tensor residual_out)");
  m.def(
      "rms_norm_quant(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps, ScalarType quant_dtype, "
      "Tensor? scale=None, Tensor? scale_ub=None, Tensor? residual=None, bool residual_in_fp32=False, "
      "float weight_offset=0., bool cast_before_weight=False, int group_size=0, bool scales_column_major=False, "
      "ScalarType? scales_dtype=None, bool scales_swizzled=False) -> (Tensor out, Tensor scales, Tensor residual_out)");
  // The same into the caller's buffers (vLLM's out= convention): out holds the codes (its dtype is the quantized
  // one), scales the dynamic per-row scales (given exactly when scale is not), residual_out h (with a residual;
  // it may be residual itself: vLLM's fused add updates the residual in place).
  m.def(
      "layer_norm_quant_into(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "Tensor(a!) out, Tensor? scale=None, Tensor(b!)? scales=None, Tensor? scale_ub=None, Tensor? residual=None, "
      "Tensor(c!)? residual_out=None, bool residual_in_fp32=False, float weight_offset=0., "
      "bool cast_before_weight=False, int group_size=0, bool scales_swizzled=False) -> ()");
  m.def(
      "rms_norm_quant_into(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps, Tensor(a!) out, "
      "Tensor? scale=None, Tensor(b!)? scales=None, Tensor? scale_ub=None, Tensor? residual=None, "
      "Tensor(c!)? residual_out=None, bool residual_in_fp32=False, float weight_offset=0., "
      "bool cast_before_weight=False, int group_size=0, bool scales_swizzled=False) -> ()");
  // The functional API (layernorm_ext/functional.py): each the forward op above, returning only what the user
  // gets, which spares an eager call the statistics' Python objects (CompositeImplicitAutograd, in
  // norm_autograd.cpp: autograd, fake tensors, DTensor and autocast all act on the forward op).
  m.def(
      "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
      "float eps=1e-05, bool memory_efficient=False, float weight_offset=0., bool cast_before_weight=False) "
      "-> Tensor");
  m.def(
      "rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None, "
      "bool memory_efficient=False, float weight_offset=0., bool cast_before_weight=False) -> Tensor");
  m.def(
      "add_layer_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
      "Tensor? bias=None, float eps=1e-05, bool residual_in_fp32=False, bool memory_efficient=False, "
      "float weight_offset=0., bool cast_before_weight=False) -> (Tensor out, Tensor residual_out)");
  m.def(
      "add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
      "float? eps=None, bool residual_in_fp32=False, bool memory_efficient=False, float weight_offset=0., "
      "bool cast_before_weight=False) -> (Tensor out, Tensor residual_out)");
}

namespace {

// torch.autocast on CUDA runs layer_norm in float32, and rms_norm too from torch 2.13 (ATen's fp32 list; 2.11
// leaves rms_norm alone: an H200 run returned bfloat16): where the running torch's ATen op casts, cast the
// float16/bfloat16 CUDA tensor arguments to float32 and call the op again below the autocast keys. On CPU ATen
// leaves the norms alone under autocast, and so do we (the CPU autocast key falls through).
// With a residual, the stand-in is `h = input + residual` (autocast leaves add alone, so h keeps the promoted
// input dtype) followed by the float32 norm of h: h is formed at its own dtype first, so residual_out and the
// normalized values are exactly torch's, and the op then normalizes float32(h) without a residual.
int64_t argument_index(const c10::FunctionSchema& schema, const char* name) {
  const auto index = schema.argumentIndexWithName(name);
  TORCH_INTERNAL_ASSERT(index.has_value(),
                        layernorm_ext::message("layernorm_ext: no argument ", name, " in ", schema.name()));
  return static_cast<int64_t>(*index);
}

at::Tensor autocast_arg(const at::Tensor& t) {
  const bool cast = t.defined() && t.is_cuda() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
  return cast ? t.to(at::kFloat) : t;
}

void autocast_cuda_to_fp32(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto& schema = op.schema();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(schema.arguments().size());
  const int64_t input_index = argument_index(schema, "input");
  const int64_t residual_index = argument_index(schema, "residual");
  const int64_t in_fp32_index = argument_index(schema, "residual_in_fp32");
  std::optional<at::Tensor> h;
  if (first[residual_index].isTensor()) {
    const at::Tensor& input = first[input_index].toTensor();
    const at::Tensor& residual = first[residual_index].toTensor();
    const at::ScalarType h_type = layernorm_ext::residual_out_dtype(input, residual, first[in_fp32_index].toBool());
    const at::Tensor sum = at::add(input.to(h_type), residual.to(h_type));
    first[input_index] = sum;
    first[residual_index] = c10::IValue();
    h = sum;
  }
  for (auto it = first; it != stack->end(); ++it) {
    if (it->isTensor()) *it = autocast_arg(it->toTensor());
  }
  op.callBoxed(stack);
  if (h.has_value()) {
    // Outputs: (out, residual_out, ...): residual_out is h itself.
    (*stack)[stack->size() - schema.returns().size() + 1] = *h;
  }
}

// Whether the running torch's own op `name` has a CUDA autocast kernel (ATen registers its before ours loads).
bool aten_autocasts_on_cuda(const char* name) {
  const auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  return op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA);
}

}  // namespace

TORCH_LIBRARY_IMPL(layernorm_ext, AutocastCUDA, m) {
  if (aten_autocasts_on_cuda("aten::layer_norm")) {
    m.impl("layer_norm_fwd", torch::CppFunction::makeFromBoxedFunction<&autocast_cuda_to_fp32>());
  }
  if (aten_autocasts_on_cuda("aten::rms_norm")) {
    m.impl("rms_norm_fwd", torch::CppFunction::makeFromBoxedFunction<&autocast_cuda_to_fp32>());
  }
}

#ifndef LAYERNORM_EXT_WITH_CUDA
namespace {

// A library built without the CUDA kernels (a CPU-only torch, or no nvcc at build time) says so when handed
// CUDA tensors, instead of the dispatcher's generic "could not run ... with arguments from the 'CUDA' backend".
void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  TORCH_CHECK(
      false, layernorm_ext::message(
                 op.schema().name(),
                 ": layernorm_ext was built without its CUDA kernels; rebuild it with a CUDA build of torch and the "
                 "CUDA toolkit present (FORCE_CUDA=1 pip install --no-build-isolation --force-reinstall --no-deps .)"));
}

}  // namespace

TORCH_LIBRARY_IMPL(layernorm_ext, CUDA, m) {
  for (const char* name : {"layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd", "layer_norm_into",
                           "rms_norm_into", "add_layer_norm_", "add_rms_norm_", "layer_norm_quant",
                           "rms_norm_quant", "layer_norm_quant_into", "rms_norm_quant_into"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  }
}
#endif

namespace {

constexpr const char* kSecondCopy =
    "layernorm_ext: torch.ops.layernorm_ext is already registered in this process, by another copy of the native "
    "library (the prebuilt layernorm_ext._C, a JIT build, or a torch.utils.cpp_extension.load of the same "
    "sources); only one copy can be loaded per process. Import layernorm_ext and use the library it loaded "
    "(LAYERNORM_EXT_JIT=1 before the first import selects a JIT build) instead of loading the sources again.";

void define_schemas_once() {
  // Per copy of the library: the same file initialized again (a second cpp_extension.load of the same build)
  // shares this copy's registration.
  static bool defined_by_this_copy = false;
  if (defined_by_this_copy) return;
  if (c10::Dispatcher::singleton().findSchema({"layernorm_ext::layer_norm_fwd", ""}).has_value()) {
    throw pybind11::import_error(kSecondCopy);
  }
  try {
    // Lives as long as the process, as TORCH_LIBRARY's registration would.
    static torch::Library library(torch::Library::DEF, "layernorm_ext", std::nullopt, __FILE__, __LINE__);
    define_schemas(library);
  } catch (const c10::Error& err) {
    throw pybind11::import_error(std::string(kSecondCopy) + " (" + err.what_without_backtrace() + ")");
  }
  defined_by_this_copy = true;
}

}  // namespace

namespace layernorm_ext {
void add_python_functions(PyObject* module);  // python_functions.cpp: the functional API's eager entry points
}  // namespace layernorm_ext

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                          std::to_string(TORCH_VERSION_PATCH);
#ifdef LAYERNORM_EXT_WITH_CUDA
  info["with_cuda"] = true;
#else
  info["with_cuda"] = false;
#endif
  info["cpu_isa"] = layernorm_ext::cpu::isa_name();
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
#ifdef _OPENMP
  info["openmp"] = true;
#else
  info["openmp"] = false;
#endif
  return info;
}

#ifdef LAYERNORM_EXT_WITH_CUDA
c10::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return c10::ScalarType::Float;
  if (name == "float64") return c10::ScalarType::Double;
  if (name == "float16") return c10::ScalarType::Half;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  TORCH_CHECK_VALUE(false, layernorm_ext::message(
                               "cuda_launch_plan: dtype must be float32, float64, float16 or bfloat16, got ", name));
}

// The CUDA dispatcher's choice for a call (csrc/cuda/launch_plan.h), computed on the host with the caller's
// device figures: no GPU needed. For benchmarks/kernel_audit.py.
pybind11::dict cuda_launch_plan(const std::string& op, const std::string& direction, const std::string& input_dtype,
                                int64_t rows, int64_t cols, int sm_count, int64_t max_shared_per_block,
                                const std::string& row_dtype, const std::string& param_dtype, int blocks_per_sm,
                                bool vectorized, bool quantized, int compute_capability) {
  TORCH_CHECK_VALUE(op == "layer_norm" || op == "rms_norm", "cuda_launch_plan: op must be layer_norm or rms_norm");
  TORCH_CHECK_VALUE(direction == "forward" || direction == "backward",
                    "cuda_launch_plan: direction must be forward or backward");
  TORCH_CHECK_VALUE(rows > 0 && cols > 0 && sm_count > 0 && max_shared_per_block > 0 && blocks_per_sm >= 0,
                    "cuda_launch_plan: rows, cols, sm_count and max_shared_per_block must be positive");
  layernorm_ext::cuda::PlanQuery query;
  query.rms = op == "rms_norm";
  query.backward = direction == "backward";
  query.quantized = quantized;
  query.vectorized = vectorized;
  query.input_type = dtype_named(input_dtype);
  query.row_type = dtype_named(row_dtype.empty() ? input_dtype : row_dtype);
  query.param_type = dtype_named(param_dtype.empty() ? input_dtype : param_dtype);
  query.rows = rows;
  query.cols = cols;
  query.sm_count = sm_count;
  query.max_shared_per_block = max_shared_per_block;
  query.blocks_per_sm = blocks_per_sm;
  query.compute_capability = compute_capability;
  layernorm_ext::cuda::LaunchPlan plan;
  switch (query.input_type) {
    case c10::ScalarType::Float: plan = layernorm_ext::cuda::plan_f32(query); break;
    case c10::ScalarType::Double: plan = layernorm_ext::cuda::plan_f64(query); break;
    case c10::ScalarType::Half: plan = layernorm_ext::cuda::plan_f16(query); break;
    default: plan = layernorm_ext::cuda::plan_bf16(query); break;
  }
  pybind11::dict out;
  out["kernel"] = plan.kernel;
  out["threads"] = plan.threads;
  out["grid"] = plan.grid;
  out["dynamic_shared"] = plan.dynamic_shared;
  out["lanes"] = plan.lanes;
  out["rows_per_block"] = plan.rows_per_block;
  out["packs"] = plan.packs;
  out["vec"] = plan.vec;
  out["staged"] = plan.staged;
  out["whole_chunks"] = plan.whole_chunks;
  out["cluster"] = plan.cluster;
  out["persistent"] = plan.persistent;
  out["row_groups"] = plan.row_groups;
  out["group_rows"] = plan.group_rows;
  out["sums_kernel"] = plan.sums_kernel;
  out["sums_grid"] = plan.sums_grid;
  return out;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "layernorm_ext native library: registers torch.ops.layernorm_ext.* on import";
  define_schemas_once();
  layernorm_ext::add_python_functions(module.ptr());
  module.def("build_info", &build_info, "How this library was built: torch version, CUDA, CPU instruction set");
  module.def("supported_cpu_isas", &layernorm_ext::cpu::supported_isas,
             "CPU instruction sets this machine can run the kernels with, best first");
  module.def("cpu_scratch_bytes", &layernorm_ext::cpu::scratch_bytes,
             "Bytes of per-thread scratch the CPU kernels keep between calls, over all threads (at most 4 MiB per "
             "buffer: a wider call frees what it grew when it ends)");
  module.def("can_save_output", &layernorm_ext::can_save_output, pybind11::arg("input"), pybind11::arg("weight"),
             pybind11::arg("bias"), pybind11::arg("memory_efficient"), pybind11::arg("has_residual"),
             pybind11::arg("weight_offset") = 0.0,
             "Whether a forward with these arguments saves its output for backward instead of its input (the "
             "autograd's choice; for the CUDA emulation tests)");
  module.def("set_cpu_stream_bytes", &layernorm_ext::cpu::set_stream_bytes, pybind11::arg("bytes"),
             "Forward outputs of at least this many bytes are written with non-temporal stores on CPU (bytes < 0: "
             "the last-level cache's size, the default; 0: every output); returns the previous threshold. For tests "
             "and benchmarks.");
  module.def("set_cpu_isa", &layernorm_ext::cpu::set_isa, pybind11::arg("isa"),
             "Use the CPU kernels of another instruction set (scalar, avx2, avx512; avx512_bf16: avx512 rounding "
             "to bfloat16 with AVX512_BF16) from now on; returns the previous one. For tests and benchmarks; "
             "LAYERNORM_EXT_CPU_ISA chooses it at load time.");
#ifdef LAYERNORM_EXT_WITH_CUDA
  module.def("cuda_launch_plan", &cuda_launch_plan, pybind11::arg("op"), pybind11::arg("direction"),
             pybind11::arg("input_dtype"), pybind11::arg("rows"), pybind11::arg("cols"), pybind11::arg("sm_count"),
             pybind11::arg("max_shared_per_block"), pybind11::arg("row_dtype") = "",
             pybind11::arg("param_dtype") = "", pybind11::arg("blocks_per_sm") = 0,
             pybind11::arg("vectorized") = true, pybind11::arg("quantized") = false,
             pybind11::arg("compute_capability") = 90,
             "The CUDA kernel, block, grid, dynamic shared memory and cluster size the dispatcher chooses for a "
             "call, given the device's SM count, opt-in shared memory per block, compute capability (major * 10 + "
             "minor: clusters from 90 on) and (persistent backward grids) resident blocks per SM of the chosen "
             "kernel (0: uncapped). Needs no GPU.");
#endif
}
