// The functional API's eager entry points (layernorm_ext/functional.py): CPython functions that parse their
// arguments with torch's own PythonArgParser (what torch's generated bindings use) and call the op through the
// dispatcher, the GIL released. torch.ops' generic entry converts every argument through the op's schema into
// IValues, which costs about 0.8 us per call more (measured on ATen's native_layer_norm both ways); at the
// sizes of decoding that is most of a call. Same op, same dispatch: autograd, DTensor, autocast and fake
// tensors act on it as on the OpOverload. __torch_function__ overrides are handled by the Python caller, as
// torch.nn.functional does; while dynamo traces, the caller uses the OpOverload.
// python_arg_parser.h formats its messages with fmt, whose compiled part torch does not export: use it inline.
#define FMT_HEADER_ONLY
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_arg_parser.h>

#include <type_traits>

#include "norm.h"

namespace layernorm_ext {
namespace {

template <class Signature>
const c10::TypedOperatorHandle<Signature>& op_handle(const char* name) {
  // One handle per op name (each instantiation is called with one name only).
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return handle;
}

using LayerNormSig = Tensor(const Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&, double, bool,
                            double, bool);
using RmsNormSig = Tensor(const Tensor&, c10::SymIntArrayRef, const OptTensor&, std::optional<double>, bool, double,
                          bool);
using AddLayerNormSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, c10::SymIntArrayRef,
                                                   const OptTensor&, const OptTensor&, double, bool, bool, double,
                                                   bool);
using AddRmsNormSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, c10::SymIntArrayRef, const OptTensor&,
                                                 std::optional<double>, bool, bool, double, bool);
using LayerNormIntoSig = void(const Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&, double,
                              const Tensor&, const OptTensor&, const OptTensor&, bool, double, bool);
using RmsNormIntoSig = void(const Tensor&, c10::SymIntArrayRef, const OptTensor&, std::optional<double>, const Tensor&,
                            const OptTensor&, const OptTensor&, bool, double, bool);
using AddLayerNormInplaceSig = void(const Tensor&, const Tensor&, c10::SymIntArrayRef, const OptTensor&,
                                    const OptTensor&, double, double, bool);
using AddRmsNormInplaceSig = void(const Tensor&, const Tensor&, c10::SymIntArrayRef, const OptTensor&,
                                  std::optional<double>, double, bool);

PyObject* wrap(Tensor out) { return THPVariable_Wrap(std::move(out)); }

PyObject* wrap(std::tuple<Tensor, Tensor> outs) {
  PyObject* tuple = PyTuple_New(2);
  if (tuple == nullptr) return nullptr;
  PyTuple_SET_ITEM(tuple, 0, THPVariable_Wrap(std::move(std::get<0>(outs))));
  PyTuple_SET_ITEM(tuple, 1, THPVariable_Wrap(std::move(std::get<1>(outs))));
  return tuple;
}

// Parses (args, kwargs) with the parser, then `call(parsed)`: each entry point's own argument extraction (with
// the GIL) and op call (through call_without_gil). Errors become Python exceptions as in torch's bindings.
template <size_t N, class Call>
PyObject* parse_and_call(torch::PythonArgParser& parser, PyObject* args, PyObject* kwargs, const Call& call) {
  HANDLE_TH_ERRORS
  torch::ParsedArgs<N> parsed;
  torch::PythonArgs r = parser.parse(args, kwargs, parsed);
  return call(r);
  END_HANDLE_TH_ERRORS
}

// The op called with arguments already taken from Python, the GIL released meanwhile (None for the ops that
// return nothing: the inference ops write into their arguments).
template <class Signature, class... Args>
PyObject* call_without_gil(const char* op, const Args&... args) {
  const auto& handle = op_handle<Signature>(op);
  if constexpr (std::is_void_v<decltype(handle.call(args...))>) {
    {
      pybind11::gil_scoped_release no_gil;
      handle.call(args...);
    }
    Py_RETURN_NONE;
  } else {
    decltype(handle.call(args...)) result;
    {
      pybind11::gil_scoped_release no_gil;
      result = handle.call(args...);
    }
    return wrap(std::move(result));
  }
}

PyObject* layer_norm(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "layer_norm(Tensor input, SymIntArrayRef normalized_shape, Tensor? weight=None, Tensor? bias=None, "
      "double eps=1e-05, bool memory_efficient=False, double weight_offset=0, bool cast_before_weight=False)",
  });
  return parse_and_call<8>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<LayerNormSig>("layernorm_ext::layer_norm", r.tensor(0), r.symintlist(1),
                                          r.optionalTensor(2), r.optionalTensor(3), r.toDouble(4), r.toBool(5),
                                          r.toDouble(6), r.toBool(7));
  });
}

PyObject* rms_norm(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "rms_norm(Tensor input, SymIntArrayRef normalized_shape, Tensor? weight=None, double? eps=None, "
      "bool memory_efficient=False, double weight_offset=0, bool cast_before_weight=False)",
  });
  return parse_and_call<7>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<RmsNormSig>("layernorm_ext::rms_norm", r.tensor(0), r.symintlist(1),
                                        r.optionalTensor(2), r.toDoubleOptional(3), r.toBool(4), r.toDouble(5),
                                        r.toBool(6));
  });
}

PyObject* add_layer_norm(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "add_layer_norm(Tensor input, Tensor residual, SymIntArrayRef normalized_shape, Tensor? weight=None, "
      "Tensor? bias=None, double eps=1e-05, bool residual_in_fp32=False, bool memory_efficient=False, "
      "double weight_offset=0, bool cast_before_weight=False)",
  });
  return parse_and_call<10>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<AddLayerNormSig>("layernorm_ext::add_layer_norm", r.tensor(0), r.tensor(1),
                                             r.symintlist(2), r.optionalTensor(3), r.optionalTensor(4),
                                             r.toDouble(5), r.toBool(6), r.toBool(7), r.toDouble(8), r.toBool(9));
  });
}

PyObject* add_rms_norm(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "add_rms_norm(Tensor input, Tensor residual, SymIntArrayRef normalized_shape, Tensor? weight=None, "
      "double? eps=None, bool residual_in_fp32=False, bool memory_efficient=False, double weight_offset=0, "
      "bool cast_before_weight=False)",
  });
  return parse_and_call<9>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<AddRmsNormSig>("layernorm_ext::add_rms_norm", r.tensor(0), r.tensor(1),
                                           r.symintlist(2), r.optionalTensor(3), r.toDoubleOptional(4),
                                           r.toBool(5), r.toBool(6), r.toDouble(7), r.toBool(8));
  });
}

PyObject* layer_norm_into(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "layer_norm_into(Tensor input, SymIntArrayRef normalized_shape, Tensor? weight, Tensor? bias, double eps, "
      "Tensor out, Tensor? residual=None, Tensor? residual_out=None, bool residual_in_fp32=False, "
      "double weight_offset=0, bool cast_before_weight=False)",
  });
  return parse_and_call<11>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<LayerNormIntoSig>("layernorm_ext::layer_norm_into", r.tensor(0), r.symintlist(1),
                                              r.optionalTensor(2), r.optionalTensor(3), r.toDouble(4), r.tensor(5),
                                              r.optionalTensor(6), r.optionalTensor(7), r.toBool(8), r.toDouble(9),
                                              r.toBool(10));
  });
}

PyObject* rms_norm_into(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "rms_norm_into(Tensor input, SymIntArrayRef normalized_shape, Tensor? weight, double? eps, Tensor out, "
      "Tensor? residual=None, Tensor? residual_out=None, bool residual_in_fp32=False, double weight_offset=0, "
      "bool cast_before_weight=False)",
  });
  return parse_and_call<10>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<RmsNormIntoSig>("layernorm_ext::rms_norm_into", r.tensor(0), r.symintlist(1),
                                            r.optionalTensor(2), r.toDoubleOptional(3), r.tensor(4),
                                            r.optionalTensor(5), r.optionalTensor(6), r.toBool(7), r.toDouble(8),
                                            r.toBool(9));
  });
}

PyObject* add_layer_norm_(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "add_layer_norm_(Tensor input, Tensor residual, SymIntArrayRef normalized_shape, Tensor? weight=None, "
      "Tensor? bias=None, double eps=1e-05, double weight_offset=0, bool cast_before_weight=False)",
  });
  return parse_and_call<8>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<AddLayerNormInplaceSig>("layernorm_ext::add_layer_norm_", r.tensor(0), r.tensor(1),
                                                    r.symintlist(2), r.optionalTensor(3), r.optionalTensor(4),
                                                    r.toDouble(5), r.toDouble(6), r.toBool(7));
  });
}

PyObject* add_rms_norm_(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static torch::PythonArgParser parser({
      "add_rms_norm_(Tensor input, Tensor residual, SymIntArrayRef normalized_shape, Tensor? weight=None, "
      "double? eps=None, double weight_offset=0, bool cast_before_weight=False)",
  });
  return parse_and_call<7>(parser, args, kwargs, [](torch::PythonArgs& r) {
    return call_without_gil<AddRmsNormInplaceSig>("layernorm_ext::add_rms_norm_", r.tensor(0), r.tensor(1),
                                                  r.symintlist(2), r.optionalTensor(3), r.toDoubleOptional(4),
                                                  r.toDouble(5), r.toBool(6));
  });
}

PyMethodDef methods[] = {
    {"layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(layer_norm)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::layer_norm (eager entry of functional.layer_norm)"},
    {"rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rms_norm)), METH_VARARGS | METH_KEYWORDS,
     "the op layernorm_ext::rms_norm (eager entry of functional.rms_norm)"},
    {"add_layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_layer_norm)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::add_layer_norm (eager entry of functional.add_layer_norm)"},
    {"add_rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_rms_norm)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::add_rms_norm (eager entry of functional.add_rms_norm)"},
    {"layer_norm_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(layer_norm_into)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::layer_norm_into (eager entry of out=)"},
    {"rms_norm_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rms_norm_into)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::rms_norm_into (eager entry of out=)"},
    {"add_layer_norm_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_layer_norm_)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::add_layer_norm_ (eager entry of functional.add_layer_norm_)"},
    {"add_rms_norm_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_rms_norm_)),
     METH_VARARGS | METH_KEYWORDS, "the op layernorm_ext::add_rms_norm_ (eager entry of functional.add_rms_norm_)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void add_python_functions(PyObject* module) {
  if (PyModule_AddFunctions(module, methods) != 0) throw pybind11::error_already_set();
}

}  // namespace layernorm_ext
