// The channels-first ("columns") kernels (a part of rows_impl.h, after rows_backward.h): LayerNorm and RMSNorm
// (a runtime flag) of rows whose cols elements are plane apart, the pixels of a contiguous (N, C, *spatial)
// tensor, forward and backward, read and written in place (row_kernels.h, ForwardColumnsFn).
//
// Mapping: the vector lanes are consecutive pixels, so a load is one channel of kLanes pixels (contiguous), and a
// loop over the channels accumulates every lane's (pixel's) sums at once; lanes never meet, but in dweight /
// dbias. A tail of fewer pixels loads them padded with zeros (those lanes' results are dropped).
// Numerics per pixel, as the row kernels' (rows_forward.h, rows_backward.h): sums in the compute type Q over
// blocks of kFlushVectors channels, each block's added into double lanes; LayerNorm's statistics in two passes
// over the channels (the mean, then the sums about it rounded to Q, with the corrected two-pass variance, as
// forward_split's), the second from cache; then a pass normalizing. Q is double for float64 data, for rows
// shorter than kFloatBackwardMinCols (few terms: each rounding shows, rows_forward.h), and for the statistics of
// pixels whose float squares overflowed. Backward: each pixel's sums {g, g * d, d} in one pass, then dx and the
// dweight / dbias terms (backward_coefficients, as the rows'), the terms summed per channel in lane vectors over
// kColumnBlockVectors pixel vectors, then into the double partials the caller gives.
#ifndef LNX_ROWS_IMPL
#error "columns.h is a part of rows_impl.h: include that (as rows_<isa>.cpp do)"
#endif

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

constexpr int64_t kColumnBlockVectors = 64;

// Each lane's sum in double: a float vector's lanes widened into two double vectors.
template <class Q>
struct LaneSums {
  static constexpr int kParts = kLanes<Q> / kLanes<double>;
  Vec<double> parts[kParts];

  void add(Vec<Q> v) {
    if constexpr (kParts == 1) {
      parts[0] += v;
    } else {
      constexpr auto half = std::make_index_sequence<kLanes<double>>{};
      parts[0] += __builtin_convertvector(half_of<0>(v, half), Vec<double>);
      parts[1] += __builtin_convertvector(half_of<kLanes<double>>(v, half), Vec<double>);
    }
  }
  void store(double* lanes) const { std::memcpy(lanes, parts, sizeof parts); }
};

// K per-lane sums over channels [0, cols) of term(c) -> Array<Vec<Q>, K>: two accumulators per sum over blocks
// of kFlushVectors channels, each block's added into double lanes (a running double sum: rows have thousands
// of channels at most, where the rows' pairwise blocks would change no bit that matters).
template <class Q, int K, class Term>
inline Array<LaneSums<Q>, K> channel_sums(int64_t cols, Term term) {
  Array<LaneSums<Q>, K> total{};
  for (int64_t c0 = 0; c0 < cols; c0 += kFlushVectors) {
    const int64_t c1 = min64(cols, c0 + kFlushVectors);
    Array<Vec<Q>, K> acc0 = {}, acc1 = {};
    int64_t c = c0;
    for (; c + 2 <= c1; c += 2) {
      const Array<Vec<Q>, K> t0 = term(c), t1 = term(c + 1);
      for (int k = 0; k < K; ++k) {
        acc0[k] += t0[k];
        acc1[k] += t1[k];
      }
    }
    if (c < c1) {
      const Array<Vec<Q>, K> t0 = term(c);
      for (int k = 0; k < K; ++k) acc0[k] += t0[k];
    }
    for (int k = 0; k < K; ++k) total[k].add(acc0[k] + acc1[k]);
  }
  return total;
}

// Channel c of `count` (<= lanes) consecutive pixels, whose channel 0 is at pixels[0].
template <class Q, class T>
inline Vec<Q> channel_at(const T* pixels, int64_t plane, int64_t c, int64_t count) {
  return load_at<Q>(pixels + c * plane, 0, count);
}

template <class Q>
inline Vec<Q> vec_of(const Q* lanes) {
  Vec<Q> v;
  std::memcpy(&v, lanes, sizeof v);
  return v;
}

// Per lane of `count` pixels from x: LayerNorm's mean and variance, or RMSNorm's mean square (mean 0), in double.
// Returns whether a lane's sum of squares overflowed Q.
template <class Q, class S>
inline bool column_stats(const S* x, int64_t plane, int64_t cols, int64_t count, bool rms, double* mean,
                         double* var) {
  constexpr int64_t L = kLanes<Q>;
  const double inv_cols = 1.0 / static_cast<double>(cols);
  double sums[L], squares[L];
  Q center[L] = {};
  if (!rms) {
    channel_sums<Q, 1>(cols, [&](int64_t c) {
      return Array<Vec<Q>, 1>{channel_at<Q>(x, plane, c, count)};
    })[0].store(sums);
    for (int64_t i = 0; i < count; ++i) center[i] = static_cast<Q>(sums[i] * inv_cols);
  }
  const Vec<Q> center_v = vec_of(center);  // 0 for RMSNorm: its sums are x and x^2
  const Array<LaneSums<Q>, 2> centered = channel_sums<Q, 2>(cols, [&](int64_t c) {
    const Vec<Q> d = channel_at<Q>(x, plane, c, count) - center_v;
    return Array<Vec<Q>, 2>{d, d * d};
  });
  centered[0].store(sums);
  centered[1].store(squares);
  bool overflow = false;
  for (int64_t i = 0; i < count; ++i) {
    const double dev_mean = rms ? 0.0 : sums[i] * inv_cols;
    mean[i] = static_cast<double>(center[i]) + dev_mean;
    var[i] = squares[i] * inv_cols - dev_mean * dev_mean;
    overflow |= __builtin_isinf(squares[i]) != 0;
  }
  return overflow;
}

// Forward over pixels [p0, p1) of one image: statistics, then out (row_kernels.h, ForwardColumnsFn).
template <class S, class Y, class Q>
void forward_columns_as(const ForwardRows& a, int64_t plane, int64_t image, int64_t p0, int64_t p1) {
  using W = ComputeOf<S>;  // the parameters' and the statistics' type
  constexpr int64_t L = kLanes<Q>;
  const int64_t cols = a.cols;
  const S* input = static_cast<const S*>(a.input) + image * cols * plane;
  Y* out = static_cast<Y*>(a.out) + image * cols * plane;
  const W* weight = static_cast<const W*>(a.weight);
  const W* bias = static_cast<const W*>(a.bias);
  W* mean_out = static_cast<W*>(a.mean);
  W* rstd_out = static_cast<W*>(a.rstd);
  const bool rms = a.rms;
  for (int64_t p = p0; p < p1; p += L) {
    const int64_t count = min64(L, p1 - p);
    double mean[L] = {}, var[L] = {};
    const bool overflow = column_stats<Q>(input + p, plane, cols, count, rms, mean, var);
    if constexpr (!std::is_same_v<Q, double>) {
      // Float squares beyond ~1.8e19 (or an infinity): these pixels' statistics again in double, half a vector
      // at a time.
      if (overflow) {
        constexpr int64_t Ld = kLanes<double>;
        for (int64_t i = 0; i < count; i += Ld) {
          column_stats<double>(input + p + i, plane, cols, min64(Ld, count - i), rms, mean + i, var + i);
        }
      }
    }
    Q hi[L] = {}, lo[L] = {}, scale[L] = {};
    for (int64_t i = 0; i < count; ++i) {
      // A negative rounding residue of the variance counts as 0; NaN stays NaN.
      const W rstd = static_cast<W>(1.0 / __builtin_sqrt((var[i] < 0.0 ? 0.0 : var[i]) + a.eps));
      const int64_t row = image * plane + p + i;
      if (mean_out != nullptr) mean_out[row] = static_cast<W>(mean[i]);
      if (rstd_out != nullptr) rstd_out[row] = rstd;
      hi[i] = static_cast<Q>(mean[i]);
      lo[i] = static_cast<Q>(mean[i] - static_cast<double>(hi[i]));
      scale[i] = static_cast<Q>(rstd);
    }
    const Vec<Q> hi_v = vec_of(hi), scale_v = vec_of(scale), lo_scaled = vec_of(lo) * scale_v;
    for (int64_t c = 0; c < cols; ++c) {
      const Vec<Q> x = channel_at<Q>(input + p, plane, c, count);
      Vec<Q> y = rms ? x * scale_v : (x - hi_v) * scale_v - lo_scaled;  // x - hi exact near the mean
      if constexpr (!std::is_same_v<Q, Y>) {
        if (a.cast_before_weight && weight != nullptr) {
          Y rounded[L];
          store<Q>(rounded, y);
          y = load<Q>(rounded);
        }
      }
      if (weight != nullptr) y = y * static_cast<Q>(weight[c]);
      if (bias != nullptr) y = y + static_cast<Q>(bias[c]);
      store_at<Q>(out + p + c * plane, 0, count, y);
    }
  }
}

template <class S, class Y>
void forward_columns(const ForwardRows& a, int64_t plane, int64_t image, int64_t p0, int64_t p1) {
  if constexpr (!std::is_same_v<S, double>) {
    if (a.cols >= kFloatBackwardMinCols) return forward_columns_as<S, Y, float>(a, plane, image, p0, p1);
  }
  forward_columns_as<S, Y, double>(a, plane, image, p0, p1);
}

// Backward over pixels [p0, p1) of one image (row_kernels.h, BackwardColumnsFn); dw_lanes / db_lanes: cols
// vectors each, the per-channel lane sums.
template <class S, class G, class Q>
void backward_columns_as(const BackwardRows& a, int64_t plane, int64_t image, int64_t p0, int64_t p1,
                         Vec<Q>* dw_lanes, Vec<Q>* db_lanes, double* dweight, double* dbias) {
  constexpr int64_t L = kLanes<Q>;
  const int64_t cols = a.cols;
  const Q* weight = param_as<Q>(a, false);
  const Q* bias = param_as<Q>(a, true);
  const int64_t offset = image * cols * plane;
  const S* saved = static_cast<const S*>(a.saved) + offset;
  const G* grad_out = static_cast<const G*>(a.grad_out) + offset;
  S* grad_input = static_cast<S*>(a.grad_input) + offset;
  const bool saved_is_output = a.saved_is_output;
  for (int64_t c = 0; c < cols; ++c) dw_lanes[c] = db_lanes[c] = Vec<Q>{};
  int64_t vectors = 0;  // in the lane sums since they were last added into the partials
  auto flush = [&] {
    for (int64_t c = 0; c < cols; ++c) {
      if (dweight != nullptr) dweight[c] += horizontal_sum(widen<Q>(dw_lanes[c]));
      if (dbias != nullptr) dbias[c] += horizontal_sum(widen<Q>(db_lanes[c]));
      dw_lanes[c] = db_lanes[c] = Vec<Q>{};
    }
    vectors = 0;
  };
  for (int64_t p = p0; p < p1; p += L) {
    const int64_t count = min64(L, p1 - p);
    const S* x = saved + p;
    const G* dy = grad_out + p;
    double rstd[L] = {};
    Q center[L] = {};
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = image * plane + p + i;
      rstd[i] = BackwardRow<S, G, Q>::stat(a.rstd, a.stats_double, row);
      if (!a.rms && !saved_is_output) {
        center[i] = static_cast<Q>(BackwardRow<S, G, Q>::stat(a.mean, a.stats_double, row));
      }
    }
    const Vec<Q> center_v = vec_of(center);
    // d = saved - the stored mean, or (memory-efficient) xhat itself; g = dy * weight.
    auto centered = [&](int64_t c) {
      const Vec<Q> v = channel_at<Q>(x, plane, c, count);
      if (!saved_is_output) return v - center_v;
      const Vec<Q> shifted = bias != nullptr ? v - bias[c] : v;  // out = xhat * weight + bias
      return weight != nullptr ? shifted / weight[c] : shifted;
    };
    auto g_of = [&](Vec<Q> dy_v, int64_t c) { return weight != nullptr ? dy_v * weight[c] : dy_v; };
    const Array<LaneSums<Q>, 3> sums = channel_sums<Q, 3>(cols, [&](int64_t c) {
      const Vec<Q> g = g_of(channel_at<Q>(dy, plane, c, count), c);
      const Vec<Q> d = centered(c);
      return Array<Vec<Q>, 3>{g, g * d, d};
    });
    double s[3][L];
    for (int k = 0; k < 3; ++k) sums[k].store(s[k]);
    Q xscale[L] = {}, xoffset[L] = {}, gscale[L] = {}, goffset[L] = {}, gx[L] = {}, mean_g[L] = {}, mean_gx[L] = {};
    for (int64_t i = 0; i < count; ++i) {
      const BackwardCoefficients k = backward_coefficients(a, rstd[i], {s[0][i], s[1][i], s[2][i]});
      const double xs = saved_is_output ? 1.0 : rstd[i];
      xscale[i] = static_cast<Q>(xs);
      xoffset[i] = static_cast<Q>(-k.delta * xs);
      gscale[i] = static_cast<Q>(rstd[i]);
      goffset[i] = static_cast<Q>(-k.mean_g * rstd[i]);
      gx[i] = static_cast<Q>(k.mean_gx * rstd[i]);
      mean_g[i] = static_cast<Q>(k.mean_g);
      mean_gx[i] = static_cast<Q>(k.mean_gx);
    }
    const Vec<Q> xscale_v = vec_of(xscale), xoffset_v = vec_of(xoffset), gscale_v = vec_of(gscale);
    const Vec<Q> goffset_v = vec_of(goffset), gx_v = vec_of(gx), mean_g_v = vec_of(mean_g), mean_gx_v = vec_of(mean_gx);
    for (int64_t c = 0; c < cols; ++c) {
      const Vec<Q> dy_v = channel_at<Q>(dy, plane, c, count);  // padding lanes 0: no dbias term
      const Vec<Q> xhat = centered(c) * xscale_v + xoffset_v;
      const Vec<Q> g = g_of(dy_v, c);
      Vec<Q> grad;
      if constexpr (std::is_same_v<Q, double>) {
        grad = (g - mean_g_v - xhat * mean_gx_v) * gscale_v;  // cancels exactly where g is constant (rows' way)
      } else {
        grad = g * gscale_v + goffset_v - xhat * gx_v;
      }
      store_at<Q>(grad_input + p + c * plane, 0, count, grad);
      const Vec<Q> term = dy_v * xhat;
      dw_lanes[c] += count == L ? term : keep_first<Q>(term, count);  // a padding lane's xhat may be NaN
      db_lanes[c] += dy_v;
    }
    if (++vectors == kColumnBlockVectors) flush();
  }
  if (vectors > 0) flush();
}

template <class S, class G>
void backward_columns(const BackwardRows& a, int64_t plane, int64_t image, int64_t p0, int64_t p1,
                      void* lane_scratch, double* dweight, double* dbias) {
  // The caller's scratch, aligned for vectors (it gives kColumnScratchBytes per column plus 64 bytes).
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(lane_scratch) + 63) & ~uintptr_t{63};
  auto run = [&](auto compute_tag) {
    using Q = decltype(compute_tag);
    Vec<Q>* lanes = reinterpret_cast<Vec<Q>*>(aligned);
    backward_columns_as<S, G, Q>(a, plane, image, p0, p1, lanes, lanes + a.cols, dweight, dbias);
  };
  if constexpr (kFloatCapable<S, G>) {
    if (use_float<S, G>(a.cols)) return run(float{});
  }
  run(double{});
}

}  // namespace
}  // namespace LNX_ISA_NS
}  // namespace cpu
}  // namespace layernorm_ext
