// The CPU floor of benchmarks/cpu_floor.py: the row kernels' loads, conversions and stores (csrc/cpu/rows_simd.h)
// in loops that do no norm arithmetic, per instruction set, 1 thread.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include <immintrin.h>

#define LNX_TARGET "avx2,fma,f16c"
#define LNX_ISA_NS isa_avx2
#define LNX_FLOAT_LANES 8
#define LNX_F16C 1
#include "floor_isa.h"

#define LNX_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define LNX_ISA_NS isa_avx512
#define LNX_FLOAT_LANES 16
#define LNX_F16C 1
#include "floor_isa.h"

// kind: "convert" (one pass) or "two_pass"; isa: avx2, avx512 or avx512_bf16 (vcvtneps2bf16 stores).
void run_floor(const std::string& kind, const std::string& isa, const torch::Tensor& x, torch::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.sizes() == out.sizes() && x.dtype() == out.dtype());
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
  TORCH_CHECK(kind == "convert" || kind == "two_pass", "kind: convert or two_pass");
  const int k = kind == "convert" ? 0 : 1, dtype = x.scalar_type() == torch::kFloat ? 0 : 1;
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (isa == "avx2") {
    layernorm_ext::cpu::isa_avx2::floor_loop(k, dtype, false, x.data_ptr(), out.data_ptr(), rows, cols);
  } else {
    TORCH_CHECK(isa == "avx512" || isa == "avx512_bf16", "isa: avx2, avx512 or avx512_bf16");
    const bool native = isa == "avx512_bf16";
    layernorm_ext::cpu::isa_avx512::floor_loop(k, dtype, native, x.data_ptr(), out.data_ptr(), rows, cols);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("floor", &run_floor); }
