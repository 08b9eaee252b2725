// Autograd of every op, in C++ on the Autograd dispatch key, so that a Python call is one dispatcher call; and
// the functional API's ops, compositions of the forward ops (CompositeImplicitAutograd).
//
// Forward ops (record_forward, NormBackward): run the device kernel below autograd, save what the backward op
// reads (the input, h with a residual, or the output in memory-efficient mode; mean, rstd, weight, bias) and
// record one node whose backward calls the backward op. The statistics and the empty placeholder of residual_out are
// returned beside the node, not from it: nothing differentiates them.
//
// Backward ops (layer_norm_bwd_autograd, rms_norm_bwd_autograd): without a gradient to form (the usual
// first-order backward) they just run the kernel. When their result must itself be differentiated
// (create_graph=True), the values still come from the kernel, and the derivatives from the same formula written in ATen
// ops: result = kernel + (formula - formula.detach()). The formula recomputes the mean and the mean square
// from the saved rows, so that second derivatives see the statistics move with the input, while its values
// are pinned to the stored mean and rstd (eps never appears: rstd = rsqrt(1/rstd^2 + (var - var.detach()))).
// From a saved output (memory_efficient) the statistics' dependence on the input is not rebuilt (mean and
// rstd are no outputs of the forward's node, so no graph path leads from them to the input): such a backward
// refuses to form second derivatives.
#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/version.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "norm.h"

namespace layernorm_ext {
namespace {

using torch::autograd::variable_list;

// ---- which tensor the backward reads ------------------------------------------------------------------------

// Tensors whose values cannot be read here: fake tensors of torch.compile / export, functional wrappers of a
// traced graph, DTensors and other Python subclasses, torch.func's batched and grad-tracking wrappers, meta
// tensors, or any tensor while a Python dispatch mode (FakeTensorMode, a tracer) is active.
bool values_unreadable(const Tensor& t) {
  constexpr c10::DispatchKeySet kFunctorch =
      c10::DispatchKeySet({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper});
  return t.is_meta() || t.unsafeGetTensorImpl()->is_python_dispatch() ||
         at::functionalization::impl::isFunctionalTensor(t) || t.key_set().has_any(kFunctorch) ||
         c10::impl::TorchDispatchModeTLS::stack_len() > 0;
}

// ---- memory_efficient: whether the backward may recover xhat from the output --------------------------------
//
// The backward recovers xhat = (out - bias) / scale, scale = weight + weight_offset, from the output rounded to its
// dtype (unit roundoff u, smallest normal `tiny`, largest finite `max`). Rounding y = xhat * scale + bias to that
// dtype errs by at most u * max(|y|, tiny), so the recovered xhat errs by at most
//   u * (|xhat| + (|bias| + tiny) / |scale|)                                                       per element,
// against a few u * |xhat| for the xhat that the default path computes from the input. The recovery is as good
// as that (tests/test_memory_efficient.py holds it to the suite's accuracy rule) when the call's values satisfy
//   (a) weight and bias finite, and |scale| * sqrt(cols) + |bias| <= max / 2 in every column: no output can
//       overflow (|xhat| < sqrt(cols) in any row);
//   (b) (|bias| + tiny) / |scale| <= kMaxBiasOverScale * rms(xhat) in every column and row, where a row's
//       rms(xhat)^2 = var * rstd^2 = 1 - eps * rstd^2 (LayerNorm and RMSNorm alike): the error term beside
//       u * |xhat| stays within a few u of the row's xhat. It fails for a weight entry 0 or tiny against its bias,
//       for outputs in the subnormals, and for rows whose variance is far below eps (their xhat is small). Rows
//       with a non-finite rstd (NaN or infinite input) are left out: their output and gradients are NaN whatever
//       is saved, as ATen's.
// The verdict is formed at every forward from that call's tensors, never cached (a parameter can change without
// a version bump: fused optimizers, FSDP2's unshard, collectives, .data). It is read at once and the input is
// saved where it fails: exact gradients (on CUDA the read is a host sync per forward). The environment variable
// below chooses the device's way instead, on any device: no read, the output always saved with the 0-dim
// verdict, and the backward poisons a failed call's recovery (every dx and dweight NaN). CUDA took that way by
// default until an H200 run (2026-12-04) showed how often it fails: 33 CUDA tests got NaN gradients, 15 of them
// of ordinary random weights; a zero-padded row fails it too.
constexpr double kMaxBiasOverScale = 4.0;
constexpr const char* kDeviceVerdictVariable = "LAYERNORM_EXT_MEMEFF_DEVICE_VERDICT";

template <class T>
std::pair<double, double> tiny_and_max() {
  return {static_cast<double>(std::numeric_limits<T>::min()), static_cast<double>(std::numeric_limits<T>::max())};
}

// The verdict of (a) and (b) for one call as a 0-dim bool tensor on the parameters' device, in ATen ops without a
// host read (no sync; safe under tracing of values). out_dtype: the output's; rstd: the forward's per-row rstd;
// eps: the one the forward used. Written as what is safe, so that NaN (every comparison false) fails.
Tensor recovery_verdict(at::ScalarType out_dtype, const OptTensor& weight, const OptTensor& bias,
                        double weight_offset, const Tensor& rstd, double eps) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // parameters may require grad; nothing here is a graph
  const auto [tiny, max] = out_dtype == at::kHalf       ? tiny_and_max<at::Half>()
                           : out_dtype == at::kBFloat16 ? tiny_and_max<at::BFloat16>()
                           : out_dtype == at::kFloat    ? tiny_and_max<float>()
                                                        : tiny_and_max<double>();
  const Tensor& param = weight.has_value() ? *weight : *bias;
  const double root_cols = std::sqrt(static_cast<double>(param.numel()));
  // In float64 whatever the dtype: the bounds are compared exactly, and the tensors are O(cols).
  const Tensor scale = weight.has_value() ? (weight->to(at::kDouble) + weight_offset).abs() : Tensor();
  const Tensor shift = bias.has_value() ? bias->to(at::kDouble).abs() : Tensor();
  const Tensor reach = scale.defined() ? (shift.defined() ? scale * root_cols + shift : scale * root_cols)
                                       : shift + root_cols;
  Tensor safe = reach.amax().le(max / 2);  // (a); false for any NaN or infinite entry too
  // (b): the largest (|bias| + tiny) / |scale|, against the smallest row's rms(xhat) (1 without rows: none, or
  // can_save_output's question).
  const Tensor ratio = !shift.defined()  ? scale.amin().reciprocal() * tiny
                       : !scale.defined() ? (shift + tiny).amax()
                                          : ((shift + tiny) / scale).amax();
  if (rstd.defined() && rstd.numel() > 0) {
    const Tensor rstd_max = at::nan_to_num(rstd.to(at::kDouble), 0.0, 0.0, 0.0).amax();
    const Tensor rms_min = (1.0 - eps * rstd_max.square()).clamp_min(0.0).sqrt();
    safe.logical_and_(ratio.le(rms_min * kMaxBiasOverScale));
  } else {
    safe.logical_and_(ratio.le(kMaxBiasOverScale));
  }
  return safe;
}

bool device_verdict_requested() {
  const char* value = std::getenv(kDeviceVerdictVariable);
  return value != nullptr && value[0] == '1';
}

// What a memory_efficient forward saves: the output (saved_is_output) or the input; verdict: defined where the
// output is saved on a verdict that the backward checks (the device's way).
struct SavedChoice {
  bool saved_is_output = false;
  Tensor verdict;
};

bool capturing_cuda_graph(const Tensor& input) {
#ifdef LAYERNORM_EXT_WITH_CUDA
  return input.is_cuda() && cuda::stream_is_capturing(input.get_device());
#else
  (void)input;
  return false;
#endif
}

// Whether the call's circumstances let the output stand in for the input at all, before the values: not without
// memory_efficient; not with a residual (h is an output already: saving it costs no more than saving out); not
// when the output is coarser than the parameters (half input, float32 weight); not when the values are not
// real ones (tracing, DTensor, functorch wrappers) nor during CUDA graph capture (as before: replays must equal
// eager calls bitwise, and the captured choice cannot look at later values).
bool output_may_stand_in(const Tensor& input, const OptTensor& weight, const OptTensor& bias, bool memory_efficient,
                         bool has_residual) {
  if (!memory_efficient || has_residual) return false;
  for (const OptTensor& t : {weight, bias}) {
    if (t.has_value() && (t->scalar_type() != input.scalar_type() || values_unreadable(*t))) return false;
  }
  return !values_unreadable(input) && !capturing_cuda_graph(input);
}

}  // namespace

// The verdict on the parameters alone (as for rows of rms(xhat) 1), read on the host: for the CUDA emulation
// tests; a forward decides in choose_saved, with its rows.
bool can_save_output(const Tensor& input, const OptTensor& weight, const OptTensor& bias, bool memory_efficient,
                     bool has_residual, double weight_offset) {
  if (!output_may_stand_in(input, weight, bias, memory_efficient, has_residual)) return false;
  if (!weight.has_value() && !bias.has_value()) return true;
  if ((weight.has_value() ? *weight : *bias).numel() < 2) return false;  // rows of one element (choose_saved)
  return recovery_verdict(input.scalar_type(), weight, bias, weight_offset, Tensor(), 0.0).item<bool>();
}

namespace {

// The choice of a forward that recorded a graph (see recovery_verdict). out, rstd, eps: the forward's.
SavedChoice choose_saved(const Tensor& input, const Tensor& out, const Tensor& rstd, const OptTensor& weight,
                         const OptTensor& bias, bool memory_efficient, bool has_residual, double weight_offset,
                         double eps) {
  if (!output_may_stand_in(input, weight, bias, memory_efficient, has_residual)) return {};
  // Rows of one element: xhat is 0 or +-1 up to eps, and dx a cancellation that a recovered xhat cannot resolve.
  if (rstd.numel() > 0 && out.numel() / rstd.numel() < 2) return {};
  if (!weight.has_value() && !bias.has_value()) return {true, Tensor()};  // xhat is the output itself
  Tensor verdict = recovery_verdict(out.scalar_type(), weight, bias, weight_offset, rstd, eps);
  if (!device_verdict_requested()) return {verdict.item<bool>(), Tensor()};
  return {true, std::move(verdict)};
}

// ---- the forward ops ----------------------------------------------------------------------------------------

// The ops' signatures, as the schemas of bindings.cpp give them.
using LayerNormFwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, c10::SymIntArrayRef,
                                                                    const OptTensor&, const OptTensor&, double,
                                                                    const OptTensor&, bool, bool, double, bool);
using RmsNormFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, c10::SymIntArrayRef, const OptTensor&,
                                                         std::optional<double>, const OptTensor&, bool, bool,
                                                         double, bool);
using LayerNormBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                           const Tensor&, c10::SymIntArrayRef, const OptTensor&,
                                                           const OptTensor&, bool, const OptTensor&, double);
using RmsNormBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::SymIntArrayRef,
                                                 const OptTensor&, bool, const OptTensor&, double);

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const c10::TypedOperatorHandle<LayerNormFwdSig>& layer_norm_fwd_op() {
  static const auto op = find_op<LayerNormFwdSig>("layernorm_ext::layer_norm_fwd");
  return op;
}
const c10::TypedOperatorHandle<RmsNormFwdSig>& rms_norm_fwd_op() {
  static const auto op = find_op<RmsNormFwdSig>("layernorm_ext::rms_norm_fwd");
  return op;
}
const c10::TypedOperatorHandle<LayerNormBwdSig>& layer_norm_bwd_op() {
  static const auto op = find_op<LayerNormBwdSig>("layernorm_ext::layer_norm_bwd");
  return op;
}
const c10::TypedOperatorHandle<RmsNormBwdSig>& rms_norm_bwd_op() {
  static const auto op = find_op<RmsNormBwdSig>("layernorm_ext::rms_norm_bwd");
  return op;
}

// The normalized_shape of a backward: the last `dims` sizes of the saved rows (symbolic while tracing).
c10::SymIntArrayRef trailing_sizes(const Tensor& t, int64_t dims) {
  const c10::SymIntArrayRef sizes = t.sym_sizes();
  return sizes.slice(sizes.size() - static_cast<size_t>(dims));
}

// What a node's backward needs besides its saved tensors.
struct NodeState {
  bool rms = false, has_residual = false, saved_is_output = false;
  at::ScalarType input_dtype = at::kFloat, residual_dtype = at::kFloat, out_dtype = at::kFloat;
  int64_t dims = 0;  // len(normalized_shape)
  double weight_offset = 0.0;
};

// The backward of a forward node: the backward op on the saved tensors (undefined where absent). Gradients in
// the node's input slots: input, weight, bias, residual.
// verdict: the forward's recovery verdict where it saved its output on one (recovery_verdict); a failed one
// poisons the parameter that the recovery divides by (or subtracts), so that dx and dweight are NaN.
variable_list norm_backward(const NodeState& state, const variable_list& grads, const Tensor& saved,
                            const Tensor& mean, const Tensor& rstd, const Tensor& weight_t, const Tensor& bias_t,
                            const Tensor& verdict) {
  const auto poisoned = [&](const Tensor& t) {
    return at::where(verdict, t, std::numeric_limits<double>::quiet_NaN());
  };
  const bool poison = verdict.defined();
  const OptTensor weight =
      weight_t.defined() ? OptTensor(poison ? poisoned(weight_t) : weight_t) : std::nullopt;
  const OptTensor bias =
      bias_t.defined() ? OptTensor(poison && !weight_t.defined() ? poisoned(bias_t) : bias_t) : std::nullopt;
  const c10::SymIntArrayRef normalized_shape = trailing_sizes(saved, state.dims);
  Tensor grad_out = grads[0];
  if (!grad_out.defined()) {  // only residual_out was used
    grad_out = saved.new_zeros_symint(saved.sym_sizes(), saved.options().dtype(state.out_dtype));
  }
  const OptTensor grad_residual_out =
      state.has_residual && grads.size() > 1 && grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
  Tensor grad_h, grad_weight, grad_bias;
  if (state.rms) {
    std::tie(grad_h, grad_weight) = rms_norm_bwd_op().call(grad_out, saved, rstd, normalized_shape, weight,
                                                           state.saved_is_output, grad_residual_out,
                                                           state.weight_offset);
  } else {
    std::tie(grad_h, grad_weight, grad_bias) =
        layer_norm_bwd_op().call(grad_out, saved, mean, rstd, normalized_shape, weight, bias, state.saved_is_output,
                                 grad_residual_out, state.weight_offset);
  }
  // (cast_before_weight's rounding passes the gradient straight through.)
  return {grad_h.to(state.input_dtype), weight ? grad_weight : Tensor(), bias ? grad_bias : Tensor(),
          state.has_residual ? grad_h.to(state.residual_dtype) : Tensor()};
}

// Node pointers are std::shared_ptr in older torch and c10::intrusive_ptr in newer (2.13 on): both are spelled
// through these two templates (the branch not taken is never instantiated).
template <class N, class Base = torch::autograd::Node>
auto make_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Base>) {
    return c10::make_intrusive<N>();
  } else {
    // deleteNode (found by argument-dependent lookup) frees long chains of nodes without deep recursion.
    return std::shared_ptr<N>(new N(), [](Base* node) { deleteNode(node); });
  }
}
template <class Base>
auto self_ptr(Base* node) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Base>) {
    return node->getptr();
  } else {
    return node->shared_from_this();
  }
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
#define LAYERNORM_EXT_FUNCTIONAL_COMPILED_AUTOGRAD 1
// Compiled autograd from torch 2.7 on records a C++ node's backward as a call of a "functional" bound to Python:
// this one, with the saved tensors and the node's state as its arguments (their order: saved, mean, rstd, weight,
// bias, verdict, then NodeState's fields).
std::vector<c10::IValue> functional_args(const NodeState& s, variable_list saved) {
  std::vector<c10::IValue> args(saved.begin(), saved.end());
  for (const bool b : {s.rms, s.has_residual, s.saved_is_output}) args.emplace_back(b);
  for (const at::ScalarType t : {s.input_dtype, s.residual_dtype, s.out_dtype}) {
    args.emplace_back(static_cast<int64_t>(t));
  }
  args.emplace_back(s.dims);
  args.emplace_back(s.weight_offset);
  return args;
}

variable_list norm_backward_functional(const variable_list& grads, const std::vector<c10::IValue>& args) {
  NodeState s;
  s.rms = args[6].toBool();
  s.has_residual = args[7].toBool();
  s.saved_is_output = args[8].toBool();
  s.input_dtype = static_cast<at::ScalarType>(args[9].toInt());
  s.residual_dtype = static_cast<at::ScalarType>(args[10].toInt());
  s.out_dtype = static_cast<at::ScalarType>(args[11].toInt());
  s.dims = args[12].toInt();
  s.weight_offset = args[13].toDouble();
  const auto tensor = [&](size_t i) { return args[i].isTensor() ? args[i].toTensor() : Tensor(); };
  return norm_backward(s, grads, tensor(0), tensor(1), tensor(2), tensor(3), tensor(4), tensor(5));
}
#endif

// The node that LayerNorm and RMSNorm, with or without a residual, record: a hand-written torch::autograd::Node,
// as ATen's generated ones are (torch::autograd::Function's bookkeeping cost about 1 us more per call).
// Inputs (next edges): input, weight, bias, residual, always in these four slots (absent ones get an empty edge).
// Outputs: out, and residual_out (h) with a residual; the statistics and residual_out's placeholder are returned
// beside the node, not from it: nothing differentiates them. An unused output's gradient arrives undefined, not
// as zeros: backward makes only the one the kernel needs.
struct NormBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable saved_;  // input, h with a residual, or out in memory-efficient mode
  torch::autograd::SavedVariable mean_, rstd_, weight_, bias_;
  torch::autograd::SavedVariable verdict_;  // memory_efficient's verdict, where the backward checks it
  NodeState state_;

  std::array<torch::autograd::SavedVariable*, 6> saved_variables() {
    return {&saved_, &mean_, &rstd_, &weight_, &bias_, &verdict_};
  }

  std::string name() const override {
    return std::string(state_.has_residual ? "Add" : "") + (state_.rms ? "RmsNormBackward" : "LayerNormBackward");
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (torch::autograd::SavedVariable* v : saved_variables()) v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return norm_backward(state_, grads, saved_.unpack(self_ptr(static_cast<torch::autograd::Node*>(this))),
                         mean_.unpack(), rstd_.unpack(), weight_.unpack(), bias_.unpack(), verdict_.unpack());
  }

  // Compiled autograd (torch._dynamo.compiled_autograd): what identifies this node's backward (compiled_args: const
  // from torch 2.7 on, so both are declared and one overrides), and its backward on the traced graph's values.
  void collect_args(torch::dynamo::autograd::CompiledNodeArgs& args) const {
    args.collect(saved_, state_.saved_is_output || state_.has_residual);
    for (const torch::autograd::SavedVariable* v : {&mean_, &rstd_, &weight_, &bias_, &verdict_}) {
      args.collect(*v, false);
    }
    for (const bool b : {state_.rms, state_.has_residual, state_.saved_is_output}) args.collect(b);
    for (const at::ScalarType t : {state_.input_dtype, state_.residual_dtype, state_.out_dtype}) args.collect(t);
    args.collect(state_.dims);
    args.collect(state_.weight_offset);
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const { collect_args(args); }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) { collect_args(args); }

  variable_list apply_with_saved(const variable_list& grads,
                                 torch::dynamo::autograd::SwapSavedVariables& saved) override {
    for (torch::autograd::SavedVariable* v : saved_variables()) saved.before(*v);
#ifdef LAYERNORM_EXT_FUNCTIONAL_COMPILED_AUTOGRAD
    variable_list tensors;
    for (torch::autograd::SavedVariable* v : saved_variables()) tensors.push_back(v->unpack());
    const std::vector<c10::IValue> args = functional_args(state_, std::move(tensors));
    std::vector<at::TypePtr> schema;
    for (const c10::IValue& v : args) schema.push_back(v.isTensor() ? at::TensorType::get() : v.type());
    const auto& compiler = torch::dynamo::autograd::getPyCompilerInterface();
    // Bound anew on each compiled-autograd cache miss, under a fresh name (as C++ custom functions are).
    const std::string fn_name = compiler->bind_function(saved.get_py_compiler(), name(), norm_backward_functional,
                                                        schema, /*is_custom_function=*/true,
                                                        /*is_traceable=*/true);
    const c10::IValue output_metadata =
        torch::dynamo::autograd::IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
            torch::dynamo::autograd::get_input_metadata(next_edges()));
    variable_list result = compiler->call_function(saved.get_py_compiler(), "apply_functional", fn_name, grads,
                                                   args, output_metadata);
#else
    // Before 2.7, compiled autograd traces the backward as it runs here, on its proxy tensors.
    variable_list result = apply(variable_list(grads));
#endif
    for (torch::autograd::SavedVariable* v : saved_variables()) saved.after(*v);
    return result;
  }
};

bool requires_grad(const OptTensor& t) { return t.has_value() && t->requires_grad(); }

// Whether a forward records a node: grad mode on and some differentiable input requiring grad. Otherwise
// (no_grad, parameters frozen) the kernel runs directly, with none of the node's cost.
bool records_graph(const Tensor& input, const OptTensor& weight, const OptTensor& bias, const OptTensor& residual) {
  return c10::GradMode::is_enabled() &&
         (input.requires_grad() || requires_grad(weight) || requires_grad(bias) || requires_grad(residual));
}

// Forward-mode AD has no formula here: refuse dual tensors rather than drop their tangents.
void check_no_forward_grad(const char* op, const Tensor& input, const OptTensor& weight, const OptTensor& bias,
                           const OptTensor& residual) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(torch::autograd::isFwGradDefined(input) || torch::autograd::isFwGradDefined(weight) ||
                                torch::autograd::isFwGradDefined(bias) || torch::autograd::isFwGradDefined(residual)),
                              message("Trying to use forward AD with ", op,
                                      " that does not support it: layernorm_ext has no forward-mode "
                                      "derivative (use torch.nn.functional's norms, or reverse mode)"));
}

// The statistics and residual_out of a forward, with the node recorded on out (and residual_out) when a graph is.
template <class Forward>
std::tuple<Tensor, Tensor, Tensor, Tensor> record_forward(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                          const OptTensor& weight, const OptTensor& bias,
                                                          const OptTensor& residual, bool memory_efficient,
                                                          double weight_offset, double eps, bool rms,
                                                          const Forward& forward) {
  check_no_forward_grad(rms ? "rms_norm" : "layer_norm", input, weight, bias, residual);
  if (!records_graph(input, weight, bias, residual)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward();
  }
  auto node = make_node<NormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias, residual));
  Tensor out, residual_out, mean, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(out, residual_out, mean, rstd) = forward();
  }
  const bool has_residual = residual.has_value();
  const SavedChoice choice =
      choose_saved(input, out, rstd, weight, bias, memory_efficient, has_residual, weight_offset, eps);
  const bool saved_is_output = choice.saved_is_output;
  torch::autograd::set_history(out, node);
  if (has_residual) {
    // h = input + residual requires grad only where one of them does, as ATen's sum: its slot is still the
    // node's second output, an empty one otherwise (a weight alone requiring grad gives h no history).
    if (input.requires_grad() || residual->requires_grad()) {
      torch::autograd::set_history(residual_out, node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
  // out and h are this node's outputs (saved without their grad_fn, which is the node); the rest are inputs or
  // hold no graph.
  node->saved_ = torch::autograd::SavedVariable(saved_is_output ? out : (has_residual ? residual_out : input),
                                                /*is_output=*/saved_is_output || has_residual);
  if (mean.defined()) node->mean_ = torch::autograd::SavedVariable(mean, false);
  node->rstd_ = torch::autograd::SavedVariable(rstd, false);
  if (weight.has_value()) node->weight_ = torch::autograd::SavedVariable(*weight, false);
  if (bias.has_value()) node->bias_ = torch::autograd::SavedVariable(*bias, false);
  if (choice.verdict.defined()) node->verdict_ = torch::autograd::SavedVariable(choice.verdict, false);
  NodeState& state = node->state_;
  state.rms = rms;
  state.has_residual = has_residual;
  state.saved_is_output = saved_is_output;
  state.input_dtype = input.scalar_type();
  state.residual_dtype = has_residual ? residual->scalar_type() : input.scalar_type();
  state.out_dtype = out.scalar_type();
  state.dims = static_cast<int64_t>(normalized_shape.size());
  state.weight_offset = weight_offset;
  return {out, residual_out, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_autograd(const Tensor& input,
                                                               c10::SymIntArrayRef normalized_shape,
                                                               const OptTensor& weight, const OptTensor& bias,
                                                               double eps, const OptTensor& residual,
                                                               bool residual_in_fp32, bool memory_efficient,
                                                               double weight_offset, bool cast_before_weight) {
  return record_forward(input, normalized_shape, weight, bias, residual, memory_efficient, weight_offset, eps,
                        /*rms=*/false, [&] {
                          return layer_norm_fwd_op().call(input, normalized_shape, weight, bias, eps, residual,
                                                          residual_in_fp32, memory_efficient, weight_offset,
                                                          cast_before_weight);
                        });
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_autograd(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                     const OptTensor& weight, std::optional<double> eps,
                                                     const OptTensor& residual, bool residual_in_fp32,
                                                     bool memory_efficient, double weight_offset,
                                                     bool cast_before_weight) {
  // eps=None: the machine epsilon of the compute type (bindings.cpp), what the forward's rstd used.
  const double eps_used = eps.value_or(input.scalar_type() == at::kDouble
                                           ? std::numeric_limits<double>::epsilon()
                                           : static_cast<double>(std::numeric_limits<float>::epsilon()));
  const auto r = record_forward(input, normalized_shape, weight, std::nullopt, residual, memory_efficient,
                                weight_offset, eps_used, /*rms=*/true, [&] {
                                  const auto [out, residual_out, rstd] = rms_norm_fwd_op().call(
                                      input, normalized_shape, weight, eps, residual, residual_in_fp32,
                                      memory_efficient, weight_offset, cast_before_weight);
                                  return std::make_tuple(out, residual_out, Tensor(), rstd);
                                });
  return {std::get<0>(r), std::get<1>(r), std::get<3>(r)};
}

// ---- the backward ops ---------------------------------------------------------------------------------------

struct FormulaGrads {
  Tensor grad_input, grad_weight, grad_bias;
};

// The backward written in differentiable ATen ops, in float64 whatever the data: only second and higher
// derivatives are taken from it (computed in float32 they fell short of ATen's accuracy), and only when a graph
// of the backward is recorded, so first-order training never pays for it:
// with g = grad_out * weight, LayerNorm's dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), RMSNorm's
// dx = rstd * (g - xhat * mean(g * xhat)), plus grad_residual_out; dweight = sum over rows of grad_out * xhat,
// dbias = sum of grad_out.
FormulaGrads backward_formula(const Tensor& grad_out, const Tensor& saved, const OptTensor& mean, const Tensor& rstd,
                              int64_t dims, const OptTensor& weight, const OptTensor& bias,
                              const OptTensor& grad_residual_out, double weight_offset, bool rms) {
  const at::ScalarType acc = at::kDouble;
  const int64_t axis = saved.dim() - dims;
  std::vector<int64_t> row_dims, leading_dims;
  for (int64_t d = axis; d < saved.dim(); ++d) row_dims.push_back(d);
  for (int64_t d = 0; d < axis; ++d) leading_dims.push_back(d);
  // Statistics broadcast over the row: the leading sizes, then ones.
  c10::SymDimVector stat_sizes(saved.sym_sizes().begin(), saved.sym_sizes().begin() + axis);
  stat_sizes.resize(saved.dim(), 1);

  const Tensor x = saved.to(acc);
  const Tensor stored_rstd = rstd.view_symint(stat_sizes).to(acc);
  Tensor xhat, r;
  if (rms) {
    const Tensor mean_square = x.square().mean(row_dims, /*keepdim=*/true);
    r = at::rsqrt(stored_rstd.square().reciprocal() + (mean_square - mean_square.detach()));
    xhat = x * r;
  } else {
    const Tensor row_mean = x.mean(row_dims, /*keepdim=*/true);
    const Tensor m = mean->view_symint(stat_sizes).to(acc) + (row_mean - row_mean.detach());
    const Tensor centered = x - m;
    const Tensor variance = centered.square().mean(row_dims, /*keepdim=*/true);
    r = at::rsqrt(stored_rstd.square().reciprocal() + (variance - variance.detach()));
    xhat = centered * r;
  }
  const Tensor dy = grad_out.to(acc);
  const Tensor g = weight.has_value() ? dy * (weight->to(acc) + weight_offset) : dy;
  Tensor inner = g - xhat * (g * xhat).mean(row_dims, /*keepdim=*/true);
  if (!rms) inner = inner - g.mean(row_dims, /*keepdim=*/true);
  Tensor dx = r * inner;
  if (grad_residual_out.has_value()) dx = dx + grad_residual_out->to(acc);

  FormulaGrads f;
  f.grad_input = dx.to(saved.scalar_type());
  // A sum over the leading dims (none for a single row: sum over an empty dim list would sum everything).
  const auto over_rows = [&](const Tensor& t) { return leading_dims.empty() ? t : t.sum(leading_dims); };
  if (weight.has_value()) f.grad_weight = over_rows(dy * xhat).to(weight->scalar_type());
  if (bias.has_value()) f.grad_bias = over_rows(dy).to(bias->scalar_type());
  return f;
}

// The kernel's values with the formula's derivatives, and no others: the kernel's result is detached, which under
// torch.func's nested transforms matters, since there the kernel call below this level's autograd is
// differentiated again at the outer level (each level records its own node), and its derivatives added to the
// formula's counted them twice. (Where the formula overflows, formula - formula.detach() would be NaN: that term
// is 0 there.)
Tensor with_derivatives(const Tensor& kernel, const Tensor& formula) {
  if (!formula.defined()) return kernel;
  const Tensor zero_valued = formula - formula.detach();
  return kernel.detach() + at::where(formula.detach().isfinite(), zero_valued, at::zeros_like(zero_valued));
}

bool needs_graph(const Tensor& grad_out, const Tensor& saved, const OptTensor& weight, const OptTensor& bias,
                 const OptTensor& grad_residual_out) {
  return c10::GradMode::is_enabled() && (grad_out.requires_grad() || saved.requires_grad() ||
                                         requires_grad(weight) || requires_grad(bias) ||
                                         requires_grad(grad_residual_out));
}

void check_second_order_possible(bool saved_is_output, const char* op) {
  TORCH_CHECK(!saved_is_output,
              message(op,
                      ": double backward (a backward with create_graph=True) is not supported with "
                      "memory_efficient=True: that forward saved its output instead of its input, and second "
                      "derivatives are formed from the input only. Call the norm with memory_efficient=False to "
                      "differentiate its gradients."));
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_autograd(const Tensor& grad_out, const Tensor& saved,
                                                           const Tensor& mean, const Tensor& rstd,
                                                           c10::SymIntArrayRef normalized_shape,
                                                           const OptTensor& weight, const OptTensor& bias,
                                                           bool saved_is_output, const OptTensor& grad_residual_out,
                                                           double weight_offset) {
  const bool graph = needs_graph(grad_out, saved, weight, bias, grad_residual_out);
  if (graph) check_second_order_possible(saved_is_output, "layer_norm_backward");
  Tensor grad_input, grad_weight, grad_bias;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(grad_input, grad_weight, grad_bias) = layer_norm_bwd_op().call(
        grad_out, saved, mean, rstd, normalized_shape, weight, bias, saved_is_output, grad_residual_out,
        weight_offset);
  }
  if (!graph) return {grad_input, grad_weight, grad_bias};
  const FormulaGrads f = backward_formula(grad_out, saved, mean, rstd, static_cast<int64_t>(normalized_shape.size()),
                                          weight, bias, grad_residual_out, weight_offset, /*rms=*/false);
  return {with_derivatives(grad_input, f.grad_input), with_derivatives(grad_weight, f.grad_weight),
          with_derivatives(grad_bias, f.grad_bias)};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_autograd(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                                 c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                                 bool saved_is_output, const OptTensor& grad_residual_out,
                                                 double weight_offset) {
  const bool graph = needs_graph(grad_out, saved, weight, std::nullopt, grad_residual_out);
  if (graph) check_second_order_possible(saved_is_output, "rms_norm_backward");
  Tensor grad_input, grad_weight;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(grad_input, grad_weight) =
        rms_norm_bwd_op().call(grad_out, saved, rstd, normalized_shape, weight, saved_is_output, grad_residual_out,
                               weight_offset);
  }
  if (!graph) return {grad_input, grad_weight};
  const FormulaGrads f = backward_formula(grad_out, saved, std::nullopt, rstd,
                                          static_cast<int64_t>(normalized_shape.size()), weight, std::nullopt,
                                          grad_residual_out, weight_offset, /*rms=*/true);
  return {with_derivatives(grad_input, f.grad_input), with_derivatives(grad_weight, f.grad_weight)};
}

// ---- the functional API: the forward ops, less what they drop ----------------------------------------------

// What a functional op's forward call leaves out (OutputsUnread, norm.h): for plain tensors residual_out's
// placeholder, and with no graph recorded (so no backward reads them; the op returns the output only) the
// statistics too. Nothing for a subclass, DTensor, torch.compile's fake and functional tensors or a Python mode
// (values_unreadable): they get the forward op's outputs as they expect them.
void leave_unread(std::optional<OutputsUnread>& guard, const Tensor& input, const OptTensor& weight,
                  const OptTensor& bias, const OptTensor& residual) {
  auto plain = [](const OptTensor& t) { return !t.has_value() || !values_unreadable(*t); };
  if (plain(input) && plain(weight) && plain(bias) && plain(residual)) {
    guard.emplace(/*statistics=*/!records_graph(input, weight, bias, residual));
  }
}

Tensor layer_norm(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                  const OptTensor& bias, double eps, bool memory_efficient, double weight_offset,
                  bool cast_before_weight) {
  std::optional<OutputsUnread> unread;
  leave_unread(unread, input, weight, bias, std::nullopt);
  return std::get<0>(layer_norm_fwd_op().call(input, normalized_shape, weight, bias, eps, std::nullopt, false,
                                              memory_efficient, weight_offset, cast_before_weight));
}

Tensor rms_norm(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                std::optional<double> eps, bool memory_efficient, double weight_offset, bool cast_before_weight) {
  std::optional<OutputsUnread> unread;
  leave_unread(unread, input, weight, std::nullopt, std::nullopt);
  return std::get<0>(rms_norm_fwd_op().call(input, normalized_shape, weight, eps, std::nullopt, false,
                                            memory_efficient, weight_offset, cast_before_weight));
}

std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& input, const Tensor& residual,
                                          c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                          const OptTensor& bias, double eps, bool residual_in_fp32,
                                          bool memory_efficient, double weight_offset, bool cast_before_weight) {
  std::optional<OutputsUnread> unread;
  leave_unread(unread, input, weight, bias, residual);
  const auto r = layer_norm_fwd_op().call(input, normalized_shape, weight, bias, eps, residual, residual_in_fp32,
                                          memory_efficient, weight_offset, cast_before_weight);
  return {std::get<0>(r), std::get<1>(r)};
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& input, const Tensor& residual,
                                        c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                        std::optional<double> eps, bool residual_in_fp32, bool memory_efficient,
                                        double weight_offset, bool cast_before_weight) {
  std::optional<OutputsUnread> unread;
  leave_unread(unread, input, weight, std::nullopt, residual);
  const auto r = rms_norm_fwd_op().call(input, normalized_shape, weight, eps, residual, residual_in_fp32,
                                        memory_efficient, weight_offset, cast_before_weight);
  return {std::get<0>(r), std::get<1>(r)};
}

}  // namespace

TORCH_LIBRARY_IMPL(layernorm_ext, CompositeImplicitAutograd, m) {
  m.impl("layer_norm", &layer_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}

namespace {

// The inference ops (out=, in place and quantized output), boxed: one body per dispatch key for all eight.
constexpr std::array<const char*, 8> kInferenceOps = {"layer_norm_into",       "rms_norm_into",
                                                      "add_layer_norm_",       "add_rms_norm_",
                                                      "layer_norm_quant",      "rms_norm_quant",
                                                      "layer_norm_quant_into", "rms_norm_quant_into"};

// Autograd key: as ATen's out= ops, they refuse arguments that require grad while grad mode is on (their results
// would have no graph) and dual tensors; then the call goes on to ADInplaceOrView.
void inference_op_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const std::string& qualified = schema.name();
  const std::string name = qualified.substr(qualified.rfind(':') + 1);  // without "layernorm_ext::"
  const size_t count = schema.arguments().size();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(count);
  for (size_t i = 0; i < count; ++i) {
    if (!first[i].isTensor()) continue;
    const Tensor& t = first[i].toTensor();
    const c10::Argument& arg = schema.arguments()[i];
    TORCH_CHECK(
        !(c10::GradMode::is_enabled() && t.requires_grad()),
        message(name,
                ": the inference ops (out=, in place, quantized output) don't support automatic differentiation, but ",
                arg.name(),
                " requires grad; call them under torch.no_grad() / torch.inference_mode(), or use the functional "
                "form without out="));
    TORCH_CHECK_NOT_IMPLEMENTED(!torch::autograd::isFwGradDefined(t), message("Trying to use forward AD with ", name,
                                                                              " that does not support it: ", arg.name(),
                                                                              " is a dual tensor, and layernorm_ext "
                                                                              "has no forward-mode derivative"));
  }
  at::AutoDispatchBelowAutograd below_autograd;
  op.callBoxed(stack);
}

// ADInplaceOrView key: run the kernel, then bump the version of every tensor written, as ATen's in-place and out=
// ops do. Here, not on the Autograd key: torch.inference_mode() skips that key but not this one for normal
// tensors, and a graph recorded before that saved such a tensor must see it changed (autograd then raises).
void inference_op_inplace_or_view(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t count = schema.arguments().size();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(count);
  std::vector<Tensor> written;
  for (size_t i = 0; i < count; ++i) {
    const c10::AliasInfo* alias = schema.arguments()[i].alias_info();
    if (first[i].isTensor() && alias != nullptr && alias->isWrite()) written.push_back(first[i].toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView below_view;
    op.callBoxed(stack);
  }
  for (const Tensor& t : written) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(layernorm_ext, ADInplaceOrView, m) {
  for (const char* name : kInferenceOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inference_op_inplace_or_view>());
  }
}

TORCH_LIBRARY_IMPL(layernorm_ext, Autograd, m) {
  m.impl("layer_norm_fwd", &layer_norm_autograd);
  m.impl("rms_norm_fwd", &rms_norm_autograd);
  m.impl("layer_norm_bwd", &layer_norm_bwd_autograd);
  m.impl("rms_norm_bwd", &rms_norm_bwd_autograd);
  for (const char* name : kInferenceOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inference_op_autograd>());
  }
}

}  // namespace layernorm_ext
