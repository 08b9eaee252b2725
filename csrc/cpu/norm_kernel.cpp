// CPU orchestration: picks the instruction set once, resolves dtypes to row kernels (rows_impl.h, compiled
// per ISA), and spreads rows over threads with at::parallel_for.
//
// Forward: rows split across threads, one thread per row (rows_impl.h has the per-row passes).
// Backward: rows grouped into a fixed number of chunks (it depends on rows and cols only, never on the thread
// count); each chunk adds its rows' dweight/dbias into its own double partial buffer, then the partials are
// reduced in chunk order, parallel over columns: the same bits whatever the thread count.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "../norm.h"
#include "row_kernels.h"

namespace layernorm_ext {
namespace cpu {
namespace {

constexpr int64_t kParallelGrainElems = 1 << 15;  // elements per parallel task at least
constexpr int64_t kMaxChunks = 64;                // backward partials: chunks of rows
constexpr int64_t kMaxPartialElems = 1 << 22;     // cap on chunks * cols per partial buffer

// ---- instruction set ----------------------------------------------------------------------------------------
bool cpu_has(const char* isa) {
  const std::string name(isa);
  if (name == "scalar") return true;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (name == "avx2") return avx2;
  if (name == "avx512") {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
#endif
  return false;
}

const RowKernels* kernels_for(const std::string& isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == "avx512") return &avx512_row_kernels();
  if (isa == "avx2") return &avx2_row_kernels();
#endif
  if (isa == "scalar") return &portable_row_kernels();
  return nullptr;
}

constexpr const char* kIsaOrder[] = {"avx512", "avx2", "scalar"};

// The best ISA the CPU has, or LAYERNORM_EXT_CPU_ISA when it names one the CPU has (a lower one).
std::string initial_isa() {
  const char* requested = std::getenv("LAYERNORM_EXT_CPU_ISA");
  for (const char* isa : kIsaOrder) {
    if (!cpu_has(isa)) continue;
    if (requested == nullptr || *requested == '\0') return isa;
    break;
  }
  const std::string want(requested);
  TORCH_CHECK(want == "scalar" || want == "avx2" || want == "avx512",
              "LAYERNORM_EXT_CPU_ISA must be one of scalar, avx2, avx512, but got '", want, "'");
  if (cpu_has(want.c_str())) return want;
  for (const char* isa : kIsaOrder) {
    if (cpu_has(isa)) {
      TORCH_WARN("LAYERNORM_EXT_CPU_ISA=", want, ": this CPU lacks it; using ", isa);
      return isa;
    }
  }
  return "scalar";
}

std::mutex isa_mutex;
const RowKernels* active = nullptr;

const RowKernels& kernels() {
  std::lock_guard<std::mutex> lock(isa_mutex);
  if (active == nullptr) active = kernels_for(initial_isa());
  return *active;
}

// ---- dtypes -------------------------------------------------------------------------------------------------
Dtype to_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return Dtype::f32;
    case ScalarType::Double:
      return Dtype::f64;
    case ScalarType::BFloat16:
      return Dtype::bf16;
    case ScalarType::Half:
      return Dtype::f16;
    default:
      TORCH_CHECK(false, "layernorm_ext: unsupported dtype ", t);
  }
}

template <typename To>
std::vector<To> param_as(const void* ptr, ScalarType type, int64_t cols) {
  std::vector<To> v(ptr != nullptr ? cols : 0);
  if (ptr == nullptr) return v;
  auto convert = [&](auto tag) {
    using From = decltype(tag);
    const From* src = static_cast<const From*>(ptr);
    for (int64_t j = 0; j < cols; ++j) v[j] = static_cast<To>(src[j]);
  };
  switch (type) {
    case ScalarType::Float:
      convert(float{});
      break;
    case ScalarType::Double:
      convert(double{});
      break;
    case ScalarType::BFloat16:
      convert(c10::BFloat16{});
      break;
    case ScalarType::Half:
      convert(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "layernorm_ext: unsupported parameter dtype ", type);
  }
  return v;
}

void store_param(const double* src, void* dst, ScalarType type, int64_t offset, int64_t count) {
  auto convert = [&](auto tag) {
    using To = decltype(tag);
    To* out = static_cast<To*>(dst) + offset;
    for (int64_t j = 0; j < count; ++j) out[j] = static_cast<To>(src[j]);
  };
  switch (type) {
    case ScalarType::Float:
      convert(float{});
      break;
    case ScalarType::Double:
      convert(double{});
      break;
    case ScalarType::BFloat16:
      convert(c10::BFloat16{});
      break;
    case ScalarType::Half:
      convert(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "layernorm_ext: unsupported parameter dtype ", type);
  }
}

template <typename C>
void forward_with(const NormForwardParams& p, const RowKernels& k) {
  const std::vector<C> weight = param_as<C>(p.weight, p.weight_type, p.cols);
  const std::vector<C> bias = param_as<C>(p.bias, p.weight_type, p.cols);
  const Dtype src = to_dtype(p.residual != nullptr ? p.h_type : p.input_type);
  const ForwardRowsFn rows_fn = k.forward_rows(src, to_dtype(p.input_type));
  TORCH_CHECK(rows_fn != nullptr, "layernorm_ext: no CPU kernel for rows of ", p.h_type, " and output ",
              p.input_type);
  ForwardRows a{};
  a.input = p.input;
  a.residual = p.residual;
  a.residual_out = p.residual_out;
  if (p.residual != nullptr) {
    a.add_row = k.add_row(to_dtype(p.input_type), to_dtype(p.residual_type), to_dtype(p.h_type));
    TORCH_CHECK(a.add_row != nullptr, "layernorm_ext: no CPU kernel adding ", p.input_type, " and ",
                p.residual_type, " into ", p.h_type);
  }
  a.out = p.out;
  a.weight = weight.empty() ? nullptr : weight.data();
  a.bias = bias.empty() ? nullptr : bias.data();
  a.mean = p.mean;
  a.rstd = p.rstd;
  a.cols = p.cols;
  a.eps = p.eps;
  a.rms = p.rms;
  const int64_t grain = std::max<int64_t>(1, kParallelGrainElems / p.cols);
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { rows_fn(a, begin, end); });
}

}  // namespace

const char* isa_name() { return kernels().isa; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* isa : kIsaOrder) {
    if (cpu_has(isa)) out.emplace_back(isa);
  }
  return out;
}

std::string set_isa(const std::string& isa) {
  TORCH_CHECK(kernels_for(isa) != nullptr, "layernorm_ext: unknown CPU instruction set '", isa,
              "' (expected scalar, avx2 or avx512)");
  TORCH_CHECK(cpu_has(isa.c_str()), "layernorm_ext: this CPU does not support ", isa);
  const std::string previous = isa_name();
  std::lock_guard<std::mutex> lock(isa_mutex);
  active = kernels_for(isa);
  return previous;
}

void forward(const NormForwardParams& p) {
  const RowKernels& k = kernels();
  if (p.acc_type == ScalarType::Double) {
    forward_with<double>(p, k);
  } else {
    forward_with<float>(p, k);
  }
}

void backward(const NormBackwardParams& p) {
  const RowKernels& k = kernels();
  const int64_t rows = p.rows;
  const int64_t cols = p.cols;
  const std::vector<double> weight = param_as<double>(p.weight, p.weight_type, cols);
  const std::vector<double> bias = param_as<double>(p.bias, p.weight_type, cols);
  const BackwardRowsFn rows_fn = k.backward_rows(to_dtype(p.saved_type), to_dtype(p.out_type));
  TORCH_CHECK(rows_fn != nullptr, "layernorm_ext: no CPU backward kernel for ", p.saved_type, " rows and ",
              p.out_type, " gradients");
  BackwardRows a{};
  a.grad_out = p.grad_out;
  a.grad_residual_out = p.grad_residual_out;
  a.saved = p.saved;
  a.rstd = p.rstd;
  a.weight = weight.empty() ? nullptr : weight.data();
  a.bias = bias.empty() ? nullptr : bias.data();
  a.grad_input = p.grad_input;
  a.cols = cols;
  a.rms = p.rms;
  a.saved_is_output = p.saved_is_output;
  a.stats_double = p.acc_type == ScalarType::Double;

  const int64_t chunks_wanted = std::clamp<int64_t>(std::min(kMaxChunks, kMaxPartialElems / cols), 1, rows);
  const int64_t chunk_rows = (rows + chunks_wanted - 1) / chunks_wanted;
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  const bool want_dweight = p.grad_weight != nullptr;
  const bool want_dbias = p.grad_bias != nullptr;
  std::vector<double> dweight_partial(want_dweight ? chunks * cols : 0);
  std::vector<double> dbias_partial(want_dbias ? chunks * cols : 0);

  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      rows_fn(a, c * chunk_rows, std::min(rows, (c + 1) * chunk_rows),
              want_dweight ? dweight_partial.data() + c * cols : nullptr,
              want_dbias ? dbias_partial.data() + c * cols : nullptr);
    }
  });

  auto reduce = [&](const std::vector<double>& partial, void* dst) {
    at::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
      std::vector<double> sum(partial.begin() + begin, partial.begin() + end);
      for (int64_t c = 1; c < chunks; ++c) {
        const double* src = partial.data() + c * cols;
        for (int64_t j = begin; j < end; ++j) sum[j - begin] += src[j];
      }
      store_param(sum.data(), dst, p.weight_type, begin, end - begin);
    });
  };
  if (want_dweight) reduce(dweight_partial, p.grad_weight);
  if (want_dbias) reduce(dbias_partial, p.grad_bias);
}

}  // namespace cpu
}  // namespace layernorm_ext
