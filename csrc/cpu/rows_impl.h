// Row kernels for LayerNorm and RMSNorm (a runtime flag), forward and backward, every dtype pair the ops produce: one
// templated body, compiled once per instruction set. The including file (rows_<isa>.cpp) defines first:
//   LNX_ISA_NS       namespace for this copy (its symbols never meet another ISA's at link time)
//   LNX_ISA_NAME     "scalar" | "avx2" | "avx512" (also "avx512_bf16": this copy with set_native_bf16 on)
//   LNX_FLOAT_LANES  floats per vector: 4 (SSE2 baseline) | 8 | 16
//   LNX_F16C         1 where vcvtph2ps / vcvtps2ph may be used
//   LNX_ENTRY        name of the function returning this copy's RowKernels
//   LNX_TARGET       (optional) the GCC target string of the instruction set, e.g. "avx2,fma,f16c"
// Vectors are GCC vector extensions of LNX_FLOAT_LANES * 4 bytes, so LNX_TARGET picks the instructions; the
// bfloat16/float16 conversions use intrinsics (x86-64 only: SSE2 at least).
//
// Parts, included below in this order (no include guards, like this file: each rows_<isa>.cpp is its own
// translation unit and includes them once, under its own LNX_ISA_NS and LNX_TARGET):
//   rows_simd.h      element types, vectors, float16 / bfloat16 conversions, loads, stores, row sums
//   rows_forward.h   h = x + r, the forward rows, quantized output
//   rows_backward.h  the backward rows
//   columns.h        channels-first rows (elements plane apart, the lanes consecutive rows), forward and backward
// This file keeps the long rows split into column ranges (forward and backward), the lookup tables over the
// dtype enum and the entry, LNX_ENTRY.
//
// Isolation: LNX_TARGET applies only to the kernels below, not to the headers included first, and every
// kernel has internal linkage (the unnamed namespace); the one external symbol, LNX_ENTRY, is compiled for
// the baseline. An inline function or std:: template the kernels used would otherwise be emitted (at -O0:
// not inlined) as a weak symbol that other objects define too, and the linker keeps one copy for every
// caller: if the AVX-512 one, an illegal instruction on CPUs without it. Hence Array and Pair (rows_simd.h),
// not std::array / std::pair / std::tie; and the parts include no header (this file does, before LNX_TARGET).
// tests/test_cpu_isa.py checks the objects' symbols.
//
// Mapping: the caller hands each thread a range of rows (or, for a few very long rows, column ranges of one
// row); a row is handled by one thread, front to back, in vectors of the compute type (float; double for
// float64 rows, and in the backward of rows shorter than kFloatBackwardMinCols).
// Forward, per row: one pass from memory sums (x - s) and (x - s)^2 about a shift s, the mean of the first
// vector (RMSNorm: x^2); only if s turns out far from the mean (rarely) a second pass from cache sums about
// the mean. The mean is kept as hi + lo (two floats) so that mean-1e4 / std-1e-2 rows stay exact; the last
// pass re-reads the row from cache, normalizes and stores. Backward, per group of kRowGroup rows: each row's
// sums of g, g * d and d (d = x - the forward's mean, g = dy * weight) from memory, two rows at a time, with
// their dweight / dbias terms (from the stored mean, as ATen's), then dx column block by column block from cache,
// two rows at a time (short rows of 16-bit types take their dweight / dbias terms there instead, summed in
// registers for the two rows before one read-modify-write of the partial sums).
// Registers hold two vector accumulators per sum; float sums are flushed into double vectors every
// kFlushVectors vectors and the lanes added at the end of the row.
#include <cstdint>
#include <cstring>
#include <tuple>  // std::tuple_element_t only (a type)
#include <type_traits>
#include <utility>  // std::index_sequence only (a type)

#include <immintrin.h>

#include "../quant_math.h"
#include "row_kernels.h"

#ifdef LNX_TARGET
#define LNX_PRAGMA_TEXT(text) _Pragma(#text)
#define LNX_PRAGMA(text) LNX_PRAGMA_TEXT(text)  // expands LNX_TARGET, which #pragma GCC target would not
LNX_PRAGMA(GCC push_options)
LNX_PRAGMA(GCC target(LNX_TARGET))
#endif

// The parts below check that they are included from here, after the headers and inside LNX_TARGET.
#define LNX_ROWS_IMPL 1
#include "rows_simd.h"
#include "rows_forward.h"
#include "rows_backward.h"
#include "columns.h"

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

// ---- one long row split into column ranges across threads ---------------------------------------------------
// Forward: sums about center over src[begin, end): {sum(x - center), sum((x - center)^2)}.
template <class S>
void segment_sums(const void* src, int64_t begin, int64_t end, double center, double* out) {
  using C = ComputeOf<S>;
  const S* x = static_cast<const S*>(src) + begin;
  const auto [dev, sq] = centered_sums(x, end - begin, static_cast<C>(center));
  out[0] = dev;
  out[1] = sq;
}

// Forward: normalize columns [c0, c1) of one row, given its mean and rstd.
template <class S, class Y>
void segment_normalize(const ForwardRows& a, int64_t row, int64_t c0, int64_t c1, double mean, double rstd) {
  using C = ComputeOf<S>;
  const S* src = a.residual != nullptr ? static_cast<const S*>(a.residual_out) + a.residual_out_rows.offset(row)
                                       : static_cast<const S*>(a.input) + a.input_rows.offset(row);
  src += c0;
  Y* out = static_cast<Y*>(a.out) + a.out_rows.offset(row) + c0;
  const C* weight = a.weight != nullptr ? static_cast<const C*>(a.weight) + c0 : nullptr;
  const C* bias = a.bias != nullptr ? static_cast<const C*>(a.bias) + c0 : nullptr;
  const C hi = static_cast<C>(mean), lo = static_cast<C>(mean - static_cast<double>(hi));
  const C scale = static_cast<C>(rstd);
  normalize(a.rms, src, out, weight, bias, c1 - c0, hi, lo, scale, a.cast_before_weight, a.stream_out);
  if (a.stream_out) _mm_sfence();
}

// Backward over columns [c0, c1) of one row: the three sums, then (given the whole row's sums) dx and the
// dweight / dbias terms.
template <class S, class G>
void backward_segment_sums(const BackwardRows& a, int64_t row, int64_t c0, int64_t c1, double* out) {
  auto run = [&](auto compute_tag) {
    using C = decltype(compute_tag);
    const Array<double, 3> s =
        BackwardRow<S, G, C>(a, row, param_as<C>(a, false), param_as<C>(a, true)).sums(c0, c1);
    for (int k = 0; k < 3; ++k) out[k] = s[k];
  };
  if constexpr (kFloatCapable<S, G>) {
    if (use_float<S, G>(a.cols)) return run(float{});
  }
  run(double{});
}

template <class S, class G>
void backward_segment_apply(const BackwardRows& a, int64_t row, int64_t c0, int64_t c1, const double* row_sums3,
                            void* dweight, void* dbias) {
  auto run = [&](auto compute_tag) {
    using C = decltype(compute_tag);
    const BackwardRow<S, G, C> r(a, row, param_as<C>(a, false), param_as<C>(a, true));
    const BackwardCoefficients k = backward_coefficients(a, r.rstd, {row_sums3[0], row_sums3[1], row_sums3[2]});
    r.apply(c0, c1, k.delta, k.mean_g, k.mean_gx, static_cast<C*>(dweight), static_cast<C*>(dbias));
  };
  if constexpr (kFloatCapable<S, G>) {
    if (use_float<S, G>(a.cols)) return run(float{});
  }
  run(double{});
}

// ---- the backward's dweight / dbias partials -----------------------------------------------------------------
// Columns [0, count) of `chunks` partials of T, stride elements apart, summed into sum in chunk order, in double:
// sum = 0.0 + chunk 0, then += each next chunk (norm_kernel.cpp, reduce_partials). Column by column, so a
// vector of columns gives each column's sum the same bits as one at a time.
template <class T>
void sum_chunks(const void* partials, int64_t chunks, int64_t stride, int64_t count, double* sum) {
  constexpr int64_t L = kLanes<double>;
  const T* first = static_cast<const T*>(partials);
  for (int64_t j = 0; j < count; j += L) {
    const int64_t n = min64(L, count - j);
    store_at<double>(sum, j, n, Vec<double>{} + load_at<double>(first, j, n));
  }
  for (int64_t c = 1; c < chunks; ++c) {
    const T* src = first + c * stride;
    for (int64_t j = 0; j < count; j += L) {
      const int64_t n = min64(L, count - j);
      store_at<double>(sum, j, n, load_at<double>(sum, j, n) + load_at<double>(src, j, n));
    }
  }
}

// ---- lookup tables over the dtype enum (f32, f64, bf16, f16) ------------------------------------------------
template <int I>
using TypeAt = std::tuple_element_t<I, std::tuple<float, double, bf16, f16>>;

template <int X, int R, int H>
constexpr AddRowFn add_entry() {
  // h has the promoted type: float64 when either operand is, and only then.
  constexpr bool any_double = X == 1 || R == 1;
  if constexpr (any_double != (H == 1)) {
    return nullptr;
  } else {
    return &add_row<TypeAt<X>, TypeAt<R>, TypeAt<H>>;
  }
}

template <size_t... I>
constexpr auto make_add_table(std::index_sequence<I...>) {
  return Array<AddRowFn, sizeof...(I)>{add_entry<I / 16, (I / 4) % 4, I % 4>()...};
}

template <template <int, int> class Entry, size_t... I>
constexpr auto make_pair_table(std::index_sequence<I...>) {
  return Array<decltype(Entry<0, 0>::value), sizeof...(I)>{Entry<I / 4, I % 4>::value...};
}

// The dtype pairs the ops produce, and only they get a kernel (the others nullptr, no code in the build). Rows:
// (S, Y) = (rows, output) forward and (saved, grad_out) backward, S at least as wide as Y (promote(Y, S) == S, the
// argument checks' rule: h is the promoted dtype of input and residual; the saved rows are h or the output; a
// float64 weight's backward runs on rows widened to float64). Channels-first rows: the output's own dtype only
// (norm_ops.cpp: no residual, grad_out in saved's dtype).
template <int S, int Y>
constexpr bool kRowPair = S == Y || S == 1 || (S == 0 && (Y == 2 || Y == 3));
template <int S, int Y>
constexpr bool kColumnPair = S == Y;

// Entry<S, Y>::value: the kernel of the pair, or nullptr.
template <int S, int Y>
struct ForwardEntry {
  static constexpr ForwardRowsFn value = [] {
    if constexpr (kRowPair<S, Y>) return ForwardRowsFn{&forward_rows<TypeAt<S>, TypeAt<Y>>};
    else return ForwardRowsFn{nullptr};
  }();
};
template <int S, int Y>
struct NormalizeEntry {
  static constexpr SegmentNormalizeFn value = [] {
    if constexpr (kRowPair<S, Y>) return SegmentNormalizeFn{&segment_normalize<TypeAt<S>, TypeAt<Y>>};
    else return SegmentNormalizeFn{nullptr};
  }();
};
template <int S, int Y>
struct ForwardColumnsEntry {
  static constexpr ForwardColumnsFn value = [] {
    if constexpr (kColumnPair<S, Y>) return ForwardColumnsFn{&forward_columns<TypeAt<S>, TypeAt<Y>>};
    else return ForwardColumnsFn{nullptr};
  }();
};
template <int S, int G>
struct BackwardColumnsEntry {
  static constexpr BackwardColumnsFn value = [] {
    if constexpr (kColumnPair<S, G>) return BackwardColumnsFn{&backward_columns<TypeAt<S>, TypeAt<G>>};
    else return BackwardColumnsFn{nullptr};
  }();
};
template <int S, int G>
struct BackwardEntry {
  static constexpr BackwardRowsFn value = [] {
    if constexpr (kRowPair<S, G>) return BackwardRowsFn{&backward_rows<TypeAt<S>, TypeAt<G>>};
    else return BackwardRowsFn{nullptr};
  }();
};
template <int S, int G>
struct BackwardSumsEntry {
  static constexpr BackwardSegmentSumsFn value = [] {
    if constexpr (kRowPair<S, G>) return BackwardSegmentSumsFn{&backward_segment_sums<TypeAt<S>, TypeAt<G>>};
    else return BackwardSegmentSumsFn{nullptr};
  }();
};
template <int S, int G>
struct BackwardApplyEntry {
  static constexpr BackwardSegmentApplyFn value = [] {
    if constexpr (kRowPair<S, G>) return BackwardSegmentApplyFn{&backward_segment_apply<TypeAt<S>, TypeAt<G>>};
    else return BackwardSegmentApplyFn{nullptr};
  }();
};

constexpr auto kAddTable = make_add_table(std::make_index_sequence<64>{});
constexpr auto kForwardTable = make_pair_table<ForwardEntry>(std::make_index_sequence<16>{});
constexpr auto kNormalizeTable = make_pair_table<NormalizeEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardTable = make_pair_table<BackwardEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardSumsTable = make_pair_table<BackwardSumsEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardApplyTable = make_pair_table<BackwardApplyEntry>(std::make_index_sequence<16>{});
constexpr auto kForwardColumnsTable = make_pair_table<ForwardColumnsEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardColumnsTable = make_pair_table<BackwardColumnsEntry>(std::make_index_sequence<16>{});
constexpr Array<SegmentSumsFn, 4> kSegmentSumsTable{&segment_sums<float>, &segment_sums<double>,
                                                     &segment_sums<bf16>, &segment_sums<f16>};
constexpr Array<SumChunksFn, 4> kSumChunksTable{&sum_chunks<float>, &sum_chunks<double>, nullptr, nullptr};

int pair_index(Dtype a, Dtype b) { return static_cast<int>(a) * 4 + static_cast<int>(b); }

AddRowFn lookup_add(Dtype x, Dtype r, Dtype h) {
  return kAddTable[static_cast<int>(x) * 16 + static_cast<int>(r) * 4 + static_cast<int>(h)];
}
ForwardRowsFn lookup_forward(Dtype src, Dtype out) { return kForwardTable[pair_index(src, out)]; }
BackwardRowsFn lookup_backward(Dtype saved, Dtype grad_out) { return kBackwardTable[pair_index(saved, grad_out)]; }
SegmentSumsFn lookup_segment_sums(Dtype src) { return kSegmentSumsTable[static_cast<int>(src)]; }
SegmentNormalizeFn lookup_segment_normalize(Dtype src, Dtype out) { return kNormalizeTable[pair_index(src, out)]; }
BackwardSegmentSumsFn lookup_backward_segment_sums(Dtype saved, Dtype grad_out) {
  return kBackwardSumsTable[pair_index(saved, grad_out)];
}
BackwardSegmentApplyFn lookup_backward_segment_apply(Dtype saved, Dtype grad_out) {
  return kBackwardApplyTable[pair_index(saved, grad_out)];
}
ForwardColumnsFn lookup_forward_columns(Dtype src, Dtype out) { return kForwardColumnsTable[pair_index(src, out)]; }
BackwardColumnsFn lookup_backward_columns(Dtype saved, Dtype grad_out) {
  return kBackwardColumnsTable[pair_index(saved, grad_out)];
}
SumChunksFn lookup_sum_chunks(Dtype partial) { return kSumChunksTable[static_cast<int>(partial)]; }

void set_native_bf16(bool on) { native_bf16 = on && kFloatLanes == 16; }

}  // namespace
}  // namespace LNX_ISA_NS

#ifdef LNX_TARGET
LNX_PRAGMA(GCC pop_options)  // the entry only stores the kernels' addresses: baseline code
#endif

const RowKernels& LNX_ENTRY() {
  static const RowKernels kernels{LNX_ISA_NAME,
                                  &LNX_ISA_NS::lookup_add,
                                  &LNX_ISA_NS::lookup_forward,
                                  &LNX_ISA_NS::lookup_backward,
                                  &LNX_ISA_NS::lookup_segment_sums,
                                  &LNX_ISA_NS::lookup_segment_normalize,
                                  &LNX_ISA_NS::lookup_backward_segment_sums,
                                  &LNX_ISA_NS::lookup_backward_segment_apply,
                                  &LNX_ISA_NS::lookup_forward_columns,
                                  &LNX_ISA_NS::lookup_backward_columns,
                                  &LNX_ISA_NS::lookup_sum_chunks,
                                  &LNX_ISA_NS::set_native_bf16};
  return kernels;
}

}  // namespace cpu
}  // namespace layernorm_ext
