// The floor loops, compiled once per instruction set (floor.cpp includes this twice, as csrc/cpu/rows_<isa>.cpp
// include rows_impl.h): rows_simd.h's own loads, conversions and stores, without the norm's arithmetic.
#define LNX_PRAGMA_TEXT(text) _Pragma(#text)
#define LNX_PRAGMA(text) LNX_PRAGMA_TEXT(text)
LNX_PRAGMA(GCC push_options)
LNX_PRAGMA(GCC target(LNX_TARGET))
#define LNX_ROWS_IMPL 1
#include "../../csrc/cpu/rows_simd.h"
#undef LNX_ROWS_IMPL

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

// body(src, dst, cols) on each row of a contiguous [rows, cols] pair.
template <class T, class Body>
void each_row(const T* x, T* out, int64_t rows, int64_t cols, Body body) {
  for (int64_t row = 0; row < rows; ++row) body(x + row * cols, out + row * cols, cols);
}

// One pass per row: out = x, each vector loaded and converted to float, then converted and stored.
template <class T>
void convert_rows(const T* x, T* out, int64_t rows, int64_t cols) {
  using C = ComputeOf<T>;
  constexpr int64_t L = kLanes<C>;
  each_row(x, out, rows, cols, [](const T* src, T* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += L) store_at<C>(dst, j, min64(L, n - j), load_at<C>(src, j, min64(L, n - j)));
  });
}

// A norm's two passes with the least arithmetic: a sum per row (one add a vector, four accumulators), then the
// row scaled by it and stored (one multiply a vector).
template <class T>
void two_pass_rows(const T* x, T* out, int64_t rows, int64_t cols) {
  using C = ComputeOf<T>;
  constexpr int64_t L = kLanes<C>;
  each_row(x, out, rows, cols, [](const T* src, T* dst, int64_t n) {
    Vec<C> acc[4] = {};
    int64_t j = 0;
    for (; j + 4 * L <= n; j += 4 * L) {
      for (int a = 0; a < 4; ++a) acc[a] += load<C>(src + j + a * L);
    }
    for (; j < n; j += L) acc[0] += load_at<C>(src, j, min64(L, n - j));
    const double sum = horizontal_sum(widen<C>((acc[0] + acc[1]) + (acc[2] + acc[3])));
    const Vec<C> scale =
        broadcast<C>(static_cast<C>(static_cast<double>(n) / (static_cast<double>(n) + __builtin_fabs(sum))));
    for (j = 0; j < n; j += L) store_at<C>(dst, j, min64(L, n - j), load_at<C>(src, j, min64(L, n - j)) * scale);
  });
}

}  // namespace

void floor_loop(int kind, int dtype, bool native, const void* x, void* out, int64_t rows, int64_t cols) {
  native_bf16 = native && kFloatLanes == 16;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (kind == 0) {
      convert_rows(static_cast<const T*>(x), static_cast<T*>(out), rows, cols);
    } else {
      two_pass_rows(static_cast<const T*>(x), static_cast<T*>(out), rows, cols);
    }
  };
  if (dtype == 0) {
    run(float{});
  } else {
    run(bf16{});
  }
}

}  // namespace LNX_ISA_NS
}  // namespace cpu
}  // namespace layernorm_ext
LNX_PRAGMA(GCC pop_options)
#undef LNX_TARGET
#undef LNX_ISA_NS
#undef LNX_FLOAT_LANES
#undef LNX_F16C
