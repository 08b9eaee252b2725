// Row kernels for LayerNorm and RMSNorm (a runtime flag), forward and backward, every dtype pair: one
// templated body, compiled once per instruction set. The including file (rows_<isa>.cpp) defines first:
//   LNX_ISA_NS       namespace for this copy (its symbols never meet another ISA's at link time)
//   LNX_ISA_NAME     "scalar" | "avx2" | "avx512"
//   LNX_FLOAT_LANES  floats per vector: 4 (SSE2 baseline) | 8 | 16
//   LNX_F16C         1 where vcvtph2ps / vcvtps2ph may be used
//   LNX_ENTRY        name of the function returning this copy's RowKernels
//   LNX_TARGET       (optional) the GCC target string of the instruction set, e.g. "avx2,fma,f16c"
// Vectors are GCC vector extensions of LNX_FLOAT_LANES * 4 bytes, so LNX_TARGET picks the instructions; the
// bfloat16/float16 conversions use intrinsics (x86-64 only: SSE2 at least).
//
// Isolation: LNX_TARGET applies only to the kernels below, not to the headers included first, and every
// kernel has internal linkage (the unnamed namespace); the one external symbol, LNX_ENTRY, is compiled for
// the baseline. An inline function or std:: template the kernels used would otherwise be emitted (at -O0:
// not inlined) as a weak symbol that other objects define too, and the linker keeps one copy for every
// caller: if the AVX-512 one, an illegal instruction on CPUs without it. Hence Array and Pair below, not
// std::array / std::pair / std::tie. tests/test_cpu_isa.py checks the objects' symbols.
//
// Mapping: the caller hands each thread a range of rows (or, for a few very long rows, column ranges of one
// row); a row is handled by one thread, front to back, in vectors of the compute type (float; double for
// float64 rows, and in the backward of rows shorter than kFloatBackwardMinCols).
// Forward, per row: one pass from memory sums (x - s) and (x - s)^2 about a shift s, the mean of the first
// vector (RMSNorm: x^2); only if s turns out far from the mean (rarely) a second pass from cache sums about
// the mean. The mean is kept as hi + lo (two floats) so that mean-1e4 / std-1e-2 rows stay exact; the last
// pass re-reads the row from cache, normalizes and stores. Backward, per group of kRowGroup rows: each row's
// sums of g, g * d and d (d = x - the forward's mean, g = dy * weight) from memory, two rows at a time, then
// dx and the dweight / dbias terms column block by column block from cache, two rows at a time (their
// dweight / dbias terms summed in registers before one read-modify-write of the partial sums).
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

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

// std::array / std::pair stand-ins whose member functions have internal linkage (see Isolation above).
template <class T, int64_t N>
struct Array {
  T items[N];
  constexpr T& operator[](int64_t i) { return items[i]; }
  constexpr const T& operator[](int64_t i) const { return items[i]; }
};
template <class T>
struct Pair {
  T first, second;
};

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

constexpr int kFloatLanes = LNX_FLOAT_LANES;
constexpr int64_t kFlushVectors = 16;
// LayerNorm's one-pass variance about a shift s loses (mean - s)^2 / var relative precision: above this
// ratio the sums are taken again about the mean.
constexpr double kMaxShiftSq = 0.25;

template <class C>
struct VecOf {
  static constexpr int lanes = kFloatLanes * 4 / static_cast<int>(sizeof(C));
  typedef C type __attribute__((vector_size(kFloatLanes * 4)));
  typedef std::conditional_t<sizeof(C) == 4, int32_t, int64_t> mask_elem;
  typedef mask_elem mask __attribute__((vector_size(kFloatLanes * 4)));
};
template <class C>
using Vec = typename VecOf<C>::type;
template <class C>
constexpr int kLanes = VecOf<C>::lanes;

template <int N>
struct FloatN {
  typedef float type __attribute__((vector_size(N * 4)));
};
template <int N>
struct U16N {
  typedef uint16_t type __attribute__((vector_size(N * 2)));
};
template <int N>
struct U32N {
  typedef uint32_t type __attribute__((vector_size(N * 4)));
};

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- float16 <-> float without F16C (the portable copy) ----------------------------------------------------
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  float out;
  if (exponent == 0) {
    out = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // subnormal: mantissa * 2^-24
    return sign ? -out : out;
  }
  const uint32_t bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13))
                                       : (sign | ((exponent + 112u) << 23) | (mantissa << 13));
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, inf
  if (x >= 0x477ff000u) return sign | 0x7c00u;                                // rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: a float16 subnormal (or 0); scale to units of 2^-24, round
    float magnitude;
    std::memcpy(&magnitude, &x, 4);
    volatile float shifted = magnitude * 16777216.0f + 8388608.0f;  // rounds to an integer (even on ties)
    return sign | static_cast<uint16_t>(static_cast<uint32_t>(shifted - 8388608.0f));
  }
  x -= 112u << 23;
  return sign | static_cast<uint16_t>((x + 0xfffu + ((x >> 13) & 1u)) >> 13);
}

// ---- loads: N values of T as N floats -----------------------------------------------------------------------
template <int N>
inline typename FloatN<N>::type load_floats(const float* p) {
  typename FloatN<N>::type v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 -> float is a 16-bit shift; written with intrinsics, GCC's generic vector code for it is poor.
template <int N>
inline typename FloatN<N>::type load_floats(const bf16* p) {
  typename FloatN<N>::type v;
  if constexpr (N == 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i bits = _mm512_slli_epi32(wide, 16);
    std::memcpy(&v, &bits, 64);
  } else if constexpr (N == 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i bits = _mm256_slli_epi32(wide, 16);
    std::memcpy(&v, &bits, 32);
  } else if constexpr (N == 4) {  // SSE2: interleaving zeros below each value is the shift
    const __m128i bits = _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&v, &bits, 16);
  } else {
    for (int i = 0; i < N; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[i].bits) << 16;
      std::memcpy(&v[i], &bits, 4);
    }
  }
  return v;
}

template <int N>
inline typename FloatN<N>::type load_floats(const f16* p) {
  typename FloatN<N>::type v;
#if LNX_F16C
  if constexpr (N == 16) {
    __m256i h;
    std::memcpy(&h, p, 32);
    const __m512 f = _mm512_cvtph_ps(h);
    std::memcpy(&v, &f, 64);
  } else if constexpr (N == 8) {
    __m128i h;
    std::memcpy(&h, p, 16);
    const __m256 f = _mm256_cvtph_ps(h);
    std::memcpy(&v, &f, 32);
  } else if constexpr (N == 4) {
    int64_t h64;
    std::memcpy(&h64, p, 8);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi64_si128(h64));
    std::memcpy(&v, &f, 16);
  } else {
    for (int i = 0; i < N; ++i) v[i] = half_to_float(p[i].bits);
  }
#else
  for (int i = 0; i < N; ++i) v[i] = half_to_float(p[i].bits);
#endif
  return v;
}

// ---- stores: N floats as N values of T (round to nearest even) --------------------------------------------
template <int N>
inline void store_floats(float* p, typename FloatN<N>::type v) {
  std::memcpy(p, &v, sizeof v);
}

// float -> bfloat16, round to nearest even, NaN kept quiet: (bits + 0x7fff + lsb) >> 16.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <int N>
inline void store_floats(bf16* p, typename FloatN<N>::type v) {
  if constexpr (N == 16) {
    __m512 f;
    std::memcpy(&f, &v, 64);
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  } else if constexpr (N == 8) {
    __m256 f;
    std::memcpy(&f, &v, 32);
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else if constexpr (N == 4) {  // SSE2
    __m128 f;
    std::memcpy(&f, &v, 16);
    const __m128i bits = _mm_castps_si128(f);
    const __m128i high = _mm_srli_epi32(bits, 16);
    const __m128i bias = _mm_add_epi32(_mm_and_si128(high, _mm_set1_epi32(1)), _mm_set1_epi32(0x7fff));
    __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, bias), 16);
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(f, f));
    rounded = _mm_or_si128(_mm_andnot_si128(nan, rounded), _mm_and_si128(nan, _mm_or_si128(high, _mm_set1_epi32(0x40))));
    // Sign-extend the low 16 bits so that the signed saturating pack keeps them as they are.
    const __m128i signed16 = _mm_srai_epi32(_mm_slli_epi32(rounded, 16), 16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(signed16, signed16));
  } else {
    for (int i = 0; i < N; ++i) p[i].bits = float_to_bf16(v[i]);
  }
}

template <int N>
inline void store_floats(f16* p, typename FloatN<N>::type v) {
#if LNX_F16C
  if constexpr (N == 16) {
    __m512 f;
    std::memcpy(&f, &v, 64);
    const __m256i h = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(p, &h, 32);
  } else if constexpr (N == 8) {
    __m256 f;
    std::memcpy(&f, &v, 32);
    const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(p, &h, 16);
  } else if constexpr (N == 4) {
    __m128 f;
    std::memcpy(&f, &v, 16);
    const int64_t h64 = _mm_cvtsi128_si64(_mm_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    std::memcpy(p, &h64, 8);
  } else {
    for (int i = 0; i < N; ++i) p[i].bits = float_to_half(v[i]);
  }
#else
  for (int i = 0; i < N; ++i) p[i].bits = float_to_half(v[i]);
#endif
}

// ---- a vector of the compute type C from / to storage type T --------------------------------------------
template <class C, class T>
inline Vec<C> load(const T* p) {
  if constexpr (std::is_same_v<C, T>) {
    Vec<C> v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else if constexpr (std::is_same_v<C, float>) {
    return load_floats<kLanes<float>>(p);
  } else {
    return __builtin_convertvector(load_floats<kLanes<double>>(p), Vec<double>);
  }
}

template <class C, class T>
inline void store(T* p, Vec<C> v) {
  if constexpr (std::is_same_v<C, T>) {
    std::memcpy(p, &v, sizeof v);
  } else if constexpr (std::is_same_v<C, float>) {
    store_floats<kLanes<float>>(p, v);
  } else {
    store_floats<kLanes<double>>(p, __builtin_convertvector(v, typename FloatN<kLanes<double>>::type));
  }
}

// count < lanes values (the row's tail), the rest of the vector zero.
template <class C, class T>
inline Vec<C> load_part(const T* p, int64_t count) {
  T buf[kLanes<C>] = {};
  std::memcpy(buf, p, static_cast<size_t>(count) * sizeof(T));
  return load<C>(buf);
}

template <class C, class T>
inline void store_part(T* p, Vec<C> v, int64_t count) {
  T buf[kLanes<C>];
  store<C>(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(count) * sizeof(T));
}

// Elements [j, j + count) of row p, count <= lanes.
template <class C, class T>
inline Vec<C> load_at(const T* p, int64_t j, int64_t count) {
  return count == kLanes<C> ? load<C>(p + j) : load_part<C>(p + j, count);
}

template <class C, class T>
inline void store_at(T* p, int64_t j, int64_t count, Vec<C> v) {
  if (count == kLanes<C>) {
    store<C>(p + j, v);
  } else {
    store_part<C>(p + j, v, count);
  }
}

template <class C>
inline Vec<C> broadcast(C value) {
  return Vec<C>{} + value;
}

// Lanes at index >= count set to 0.
template <class C>
inline Vec<C> keep_first(Vec<C> v, int64_t count) {
  using M = typename VecOf<C>::mask;
  M index;
  for (int i = 0; i < kLanes<C>; ++i) index[i] = i;
  return index < static_cast<typename VecOf<C>::mask_elem>(count) ? v : Vec<C>{};
}

// Sum of the N lanes of a vector, as a tree of half-width adds.
template <int N>
inline double tree_sum(const double* lanes) {
  if constexpr (N == 1) {
    return lanes[0];
  } else {
    return tree_sum<N / 2>(lanes) + tree_sum<N / 2>(lanes + N / 2);
  }
}

inline double horizontal_sum(Vec<double> v) {
  double lanes[kLanes<double>];
  std::memcpy(lanes, &v, sizeof v);
  return tree_sum<kLanes<double>>(lanes);
}

// Lanes [First, First + lanes of double) of a float vector.
template <int First, size_t... I>
inline typename FloatN<sizeof...(I)>::type half_of(Vec<float> v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (First + static_cast<int>(I))...);
}

// A vector of the compute type, widened to double lanes and folded to one double vector.
template <class C>
inline Vec<double> widen(Vec<C> v) {
  if constexpr (std::is_same_v<C, double>) {
    return v;
  } else {
    // Halves by shuffles, not through memory: a half-width reload of a full-width store cannot be forwarded.
    const auto low = half_of<0>(v, std::make_index_sequence<kLanes<double>>{});
    const auto high = half_of<kLanes<double>>(v, std::make_index_sequence<kLanes<double>>{});
    return __builtin_convertvector(low, Vec<double>) + __builtin_convertvector(high, Vec<double>);
  }
}

// K sums over a row of n elements of the vector terms term(j, count) -> Array<Vec<C>, K>: two
// accumulators per sum, flushed into double vectors every kFlushVectors vectors; the tail's padding lanes
// are masked off.
template <class C, int K, class Term>
inline Array<double, K> row_sums_k(int64_t n, Term term) {
  constexpr int64_t L = kLanes<C>;
  const int64_t full = n - n % L;
  Array<Vec<double>, K> total = {};
  for (int64_t start = 0; start < full; start += kFlushVectors * L) {
    const int64_t stop = min64(full, start + kFlushVectors * L);
    Array<Vec<C>, K> acc0 = {}, acc1 = {};
    int64_t j = start;
    for (; j + 2 * L <= stop; j += 2 * L) {
      const Array<Vec<C>, K> t0 = term(j, L);
      const Array<Vec<C>, K> t1 = term(j + L, L);
      for (int k = 0; k < K; ++k) {
        acc0[k] += t0[k];
        acc1[k] += t1[k];
      }
    }
    if (j < stop) {
      const Array<Vec<C>, K> t0 = term(j, L);
      for (int k = 0; k < K; ++k) acc0[k] += t0[k];
    }
    for (int k = 0; k < K; ++k) total[k] += widen<C>(acc0[k] + acc1[k]);
  }
  if (full < n) {
    const Array<Vec<C>, K> t = term(full, n - full);
    for (int k = 0; k < K; ++k) total[k] += widen<C>(keep_first<C>(t[k], n - full));
  }
  Array<double, K> out;
  for (int k = 0; k < K; ++k) out[k] = horizontal_sum(total[k]);
  return out;
}

// Two sums: term(j, count) -> {Vec<C>, Vec<C>}.
template <class C, class Term>
inline Pair<double> row_sums(int64_t n, Term term) {
  const auto sums = row_sums_k<C, 2>(n, [&](int64_t j, int64_t count) {
    const auto t = term(j, count);
    return Array<Vec<C>, 2>{t.first, t.second};
  });
  return {sums[0], sums[1]};
}

template <class T>
using ComputeOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

// {sum(x - center), sum((x - center)^2)} over x[0, n), in the compute type Q.
template <class Q, class S>
inline Pair<double> centered_sums_in(const S* x, int64_t n, Q center) {
  const Vec<Q> center_v = broadcast<Q>(center);
  return row_sums<Q>(n, [&](int64_t j, int64_t count) {
    const Vec<Q> d = load_at<Q>(x, j, count) - center_v;
    return Pair<Vec<Q>>{d, d * d};
  });
}

// The same in S's compute type; where float squares overflowed (|x - center| beyond ~1.8e19, where ATen's
// float statistics give 0 or NaN) or the row holds an infinity, again in double: a second pass only there.
template <class S>
inline Pair<double> centered_sums(const S* x, int64_t n, ComputeOf<S> center) {
  Pair<double> sums = centered_sums_in(x, n, center);
  if (__builtin_isinf(sums.second)) sums = centered_sums_in(x, n, static_cast<double>(center));
  return sums;
}

// ---- h = x + r ----------------------------------------------------------------------------------------------
template <class X, class R, class H>
void add_row(const void* x_ptr, const void* r_ptr, void* h_ptr, int64_t offset, int64_t n) {
  using C = ComputeOf<H>;
  constexpr int64_t L = kLanes<C>;
  const X* x = static_cast<const X*>(x_ptr) + offset;
  const R* r = static_cast<const R*>(r_ptr) + offset;
  H* h = static_cast<H*>(h_ptr) + offset;
  for (int64_t j = 0; j < n; j += L) {
    const int64_t count = min64(L, n - j);
    store_at<C>(h, j, count, load_at<C>(x, j, count) + load_at<C>(r, j, count));
  }
}

// ---- forward ------------------------------------------------------------------------------------------------
// out = xhat * weight + bias over one row, xhat = (x - hi) * rstd - lo * rstd (LayerNorm) or x * rstd (RMSNorm);
// the flags are template arguments so that the loop has no branch but the tail. round_first (cast_before_weight,
// only with a weight) rounds xhat to Y before the affine; for a Y of the compute type that is no rounding at all.
template <bool kRms, bool kWeight, bool kBias, class C, class S, class Y>
inline void normalize_row(const S* src, Y* out, const C* weight, const C* bias, int64_t n, C hi, C lo, C rstd,
                          bool round_first) {
  constexpr int64_t L = kLanes<C>;
  const Vec<C> hi_v = broadcast<C>(hi), lo_scaled = broadcast<C>(lo * rstd), scale = broadcast<C>(rstd);
  auto normalize = [&](Vec<C> x, int64_t j, int64_t count, auto round_tag) {
    Vec<C> y;
    if constexpr (kRms) {
      y = x * scale;
    } else {
      y = (x - hi_v) * scale - lo_scaled;  // x - hi is exact near the mean; lo * rstd is the small rest
    }
    if constexpr (decltype(round_tag)::value) {
      Y rounded[L];
      store<C>(rounded, y);
      y = load<C>(rounded);
    }
    if constexpr (kWeight) y = y * load_at<C>(weight, j, count);
    if constexpr (kBias) y = y + load_at<C>(bias, j, count);
    return y;
  };
  auto run = [&](auto round_tag) {
    int64_t j = 0;
    for (; j + L <= n; j += L) store<C>(out + j, normalize(load<C>(src + j), j, L, round_tag));
    if (j < n) store_part<C>(out + j, normalize(load_part<C>(src + j, n - j), j, n - j, round_tag), n - j);
  };
  if constexpr (kWeight && !std::is_same_v<C, Y>) {
    if (round_first) return run(std::true_type{});
  }
  run(std::false_type{});
}

// normalize_row with the flags of this call.
template <class C, class S, class Y>
inline void normalize(bool rms, const S* src, Y* out, const C* weight, const C* bias, int64_t n, C hi, C lo, C rstd,
                      bool round_first) {
  if (rms) {
    if (weight != nullptr) {
      normalize_row<true, true, false>(src, out, weight, bias, n, hi, lo, rstd, round_first);
    } else {
      normalize_row<true, false, false>(src, out, weight, bias, n, hi, lo, rstd, round_first);
    }
  } else if (weight != nullptr && bias != nullptr) {
    normalize_row<false, true, true>(src, out, weight, bias, n, hi, lo, rstd, round_first);
  } else if (weight != nullptr) {
    normalize_row<false, true, false>(src, out, weight, bias, n, hi, lo, rstd, round_first);
  } else if (bias != nullptr) {
    normalize_row<false, false, true>(src, out, weight, bias, n, hi, lo, rstd, round_first);
  } else {
    normalize_row<false, false, false>(src, out, weight, bias, n, hi, lo, rstd, round_first);
  }
}

// ---- quantized output (quant_math.h has the arithmetic; these are its lane-wise twins) ----------------------
using FloatVec = Vec<float>;
using BitsVec = typename U32N<kFloatLanes>::type;
typedef uint8_t CodeVec __attribute__((vector_size(kFloatLanes)));
typedef int32_t IntVec __attribute__((vector_size(kFloatLanes * 4)));

inline BitsVec bits_of(FloatVec v) { return (BitsVec)v; }  // a vector cast keeps the bits
inline FloatVec floats_of(BitsVec v) { return (FloatVec)v; }

// quant::to_e4m3fn on every lane.
inline CodeVec encode_e4m3fn(FloatVec v) {
  const FloatVec top = broadcast<float>(quant::kFp8Max), bottom = broadcast<float>(-quant::kFp8Max);
  v = v > top ? top : v;  // NaN lanes compare false both times and pass
  v = v < bottom ? bottom : v;
  const BitsVec x = bits_of(v);
  const BitsVec sign = (x >> 24) & 0x80u;
  const BitsVec ax = x & 0x7fffffffu;
  const BitsVec normal = ((ax + 0x7ffffu + ((ax >> 20) & 1u)) >> 20) - (120u << 3);
  const BitsVec subnormal = bits_of(floats_of(ax) * 512.0f + 8388608.0f) - 0x4b000000u;
  BitsVec magnitude = ax >= 0x3c800000u ? normal : subnormal;
  magnitude = ax > 0x7f800000u ? BitsVec{} + 0x7fu : magnitude;
  return __builtin_convertvector(sign | magnitude, CodeVec);
}

// quant::to_int8 on every lane (as bytes).
inline CodeVec encode_int8(FloatVec v) {
  v = v != v ? FloatVec{} : v;
  const FloatVec top = broadcast<float>(quant::kInt8Max), bottom = broadcast<float>(-128.0f);
  v = v > top ? top : v;
  v = v < bottom ? bottom : v;
  const FloatVec rounded = (v + 12582912.0f) - 12582912.0f;
  return __builtin_convertvector(__builtin_convertvector(rounded, IntVec), CodeVec);
}

// The quantized output of one normalized row y (out's dtype Y): the row's scale (static, or from its absmax,
// stored), then the codes, a vector of floats at a time (the tail padded with zeros, which change no absmax).
template <class Y, CodeVec (*kEncode)(FloatVec)>
inline void quantize_row_as(const ForwardRows& a, int64_t row, const Y* y, int64_t n) {
  constexpr int64_t L = kFloatLanes;
  auto floats_at = [&](int64_t j, int64_t count) -> FloatVec {  // y[j, j + count) as floats
    if constexpr (std::is_same_v<Y, double>) {
      float lanes[L] = {};
      for (int64_t i = 0; i < count; ++i) lanes[i] = static_cast<float>(y[j + i]);
      FloatVec v;
      std::memcpy(&v, lanes, sizeof(v));
      return v;
    } else {
      return count == L ? load<float>(y + j) : load_part<float>(y + j, count);
    }
  };
  float inv_scale;
  if (a.scale != nullptr) {
    inv_scale = 1.0f / *a.scale;
  } else {
    FloatVec absmax{};
    for (int64_t j = 0; j < n; j += L) {
      const FloatVec v = floats_of(bits_of(floats_at(j, min64(L, n - j))) & 0x7fffffffu);
      absmax = (v > absmax) | (v != v) ? v : absmax;  // NaN wins, as quant::nan_max
    }
    float lanes[L];
    std::memcpy(lanes, &absmax, sizeof(lanes));
    float m = 0.0f;
    for (int64_t i = 0; i < L; ++i) m = quant::nan_max(m, lanes[i]);
    const float scale = quant::dynamic_scale(m, a.scale_ub, a.quant_int8);
    a.row_scales[row] = scale;
    inv_scale = 1.0f / scale;
  }
  uint8_t* codes = static_cast<uint8_t*>(a.codes) + row * n;
  const FloatVec inv = broadcast<float>(inv_scale);
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const CodeVec c = kEncode(floats_at(j, L) * inv);
    std::memcpy(codes + j, &c, L);
  }
  if (j < n) {
    const CodeVec c = kEncode(floats_at(j, n - j) * inv);
    std::memcpy(codes + j, &c, static_cast<size_t>(n - j));
  }
}

template <class Y>
inline void quantize_row(const ForwardRows& a, int64_t row, const Y* y, int64_t n) {
  if (a.quant_int8) return quantize_row_as<Y, &encode_int8>(a, row, y, n);
  quantize_row_as<Y, &encode_e4m3fn>(a, row, y, n);
}

template <class S, class Y>
void forward_rows(const ForwardRows& a, int64_t begin, int64_t end) {
  using C = ComputeOf<S>;
  constexpr int64_t L = kLanes<C>;
  // Every field read once: the stores below could alias `a` as far as the compiler knows.
  const int64_t n = a.cols;
  const C* weight = static_cast<const C*>(a.weight);
  const C* bias = static_cast<const C*>(a.bias);
  const bool rms = a.rms;
  const bool round_first = a.cast_before_weight;
  const double eps = a.eps;
  C* mean_out = static_cast<C*>(a.mean);
  C* rstd_out = static_cast<C*>(a.rstd);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t offset = row * n;
    const S* src;
    if (a.residual != nullptr) {
      a.add_row(a.input, a.residual, a.residual_out, offset, n);
      src = static_cast<const S*>(a.residual_out) + offset;
    } else {
      src = static_cast<const S*>(a.input) + offset;
    }
    // Quantized output: the row normalized into the thread's buffer, then encoded from it.
    Y* out = a.codes != nullptr ? static_cast<Y*>(a.row_buffer) : static_cast<Y*>(a.out) + offset;

    C mean_hi = 0, mean_lo = 0;
    double var_or_ms;
    if (rms) {
      auto squares = [&](auto compute_tag) {
        using Q = decltype(compute_tag);
        return row_sums<Q>(n, [&](int64_t j, int64_t count) {
                 const Vec<Q> x = load_at<Q>(src, j, count);
                 return Pair<Vec<Q>>{x * x, Vec<Q>{}};
               }).first / static_cast<double>(n);
      };
      // Rows of a few vectors square in double: rstd is then rounded once, and the backward of tiny rows
      // (N = 1: dx is proportional to 1 - xhat^2) is sensitive to every rounding of it. Longer rows average
      // the float roundings out.
      var_or_ms = n < 4 * L ? squares(double{}) : squares(C{});
      // Float squares overflow beyond |x| ~ 1.8e19 (ATen's float statistics give 0 or NaN there); such a row
      // (or one holding an infinity) squares again in double, a second pass only where the first overflowed.
      if (__builtin_isinf(var_or_ms)) var_or_ms = squares(double{});
    } else {
      // One pass of sums about a shift (the mean of the first vector), exact when the shift is near the
      // mean; if it is not (rarely), a second pass from cache about the mean found.
      const int64_t head = min64(n, L);
      const C shift = static_cast<C>(
          horizontal_sum(widen<C>(keep_first<C>(load_at<C>(src, 0, head), head))) / static_cast<double>(head));
      auto centered_stats = [&](C center) {
        const auto [dev, sq] = centered_sums(src, n, center);
        const double dev_mean = dev / static_cast<double>(n);
        return Pair<double>{static_cast<double>(center) + dev_mean, sq / static_cast<double>(n) - dev_mean * dev_mean};
      };
      Pair<double> stats = centered_stats(shift);
      const double offset = stats.first - static_cast<double>(shift);
      if (offset * offset > kMaxShiftSq * stats.second) stats = centered_stats(static_cast<C>(stats.first));
      const auto [mean, var] = stats;
      mean_hi = static_cast<C>(mean);
      mean_lo = static_cast<C>(mean - static_cast<double>(mean_hi));
      var_or_ms = var;
    }
    // A negative rounding residue of the variance counts as 0; NaN stays NaN (a NaN in the row poisons it).
    const C rstd = static_cast<C>(1.0 / __builtin_sqrt((var_or_ms < 0.0 ? 0.0 : var_or_ms) + eps));
    if (mean_out != nullptr) mean_out[row] = mean_hi;
    if (rstd_out != nullptr) rstd_out[row] = rstd;  // none stored by the inference ops

    normalize(rms, src, out, weight, bias, n, mean_hi, mean_lo, rstd, round_first);
    if (a.codes != nullptr) quantize_row(a, row, out, n);
  }
}

// ---- backward -----------------------------------------------------------------------------------------------
// With xhat the normalized row and g = dy * weight:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat));  RMSNorm: dx = rstd * (g - xhat * mean(g * xhat))
//   dweight += dy * xhat, dbias += dy.
// dst[0, count) += v (count <= lanes of C).
template <class C>
inline void add_into(C* dst, int64_t count, Vec<C> v) {
  store_at<C>(dst, 0, count, load_at<C>(dst, 0, count) + v);
}

// One row's backward over a range of its columns [c0, c1), so that the orchestration can also split a long
// row across threads (the sums of the ranges are then added in order). C is the compute type: float, or
// double for float64 rows and for rows of a few vectors, whose gradient (for N = 1 it is proportional to
// 1 - xhat^2) cancels too much for float.
// xhat comes from the forward's mean m (as stored) and a correction: with d = x - m, exact near the mean,
// delta = mean(d) and xhat = (d - delta) * rstd, so sum(g * xhat) = rstd * (sum(g * d) - delta * sum(g)).
// In memory-efficient mode xhat = (out - bias) / weight.
template <class S, class G, class C>
struct BackwardRow {
  static constexpr int64_t L = kLanes<C>;
  const C* weight;
  const C* bias;
  const S* saved;
  const G* dy;
  const S* grad_residual;
  S* dx;
  double rstd;
  double center;  // the stored mean for LayerNorm from the input; 0 otherwise
  bool saved_is_output;

  BackwardRow(const BackwardRows& a, int64_t row, const C* weight_c, const C* bias_c)
      : weight(weight_c),
        bias(bias_c),
        saved(static_cast<const S*>(a.saved) + row * a.cols),
        dy(static_cast<const G*>(a.grad_out) + row * a.cols),
        grad_residual(a.grad_residual_out != nullptr ? static_cast<const S*>(a.grad_residual_out) + row * a.cols
                                                     : nullptr),
        dx(static_cast<S*>(a.grad_input) + row * a.cols),
        rstd(stat(a.rstd, a.stats_double, row)),
        center(a.rms || a.saved_is_output ? 0.0 : stat(a.mean, a.stats_double, row)),
        saved_is_output(a.saved_is_output) {}

  static double stat(const void* values, bool is_double, int64_t row) {
    return is_double ? static_cast<const double*>(values)[row]
                     : static_cast<double>(static_cast<const float*>(values)[row]);
  }

  // d = saved - center, or (memory-efficient) xhat itself.
  Vec<C> centered_at(int64_t j, int64_t count, const Vec<C>& center_v) const {
    const Vec<C> x = load_at<C>(saved, j, count);
    if (!saved_is_output) return x - center_v;
    const Vec<C> shifted = bias != nullptr ? x - load_at<C>(bias, j, count) : x;  // out = xhat * weight + bias
    return weight != nullptr ? shifted / load_at<C>(weight, j, count) : shifted;
  }

  Vec<C> g_at(const Vec<C>& dy_v, int64_t j, int64_t count) const {
    return weight != nullptr ? dy_v * load_at<C>(weight, j, count) : dy_v;
  }

  // {sum of g, sum of g * d, sum of d} over [c0, c1).
  Array<double, 3> sums(int64_t c0, int64_t c1) const {
    const Vec<C> center_v = broadcast<C>(static_cast<C>(center));
    return row_sums_k<C, 3>(c1 - c0, [&](int64_t j, int64_t count) {
      const Vec<C> g = g_at(load_at<C>(dy, c0 + j, count), c0 + j, count);
      const Vec<C> d = centered_at(c0 + j, count, center_v);
      return Array<Vec<C>, 3>{g, g * d, d};
    });
  }

  // dx over [c0, c1), and dweight / dbias (indexed by column) += this row's terms. delta = mean(d) (0 in
  // memory-efficient mode and for RMSNorm), mean_g = mean(g) (0 for RMSNorm), mean_gx = mean(g * xhat).
  void apply(int64_t c0, int64_t c1, double delta, double mean_g, double mean_gx, C* dweight, C* dbias) const {
    const Vec<C> center_v = broadcast<C>(static_cast<C>(center)), delta_v = broadcast<C>(static_cast<C>(delta));
    const Vec<C> rstd_v = broadcast<C>(static_cast<C>(saved_is_output ? 1.0 : rstd));
    const Vec<C> grad_scale = broadcast<C>(static_cast<C>(rstd));
    const Vec<C> mean_g_v = broadcast<C>(static_cast<C>(mean_g)), mean_gx_v = broadcast<C>(static_cast<C>(mean_gx));
    auto step = [&](int64_t j, int64_t count) {
      const Vec<C> dy_v = load_at<C>(dy, j, count);
      const Vec<C> xhat = (centered_at(j, count, center_v) - delta_v) * rstd_v;
      Vec<C> grad = (g_at(dy_v, j, count) - mean_g_v - xhat * mean_gx_v) * grad_scale;
      if (grad_residual != nullptr) grad = grad + load_at<C>(grad_residual, j, count);
      store_at<C>(dx, j, count, grad);
      if (dweight != nullptr) add_into<C>(dweight + j, count, dy_v * xhat);
      if (dbias != nullptr) add_into<C>(dbias + j, count, dy_v);
    };
    int64_t j = c0;
    for (; j + L <= c1; j += L) step(j, L);
    if (j < c1) step(j, c1 - j);
  }
};

// The row's coefficients from its sums {sum g, sum g * d, sum d} (see BackwardRow).
struct BackwardCoefficients {
  double delta, mean_g, mean_gx;
};

inline BackwardCoefficients backward_coefficients(const BackwardRows& a, double rstd, const Array<double, 3>& s) {
  const double inv_n = 1.0 / static_cast<double>(a.cols);
  const double delta = (a.rms || a.saved_is_output) ? 0.0 : s[2] * inv_n;
  // sum(g * xhat) = rstd * (sum(g * d) - delta * sum(g)); in memory-efficient mode d is xhat itself.
  const double sum_gx = a.saved_is_output ? s[1] : rstd * (s[1] - delta * s[0]);
  return {delta, a.rms ? 0.0 : s[0] * inv_n, sum_gx * inv_n};
}

template <class C>
const C* param_as(const BackwardRows& a, bool bias) {
  if constexpr (std::is_same_v<C, double>) {
    return bias ? a.bias : a.weight;
  } else {
    return bias ? a.bias_f : a.weight_f;
  }
}

// Float math unless backward_computes_in_float (row_kernels.h) says no.
template <class S, class G>
constexpr bool kFloatCapable = !std::is_same_v<S, double> && !std::is_same_v<G, double>;

template <class S, class G>
bool use_float(int64_t cols) {
  return backward_computes_in_float(std::is_same_v<S, double>, std::is_same_v<G, double>, cols);
}

// Rows in groups of up to kRowGroup (fewer for long rows: a group's input and dy stay within
// kRowGroupBytes, about a quarter of L2): first each row's sums (reading it from memory), then dx and
// dweight/dbias vector by vector across the group's rows (re-read from cache): each column vector's
// dweight / dbias terms of the group's rows are summed in registers, then added into the partial sums once.
constexpr int64_t kRowGroup = 8;
constexpr int64_t kRowGroupBytes = 512 * 1024;
constexpr int64_t kColumnBlock = 2048;

// Per row of a group, the constants of its dx and xhat (see apply_group).
template <class C>
struct GroupRowConstants {
  C center, xscale, xoffset, gscale, goffset, gx, mean_g, mean_gx;
};

// dx over columns [j, j + cnt) of R rows of a group, and the sums over these rows of the dweight / dbias
// terms added into dw / db. kSavedOut: xhat is recovered from the output (memory-efficient mode). Every row's
// inputs are loaded before any dx is stored: rows a power of two of bytes apart would otherwise make the
// loads wait on the stores (4K aliasing).
template <int R, bool kSavedOut, bool kResidual, class S, class G, class C>
inline void rows_step(int64_t j, int64_t cnt, const C* weight, const C* bias, const S* const* saved,
                      const G* const* dy, const S* const* residual, S* const* dx, const GroupRowConstants<C>* k,
                      Vec<C>& dw, Vec<C>& db) {
  const Vec<C> w_v = weight != nullptr ? load_at<C>(weight, j, cnt) : broadcast<C>(C(1));
  Vec<C> dy_v[R], x_v[R], r_v[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    dy_v[i] = load_at<C>(dy[i], j, cnt);
    x_v[i] = load_at<C>(saved[i], j, cnt);
    if constexpr (kResidual) r_v[i] = load_at<C>(residual[i], j, cnt);
  }
  Vec<C> b_v = Vec<C>{};
  if constexpr (kSavedOut) {
    if (bias != nullptr) b_v = load_at<C>(bias, j, cnt);
  }
  Vec<C> grad[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    Vec<C> d;
    if constexpr (kSavedOut) {
      d = (x_v[i] - b_v) / w_v;  // out = xhat * weight + bias
    } else {
      d = x_v[i] - broadcast<C>(k[i].center);
    }
    const Vec<C> xhat = d * broadcast<C>(k[i].xscale) + broadcast<C>(k[i].xoffset);
    const Vec<C> g = dy_v[i] * w_v;
    if constexpr (std::is_same_v<C, double>) {
      // Rows of a few vectors (and float64): g - mean(g) first, which cancels exactly where g is constant.
      grad[i] = (g - broadcast<C>(k[i].mean_g) - xhat * broadcast<C>(k[i].mean_gx)) * broadcast<C>(k[i].gscale);
    } else {
      grad[i] = g * broadcast<C>(k[i].gscale) + broadcast<C>(k[i].goffset) - xhat * broadcast<C>(k[i].gx);
    }
    if constexpr (kResidual) grad[i] = grad[i] + r_v[i];
    dw = dw + dy_v[i] * xhat;
    db = db + dy_v[i];
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) store_at<C>(dx[i], j, cnt, grad[i]);
}

// dx of R rows over columns [c0, c1), and dweight / dbias += the sum of their terms (one read-modify-write
// per vector for the R rows).
template <int R, bool kSavedOut, bool kResidual, class S, class G, class C>
void rows_block(int64_t c0, int64_t c1, const C* weight, const C* bias, const S* const* saved, const G* const* dy,
                const S* const* residual, S* const* dx, const GroupRowConstants<C>* k, C* dweight, C* dbias) {
  constexpr int64_t L = kLanes<C>;
  auto step = [&](int64_t j, int64_t cnt) {
    Vec<C> dw = Vec<C>{}, db = Vec<C>{};
    rows_step<R, kSavedOut, kResidual>(j, cnt, weight, bias, saved, dy, residual, dx, k, dw, db);
    if (dweight != nullptr) add_into<C>(dweight + j, cnt, dw);
    if (dbias != nullptr) add_into<C>(dbias + j, cnt, db);
  };
  int64_t j = c0;
  for (; j + L <= c1; j += L) step(j, L);
  if (j < c1) step(j, c1 - j);
}

// dx of rows [first, first + count), and dweight / dbias += their terms: column block by column block (the
// block of the partial sums stays in L1), rows two at a time within a block (four were slower: more streams
// of rows a power of two apart meet in one L1 set).
// Per row, with s = rstd: xhat = (x - center) * s - delta * s (memory-efficient: the recovered xhat, scale 1),
// and in float dx = g * s - mean_g * s - xhat * (mean_gx * s): two FMAs after g (in double, as BackwardRow).
template <bool kSavedOut, bool kResidual, class S, class G, class C>
void apply_group_as(const BackwardRows& a, int64_t first, int64_t count, const C* weight, const C* bias,
                    const BackwardCoefficients* coefficients, C* dweight, C* dbias) {
  const int64_t n = a.cols;
  const S* saved[kRowGroup];
  const G* dy[kRowGroup];
  const S* residual[kRowGroup];
  S* dx[kRowGroup];
  GroupRowConstants<C> k[kRowGroup];
  for (int64_t i = 0; i < count; ++i) {
    const BackwardRow<S, G, C> r(a, first + i, weight, bias);
    const BackwardCoefficients& c = coefficients[i];
    saved[i] = r.saved;
    dy[i] = r.dy;
    residual[i] = r.grad_residual;
    dx[i] = r.dx;
    const double xs = kSavedOut ? 1.0 : r.rstd;
    k[i] = {static_cast<C>(r.center),           static_cast<C>(xs),
            static_cast<C>(-c.delta * xs),      static_cast<C>(r.rstd),
            static_cast<C>(-c.mean_g * r.rstd), static_cast<C>(c.mean_gx * r.rstd),
            static_cast<C>(c.mean_g),           static_cast<C>(c.mean_gx)};
  }
  for (int64_t c0 = 0; c0 < n; c0 += kColumnBlock) {
    const int64_t c1 = min64(n, c0 + kColumnBlock);
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      rows_block<2, kSavedOut, kResidual>(c0, c1, weight, bias, saved + i, dy + i, residual + i, dx + i, k + i,
                                          dweight, dbias);
    }
    if (i < count) {
      rows_block<1, kSavedOut, kResidual>(c0, c1, weight, bias, saved + i, dy + i, residual + i, dx + i, k + i,
                                          dweight, dbias);
    }
  }
}

template <class S, class G, class C>
void apply_group(const BackwardRows& a, int64_t first, int64_t count, const C* weight, const C* bias,
                 const BackwardCoefficients* coefficients, C* dweight, C* dbias) {
  auto run = [&](auto saved_out_tag, auto residual_tag) {
    apply_group_as<decltype(saved_out_tag)::value, decltype(residual_tag)::value, S, G, C>(
        a, first, count, weight, bias, coefficients, dweight, dbias);
  };
  const bool residual = a.grad_residual_out != nullptr;
  if (a.saved_is_output) {
    if (residual) {
      run(std::true_type{}, std::true_type{});
    } else {
      run(std::true_type{}, std::false_type{});
    }
  } else if (residual) {
    run(std::false_type{}, std::true_type{});
  } else {
    run(std::false_type{}, std::false_type{});
  }
}

// The sums {g, g * d, d} (BackwardRow::sums) of R rows at once over their n columns: the weight read once for
// the R rows, two columns vectors per step, one float accumulator per sum, row and column parity, flushed
// into double vectors every kFlushVectors vectors.
template <int R, bool kWeight, bool kSavedOut, class S, class G, class C>
void rows_sums(int64_t n, const C* weight, const C* bias, const S* const* saved, const G* const* dy,
               const C* center, Array<double, 3>* out) {
  constexpr int64_t L = kLanes<C>;
  const int64_t full = n - n % L;
  Vec<double> total[R][3] = {};
  auto term = [&](int64_t j, int64_t cnt, Vec<C> (&acc)[R][3]) {
    Vec<C> w_v = broadcast<C>(C(1)), b_v = Vec<C>{};
    if constexpr (kWeight) w_v = load_at<C>(weight, j, cnt);
    if constexpr (kSavedOut) {
      if (bias != nullptr) b_v = load_at<C>(bias, j, cnt);
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const Vec<C> dy_v = load_at<C>(dy[i], j, cnt);
      const Vec<C> x = load_at<C>(saved[i], j, cnt);
      Vec<C> d;
      if constexpr (kSavedOut) {
        d = x - b_v;  // out = xhat * weight + bias
        if constexpr (kWeight) d = d / w_v;
      } else {
        d = x - broadcast<C>(center[i]);
      }
      const Vec<C> g = kWeight ? dy_v * w_v : dy_v;
      acc[i][0] += g;
      acc[i][1] += g * d;
      acc[i][2] += d;
    }
  };
  for (int64_t start = 0; start < full; start += kFlushVectors * L) {
    const int64_t stop = min64(full, start + kFlushVectors * L);
    Vec<C> acc0[R][3] = {}, acc1[R][3] = {};
    int64_t j = start;
    for (; j + 2 * L <= stop; j += 2 * L) {
      term(j, L, acc0);
      term(j + L, L, acc1);
    }
    if (j < stop) term(j, L, acc0);
    for (int i = 0; i < R; ++i) {
      for (int k = 0; k < 3; ++k) total[i][k] += widen<C>(acc0[i][k] + acc1[i][k]);
    }
  }
  if (full < n) {
    Vec<C> acc[R][3] = {};
    term(full, n - full, acc);  // the padding lanes: loaded as 0, but d = -center there
    for (int i = 0; i < R; ++i) {
      for (int k = 0; k < 3; ++k) total[i][k] += widen<C>(keep_first<C>(acc[i][k], n - full));
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int k = 0; k < 3; ++k) out[i][k] = horizontal_sum(total[i][k]);
  }
}

// The sums of rows [first, first + count), two rows at a time.
template <class S, class G, class C>
void group_sums(const BackwardRows& a, int64_t first, int64_t count, const C* weight, const C* bias,
                Array<double, 3>* out) {
  const S* saved[kRowGroup];
  const G* dy[kRowGroup];
  C center[kRowGroup];
  for (int64_t i = 0; i < count; ++i) {
    const BackwardRow<S, G, C> r(a, first + i, weight, bias);
    saved[i] = r.saved;
    dy[i] = r.dy;
    center[i] = static_cast<C>(r.center);
  }
  auto run = [&](auto weight_tag, auto saved_out_tag) {
    constexpr bool kWeight = decltype(weight_tag)::value, kSavedOut = decltype(saved_out_tag)::value;
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      rows_sums<2, kWeight, kSavedOut>(a.cols, weight, bias, saved + i, dy + i, center + i, out + i);
    }
    if (i < count) rows_sums<1, kWeight, kSavedOut>(a.cols, weight, bias, saved + i, dy + i, center + i, out + i);
  };
  auto with_saved = [&](auto weight_tag) {
    if (a.saved_is_output) {
      run(weight_tag, std::true_type{});
    } else {
      run(weight_tag, std::false_type{});
    }
  };
  if (weight != nullptr) {
    with_saved(std::true_type{});
  } else {
    with_saved(std::false_type{});
  }
}

template <class S, class G, class C>
void backward_rows_as(const BackwardRows& a, int64_t begin, int64_t end, C* dweight, C* dbias) {
  const C* weight = param_as<C>(a, false);
  const C* bias = param_as<C>(a, true);
  const int64_t n = a.cols;
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(S) + sizeof(G));
  const int64_t group = row_bytes >= kRowGroupBytes ? 1 : min64(kRowGroup, kRowGroupBytes / row_bytes);
  for (int64_t first = begin; first < end; first += group) {
    const int64_t count = min64(group, end - first);
    BackwardCoefficients coefficients[kRowGroup];
    Array<double, 3> sums[kRowGroup];
    group_sums<S, G, C>(a, first, count, weight, bias, sums);
    for (int64_t i = 0; i < count; ++i) {
      coefficients[i] = backward_coefficients(a, BackwardRow<S, G, C>::stat(a.rstd, a.stats_double, first + i), sums[i]);
    }
    apply_group<S, G, C>(a, first, count, weight, bias, coefficients, dweight, dbias);
  }
}

template <class S, class G>
void backward_rows(const BackwardRows& a, int64_t begin, int64_t end, void* dweight, void* dbias) {
  if constexpr (kFloatCapable<S, G>) {
    if (use_float<S, G>(a.cols)) {
      return backward_rows_as<S, G, float>(a, begin, end, static_cast<float*>(dweight), static_cast<float*>(dbias));
    }
  }
  backward_rows_as<S, G, double>(a, begin, end, static_cast<double*>(dweight), static_cast<double*>(dbias));
}

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
  const int64_t offset = row * a.cols + c0;
  const S* src = static_cast<const S*>(a.residual != nullptr ? a.residual_out : a.input) + offset;
  Y* out = static_cast<Y*>(a.out) + offset;
  const C* weight = a.weight != nullptr ? static_cast<const C*>(a.weight) + c0 : nullptr;
  const C* bias = a.bias != nullptr ? static_cast<const C*>(a.bias) + c0 : nullptr;
  const C hi = static_cast<C>(mean), lo = static_cast<C>(mean - static_cast<double>(hi));
  const C scale = static_cast<C>(rstd);
  normalize(a.rms, src, out, weight, bias, c1 - c0, hi, lo, scale, a.cast_before_weight);
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

// (S, Y) pairs: float64 output only from float64 rows.
template <int S, int Y>
constexpr bool kValidForward = !(Y == 1 && S != 1);

template <int S, int Y>
constexpr ForwardRowsFn forward_entry() {
  if constexpr (kValidForward<S, Y>) {
    return &forward_rows<TypeAt<S>, TypeAt<Y>>;
  } else {
    return nullptr;
  }
}
template <int S, int Y>
constexpr SegmentNormalizeFn normalize_entry() {
  if constexpr (kValidForward<S, Y>) {
    return &segment_normalize<TypeAt<S>, TypeAt<Y>>;
  } else {
    return nullptr;
  }
}
template <int S, int Y>
struct ForwardEntry {
  static constexpr ForwardRowsFn value = forward_entry<S, Y>();
};
template <int S, int Y>
struct NormalizeEntry {
  static constexpr SegmentNormalizeFn value = normalize_entry<S, Y>();
};

template <int S, int G>
struct BackwardEntry {
  static constexpr BackwardRowsFn value = &backward_rows<TypeAt<S>, TypeAt<G>>;
};
template <int S, int G>
struct BackwardSumsEntry {
  static constexpr BackwardSegmentSumsFn value = &backward_segment_sums<TypeAt<S>, TypeAt<G>>;
};
template <int S, int G>
struct BackwardApplyEntry {
  static constexpr BackwardSegmentApplyFn value = &backward_segment_apply<TypeAt<S>, TypeAt<G>>;
};

constexpr auto kAddTable = make_add_table(std::make_index_sequence<64>{});
constexpr auto kForwardTable = make_pair_table<ForwardEntry>(std::make_index_sequence<16>{});
constexpr auto kNormalizeTable = make_pair_table<NormalizeEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardTable = make_pair_table<BackwardEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardSumsTable = make_pair_table<BackwardSumsEntry>(std::make_index_sequence<16>{});
constexpr auto kBackwardApplyTable = make_pair_table<BackwardApplyEntry>(std::make_index_sequence<16>{});
constexpr Array<SegmentSumsFn, 4> kSegmentSumsTable{&segment_sums<float>, &segment_sums<double>,
                                                     &segment_sums<bf16>, &segment_sums<f16>};

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
                                  &LNX_ISA_NS::lookup_backward_segment_apply};
  return kernels;
}

}  // namespace cpu
}  // namespace layernorm_ext
