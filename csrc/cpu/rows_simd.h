// The row kernels' building blocks (a part of rows_impl.h): element types, vectors of LNX_FLOAT_LANES * 4
// bytes, float16 / bfloat16 <-> float conversions, loads and stores of a storage type as vectors of the
// compute type, and the row sums (two accumulators per sum, flushed into double vectors).
// Like every part, it includes no header and opens this copy's namespace itself; rows_impl.h includes it
// after the headers it needs, inside LNX_TARGET (rows_impl.h, Isolation).
#ifndef LNX_ROWS_IMPL
#error "rows_simd.h is a part of rows_impl.h: include that (as rows_<isa>.cpp do)"
#endif

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

// std::array / std::pair stand-ins whose member functions have internal linkage (rows_impl.h, Isolation).
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

// Whether float -> bfloat16 rounds with AVX512_BF16's vcvtneps2bf16 (16-lane copy only): set through LNX_ENTRY's
// set_native_bf16 by the dispatcher, only where the CPU has it (instruction set "avx512_bf16").
bool native_bf16 = false;

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
    // vcvtneps2bf16 rounds as below, one instruction for nine, but flushes float subnormals (fpclass 0x20) to
    // zero: a vector holding one takes the integer rounding. Inline asm: this copy's target lacks avx512bf16,
    // as it runs on AVX-512 CPUs without it too.
    if (native_bf16 && _mm512_fpclass_ps_mask(f, 0x20) == 0) {
      __m256i packed;
      asm("vcvtneps2bf16 %1, %0" : "=v"(packed) : "v"(f));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
      return;
    }
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

// Non-temporal store of a vector of C as T at p (stream_aligned): the line is written without being read first and
// leaves no copy in the caches. Callers end with a store fence (_mm_sfence) before their stores may be read.
template <class C, class T>
inline bool stream_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (kLanes<C> * sizeof(T)) == 0;
}

template <class C, class T>
inline void stream_store(T* p, Vec<C> v) {
  constexpr size_t kBytes = kLanes<C> * sizeof(T);
  alignas(64) T converted[kLanes<C>];
  store<C>(converted, v);
  if constexpr (kBytes == 64) {
    __m512i bits;
    std::memcpy(&bits, converted, kBytes);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), bits);
  } else if constexpr (kBytes == 32) {
    __m256i bits;
    std::memcpy(&bits, converted, kBytes);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bits);
  } else if constexpr (kBytes == 16) {
    __m128i bits;
    std::memcpy(&bits, converted, kBytes);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), bits);
  } else if constexpr (kBytes == 8) {
    long long bits;
    std::memcpy(&bits, converted, kBytes);
    _mm_stream_si64(reinterpret_cast<long long*>(p), bits);
  } else {
    static_assert(kBytes == 4, "a vector of 4, 8, 16, 32 or 64 bytes");
    int bits;
    std::memcpy(&bits, converted, kBytes);
    _mm_stream_si32(reinterpret_cast<int*>(p), bits);
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

// Sums of blocks combined pairwise, as a binary counter: levels[k] holds the sum of 2^k blocks, so each block
// meets O(log blocks) additions and the rounding error grows with log(n), as in ATen's cascade sums, not with n
// as a running total's would (a float64 row of 32767 equal values: 12 ulps off in its mean square that way).
template <class T, int K>
struct PairwiseSums {
  static constexpr int kLevels = 48;  // 2^48 blocks
  Array<T, K> levels[kLevels];
  int64_t count = 0;

  void add(Array<T, K> block) {
    int k = 0;
    for (int64_t c = count; c & 1; c >>= 1, ++k) {
      for (int i = 0; i < K; ++i) block[i] = levels[k][i] + block[i];
    }
    levels[k] = block;
    ++count;
  }
  // The levels left, smallest first (a fixed order: the bits depend on the block count only).
  Array<T, K> total() const {
    Array<T, K> out = {};
    int k = 0;
    for (int64_t c = count; c != 0; c >>= 1, ++k) {
      if (c & 1) {
        for (int i = 0; i < K; ++i) out[i] += levels[k][i];
      }
    }
    return out;
  }
};

// K sums over a row of n elements of the vector terms term(j, count) -> Array<Vec<C>, K>: two
// accumulators per sum over blocks of kFlushVectors vectors, each block widened to double vectors and the
// blocks combined pairwise (PairwiseSums); the tail's padding lanes are masked off.
template <class C, int K, class Term>
inline Array<double, K> row_sums_k(int64_t n, Term term) {
  constexpr int64_t L = kLanes<C>;
  const int64_t full = n - n % L;
  PairwiseSums<Vec<double>, K> blocks;
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
    Array<Vec<double>, K> block;
    for (int k = 0; k < K; ++k) block[k] = widen<C>(acc0[k] + acc1[k]);
    blocks.add(block);
  }
  Array<Vec<double>, K> total = blocks.total();
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

}  // namespace
}  // namespace LNX_ISA_NS
}  // namespace cpu
}  // namespace layernorm_ext
