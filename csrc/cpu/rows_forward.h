// The forward row kernels (a part of rows_impl.h, after rows_simd.h): h = x + r, the per-row statistics
// and normalization (forward_rows), and the quantized output's lane-wise encoders.
#ifndef LNX_ROWS_IMPL
#error "rows_forward.h is a part of rows_impl.h: include that (as rows_<isa>.cpp do)"
#endif

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

// ---- h = x + r ----------------------------------------------------------------------------------------------
template <class X, class R, class H>
void add_row(const void* x_ptr, int64_t x_offset, const void* r_ptr, int64_t r_offset, void* h_ptr, int64_t h_offset,
             int64_t n) {
  using C = ComputeOf<H>;
  constexpr int64_t L = kLanes<C>;
  const X* x = static_cast<const X*>(x_ptr) + x_offset;
  const R* r = static_cast<const R*>(r_ptr) + r_offset;
  H* h = static_cast<H*>(h_ptr) + h_offset;
  for (int64_t j = 0; j < n; j += L) {
    const int64_t count = min64(L, n - j);
    store_at<C>(h, j, count, load_at<C>(x, j, count) + load_at<C>(r, j, count));
  }
}

// ---- forward ------------------------------------------------------------------------------------------------
// LayerNorm's one-pass variance about a shift s loses (mean - s)^2 / var relative precision: above this
// ratio the sums are taken again about the mean.
constexpr double kMaxShiftSq = 0.25;
// A float64 mean found as shift + sum(x - shift) / n keeps an ulp of |mean - shift|: beyond this fraction of
// |mean| the sums are taken again about the mean (float rows round their mean to float, far coarser).
constexpr double kMaxDoubleShift = 0x1p-4;

// out = xhat * weight + bias over one row, xhat = (x - hi) * rstd - lo * rstd (LayerNorm) or x * rstd (RMSNorm);
// the flags are template arguments so that the loop has no branch but the tail. round_first (cast_before_weight,
// only with a weight) rounds xhat to Y before the affine; for a Y of the compute type that is no rounding at all.
// stream: out's whole vectors with non-temporal stores where out is aligned for them (ForwardRows::stream_out).
template <bool kRms, bool kWeight, bool kBias, class C, class S, class Y>
inline void normalize_row(const S* src, Y* out, const C* weight, const C* bias, int64_t n, C hi, C lo, C rstd,
                          bool round_first, bool stream) {
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
    if (stream && stream_aligned<C>(out)) {
      for (; j + L <= n; j += L) stream_store<C>(out + j, normalize(load<C>(src + j), j, L, round_tag));
    } else {
      for (; j + L <= n; j += L) store<C>(out + j, normalize(load<C>(src + j), j, L, round_tag));
    }
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
                      bool round_first, bool stream = false) {
  if (rms) {
    if (weight != nullptr) {
      normalize_row<true, true, false>(src, out, weight, bias, n, hi, lo, rstd, round_first, stream);
    } else {
      normalize_row<true, false, false>(src, out, weight, bias, n, hi, lo, rstd, round_first, stream);
    }
  } else if (weight != nullptr && bias != nullptr) {
    normalize_row<false, true, true>(src, out, weight, bias, n, hi, lo, rstd, round_first, stream);
  } else if (weight != nullptr) {
    normalize_row<false, true, false>(src, out, weight, bias, n, hi, lo, rstd, round_first, stream);
  } else if (bias != nullptr) {
    normalize_row<false, false, true>(src, out, weight, bias, n, hi, lo, rstd, round_first, stream);
  } else {
    normalize_row<false, false, false>(src, out, weight, bias, n, hi, lo, rstd, round_first, stream);
  }
}

// ---- quantized output (quant_math.h has the arithmetic; these are its lane-wise twins) ----------------------
using FloatVec = Vec<float>;
using BitsVec = typename U32N<kFloatLanes>::type;
typedef uint8_t CodeVec __attribute__((vector_size(kFloatLanes)));
typedef int32_t IntVec __attribute__((vector_size(kFloatLanes * 4)));

inline BitsVec bits_of(FloatVec v) { return (BitsVec)v; }  // a vector cast keeps the bits
inline FloatVec floats_of(BitsVec v) { return (FloatVec)v; }

// quant::small_float_bits on vectors of floats.
struct FloatLanes {
  using Floats = FloatVec;
  using Bits = BitsVec;
  static Bits bits(Floats v) { return bits_of(v); }
  static Floats floats(Bits b) { return floats_of(b); }
};

// quant::to_e4m3fn / to_e5m2 / to_e2m1 on every lane (a byte per lane; e2m1 in its low nibble).
template <class Format>
inline CodeVec encode_small_float(FloatVec v) {
  return __builtin_convertvector(quant::small_float_bits<Format, FloatLanes>(v), CodeVec);
}

// Two float4 codes per byte (float4_e2m1fn_x2): lane 2i in the low nibble, lane 2i + 1 in the high one. Each pair
// of lanes read as one little-endian 16-bit lane lo | hi << 8, which w | w >> 4 turns into lo | hi << 4 in its
// low byte (the codes are below 16).
typedef uint16_t CodePairVec __attribute__((vector_size(kFloatLanes)));
typedef uint8_t PackedCodeVec __attribute__((vector_size(kFloatLanes / 2)));
inline PackedCodeVec pack_nibbles(CodeVec c) {
  CodePairVec pairs;
  std::memcpy(&pairs, &c, sizeof(pairs));
  return __builtin_convertvector(pairs | (pairs >> 4), PackedCodeVec);
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

// quant::nan_max over a vector's lanes (absolute values), halving it: log2(lanes) vector steps instead of a loop
// over the lanes (per-group scales of 16 columns spent most of their time in that loop).
template <int N>
struct FloatsOf {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};
template <int N>
inline __attribute__((always_inline)) float nan_max_of_lanes(typename FloatsOf<N>::type v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    using Half = typename FloatsOf<N / 2>::type;
    Half lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return nan_max_of_lanes<N / 2>((hi > lo) | (hi != hi) ? hi : lo);  // NaN wins, as quant::nan_max
  }
}

// The quantized output of one normalized row y (out's dtype Y): each range of it that shares a scale (the row,
// or each group of group_size columns) gets its scale (static, or from its absmax, stored), then its codes, a
// vector of floats at a time (a range's tail padded with zeros, which change no absmax). kNibbles: two codes per
// byte (NVFP4: its blocks of 16 hold whole vectors, of 4, 8 or 16 lanes).
template <class Y, CodeVec (*kEncode)(FloatVec), bool kNibbles = false>
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
  auto absmax_of = [&](int64_t begin, int64_t end) {  // of y[begin, end)
    FloatVec absmax{};
    for (int64_t j = begin; j < end; j += L) {
      const FloatVec v = floats_of(bits_of(floats_at(j, min64(L, end - j))) & 0x7fffffffu);
      absmax = (v > absmax) | (v != v) ? v : absmax;  // NaN wins, as quant::nan_max
    }
    return nan_max_of_lanes<L>(absmax);
  };
  uint8_t* codes = static_cast<uint8_t*>(a.codes) + a.out_rows.offset(row);
  auto encode_range = [&](int64_t begin, int64_t end, quant::Scaling scaling) {
    const FloatVec factor = broadcast<float>(scaling.factor);
    auto encode_all = [&](auto divide_tag) {  // quant::scaled on every lane, the branch out of the loop
      auto encode = [&](int64_t j, int64_t count) {
        const FloatVec values = floats_at(j, count);
        const CodeVec c = kEncode(decltype(divide_tag)::value ? values / factor : values * factor);
        if constexpr (kNibbles) {
          const PackedCodeVec packed = pack_nibbles(c);
          std::memcpy(codes + j / 2, &packed, static_cast<size_t>(count / 2));
        } else {
          std::memcpy(codes + j, &c, static_cast<size_t>(count));
        }
      };
      int64_t j = begin;
      for (; j + L <= end; j += L) encode(j, L);
      if (j < end) encode(j, end - j);
    };
    if (scaling.divide) {
      encode_all(std::true_type{});
    } else {
      encode_all(std::false_type{});
    }
  };
  if (a.group_size > 0) {
    const int64_t first = row * a.scale_row_stride;
    const int64_t groups = n / a.group_size;
    auto scale_index = [&](int64_t group) {  // of the row's group: strided, or swizzled (MX / NVFP4 only)
      return a.scales_swizzled ? quant::swizzled_scale_index(row, group, groups) : first + group * a.scale_group_stride;
    };
    const float global_scale = a.nvfp4_scales != nullptr ? *a.scale : 0.0f;
    const float inverse_global_scale = quant::reciprocal_or_zero(global_scale);
    for (int64_t group = 0, begin = 0; begin < n; ++group, begin += a.group_size) {
      const float absmax = absmax_of(begin, begin + a.group_size);
      quant::Scaling scaling;
      if (a.nvfp4_scales != nullptr) {
        const uint8_t bits = quant::nvfp4_scale_bits(absmax, global_scale);
        a.nvfp4_scales[scale_index(group)] = bits;
        scaling = quant::nvfp4_scaling(bits, inverse_global_scale);
      } else if (a.mx_scales != nullptr) {
        const uint8_t bits = quant::mx_scale_bits(quant::capped(absmax, a.scale_ub), a.quant_code);
        a.mx_scales[scale_index(group)] = bits;
        scaling = quant::mx_scaling(bits);
      } else {
        const float scale = quant::dynamic_scale(absmax, a.scale_ub, a.quant_code);
        a.row_scales[scale_index(group)] = scale;
        scaling = quant::group_scaling(scale);
      }
      encode_range(begin, begin + a.group_size, scaling);
    }
    if (a.scales_swizzled) {  // the row's padding blocks of its last tile: zeros, as torch's to_blocked pads
      uint8_t* block_scales = a.nvfp4_scales != nullptr ? a.nvfp4_scales : a.mx_scales;
      for (int64_t group = groups; group < quant::swizzled_scale_blocks(groups); ++group) {
        block_scales[scale_index(group)] = 0;
      }
    }
    return;
  }
  float scale;
  if (a.scale != nullptr) {
    scale = *a.scale;
  } else {
    scale = quant::dynamic_scale(absmax_of(0, n), a.scale_ub, a.quant_code);
    a.row_scales[row] = scale;
  }
  encode_range(0, n, quant::scaling(scale, a.scale != nullptr, a.quant_code));
}

template <class Y>
inline void quantize_row(const ForwardRows& a, int64_t row, const Y* y, int64_t n) {
  switch (a.quant_code) {
    case quant::Code::kInt8: return quantize_row_as<Y, &encode_int8>(a, row, y, n);
    case quant::Code::kE5m2: return quantize_row_as<Y, &encode_small_float<quant::E5m2>>(a, row, y, n);
    case quant::Code::kE2m1: return quantize_row_as<Y, &encode_small_float<quant::E2m1>, true>(a, row, y, n);
    default: return quantize_row_as<Y, &encode_small_float<quant::E4m3fn>>(a, row, y, n);
  }
}

// With a weight or bias, rows are normalized in groups of kGroupRows: the group's statistics first, then its rows
// a block of kBlockCols columns at a time, so that a block of weight and bias (float) is read from L1 for all the
// group's rows, not from L2 for each row (a 4096-column row's are 32 KB, all of L1): at DRAM sizes those reads held
// up the rows' stores. Without them a row is normalized right after its statistics, from L1, which grouping slowed.
constexpr int kGroupRows = 4;
constexpr int64_t kBlockCols = 1024;

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
  const RowLayout input_rows = a.input_rows, residual_rows = a.residual_rows;
  const RowLayout residual_out_rows = a.residual_out_rows, out_rows = a.out_rows;
  const bool stream = a.stream_out && a.codes == nullptr;
  struct Pending {  // a row whose statistics are known, to be normalized
    const S* src;
    Y* out;
    C hi, lo, rstd;
  };
  Pending group[kGroupRows];
  int pending = 0;
  const int group_rows = weight != nullptr || bias != nullptr ? kGroupRows : 1;
  auto normalize_group = [&] {
    for (int64_t c0 = 0; c0 < n; c0 += kBlockCols) {
      const int64_t cols = min64(kBlockCols, n - c0);
      const C* weight_block = weight != nullptr ? weight + c0 : nullptr;
      const C* bias_block = bias != nullptr ? bias + c0 : nullptr;
      for (int i = 0; i < pending; ++i) {
        const Pending& r = group[i];
        normalize(rms, r.src + c0, r.out + c0, weight_block, bias_block, cols, r.hi, r.lo, r.rstd, round_first,
                  stream);
      }
    }
    pending = 0;
  };
  for (int64_t row = begin; row < end; ++row) {
    const S* src;
    if (a.residual != nullptr) {
      const int64_t h_offset = residual_out_rows.offset(row);
      a.add_row(a.input, input_rows.offset(row), a.residual, residual_rows.offset(row), a.residual_out, h_offset, n);
      src = static_cast<const S*>(a.residual_out) + h_offset;
    } else {
      src = static_cast<const S*>(a.input) + input_rows.offset(row);
    }
    // Quantized output: the row normalized into the thread's buffer, then encoded from it.
    Y* out = a.codes != nullptr ? static_cast<Y*>(a.row_buffer) : static_cast<Y*>(a.out) + out_rows.offset(row);

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
      const bool coarse_mean =
          std::is_same_v<C, double> && __builtin_fabs(offset) > kMaxDoubleShift * __builtin_fabs(stats.first);
      if (offset * offset > kMaxShiftSq * stats.second || coarse_mean) {
        stats = centered_stats(static_cast<C>(stats.first));
      }
      const auto [mean, var] = stats;
      mean_hi = static_cast<C>(mean);
      mean_lo = static_cast<C>(mean - static_cast<double>(mean_hi));
      var_or_ms = var;
    }
    // A negative rounding residue of the variance counts as 0; NaN stays NaN (a NaN in the row poisons it).
    const C rstd = static_cast<C>(1.0 / __builtin_sqrt((var_or_ms < 0.0 ? 0.0 : var_or_ms) + eps));
    if (mean_out != nullptr) mean_out[row] = mean_hi;
    if (rstd_out != nullptr) rstd_out[row] = rstd;  // none stored by the inference ops

    if (a.codes != nullptr) {  // one row buffer: normalized and encoded row by row
      normalize(rms, src, out, weight, bias, n, mean_hi, mean_lo, rstd, round_first);
      quantize_row(a, row, out, n);
    } else if (group_rows == 1) {
      normalize(rms, src, out, weight, bias, n, mean_hi, mean_lo, rstd, round_first, stream);
    } else {
      group[pending++] = Pending{src, out, mean_hi, mean_lo, rstd};
      if (pending == group_rows) normalize_group();
    }
  }
  normalize_group();
  if (stream) _mm_sfence();
}

}  // namespace
}  // namespace LNX_ISA_NS
}  // namespace cpu
}  // namespace layernorm_ext
