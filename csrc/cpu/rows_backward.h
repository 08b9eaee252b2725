// The backward row kernels (a part of rows_impl.h, after rows_simd.h): BackwardRow (one row over a column
// range), and the grouped rows of backward_rows: each row's sums and dweight / dbias terms, then its dx.
#ifndef LNX_ROWS_IMPL
#error "rows_backward.h is a part of rows_impl.h: include that (as rows_<isa>.cpp do)"
#endif

namespace layernorm_ext {
namespace cpu {
namespace LNX_ISA_NS {
namespace {

// ---- backward -----------------------------------------------------------------------------------------------
// With xhat the normalized row and g = dy * weight:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat));  RMSNorm: dx = rstd * (g - xhat * mean(g * xhat))
//   dweight += dy * xhat, dbias += dy.
// dst[0, count) += v (count <= lanes of C).
template <class C>
inline void add_into(C* dst, int64_t count, Vec<C> v) {
  store_at<C>(dst, 0, count, load_at<C>(dst, 0, count) + v);
}

// dst[0, count) += v, or = v with overwrite (dst unset).
template <class C>
inline void add_or_store(C* dst, int64_t count, Vec<C> v, bool overwrite) {
  if (overwrite) {
    store_at<C>(dst, 0, count, v);
  } else {
    add_into<C>(dst, count, v);
  }
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

  // Always inlined: a call per row was 6.5% of a 16384x128 float32 backward.
  __attribute__((always_inline)) BackwardRow(const BackwardRows& a, int64_t row, const C* weight_c, const C* bias_c)
      : weight(weight_c),
        bias(bias_c),
        saved(static_cast<const S*>(a.saved) + a.saved_rows.offset(row)),
        dy(static_cast<const G*>(a.grad_out) + a.grad_out_rows.offset(row)),
        grad_residual(a.grad_residual_out != nullptr
                          ? static_cast<const S*>(a.grad_residual_out) + a.grad_residual_rows.offset(row)
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
// kRowGroupBytes, about a quarter of L2): first each row's sums (reading it from memory), with its dweight / dbias
// terms (ATen's order: xhat from the stored mean needs no sums first) but for short rows of 16-bit types (see
// backward_rows_as), then dx vector by vector across the group's rows (re-read from cache), with those rows' terms.
constexpr int64_t kRowGroup = 8;
constexpr int64_t kColumnBlock = 2048;

// One group's rows, located once for both passes (their operands' rows and statistics).
template <class S, class G, class C>
struct RowGroup {
  int64_t count;
  const S* saved[kRowGroup];
  const G* dy[kRowGroup];
  const S* residual[kRowGroup];
  S* dx[kRowGroup];
  double rstd[kRowGroup], center[kRowGroup];

  RowGroup(const BackwardRows& a, int64_t first, int64_t rows) : count(rows) {
    for (int64_t i = 0; i < count; ++i) {
      const BackwardRow<S, G, C> r(a, first + i, nullptr, nullptr);
      saved[i] = r.saved;
      dy[i] = r.dy;
      residual[i] = r.grad_residual;
      dx[i] = r.dx;
      rstd[i] = r.rstd;
      center[i] = r.center;
    }
  }
};

// Per row of a group, the constants of its dx and xhat (see apply_group).
template <class C>
struct GroupRowConstants {
  C center, xscale, xoffset, gscale, goffset, gx, mean_g, mean_gx;
};

// dx over columns [j, j + cnt) of R rows of a group, and the sums of their dweight terms (dy * xhat, or with
// correction_only its correction dy * xoffset: see apply_group_as) and dbias terms added into dw / db. kSavedOut:
// xhat is recovered from the output (memory-efficient mode). Every row's inputs are loaded before any dx is
// stored: rows a power of two of bytes apart would otherwise make the loads wait on the stores (4K aliasing).
template <int R, bool kSavedOut, bool kResidual, class S, class G, class C>
inline void rows_step(int64_t j, int64_t cnt, const C* weight, const C* bias, const S* const* saved,
                      const G* const* dy, const S* const* residual, S* const* dx, const GroupRowConstants<C>* k,
                      bool correction_only, Vec<C>& dw, Vec<C>& db) {
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
    dw = dw + dy_v[i] * (correction_only ? broadcast<C>(k[i].xoffset) : xhat);
    db = db + dy_v[i];
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) store_at<C>(dx[i], j, cnt, grad[i]);
}

// dx of R rows over columns [c0, c1), and (where not null) dweight / dbias += the sums of their terms (rows_step;
// one read-modify-write per vector for the R rows), or = with overwrite: the same bits as adding them to zeros (the
// sums start at +0, so none is -0).
template <int R, bool kSavedOut, bool kResidual, class S, class G, class C>
void rows_block(int64_t c0, int64_t c1, const C* weight, const C* bias, const S* const* saved, const G* const* dy,
                const S* const* residual, S* const* dx, const GroupRowConstants<C>* k, C* dweight, C* dbias,
                bool correction_only, bool overwrite) {
  constexpr int64_t L = kLanes<C>;
  // Local copies of the rows (the stores into dx may alias any memory: see rows_sums).
  const S* x_rows[R];
  const G* dy_rows[R];
  const S* residual_rows[R];
  S* dx_rows[R];
  GroupRowConstants<C> constants[R];
  for (int i = 0; i < R; ++i) {
    x_rows[i] = saved[i];
    dy_rows[i] = dy[i];
    residual_rows[i] = residual[i];
    dx_rows[i] = dx[i];
    constants[i] = k[i];
  }
  auto step = [&](int64_t j, int64_t cnt) {
    Vec<C> dw = Vec<C>{}, db = Vec<C>{};
    rows_step<R, kSavedOut, kResidual>(j, cnt, weight, bias, x_rows, dy_rows, residual_rows, dx_rows, constants,
                                       correction_only, dw, db);
    if (dweight != nullptr) add_or_store<C>(dweight + j, cnt, dw, overwrite);
    if (dbias != nullptr) add_or_store<C>(dbias + j, cnt, db, overwrite);
  };
  int64_t j = c0;
  for (; j + L <= c1; j += L) step(j, L);
  if (j < c1) step(j, c1 - j);
}

// dx of a group's rows: column block by column block, rows two at a time within a block (four were slower:
// more streams of rows a power of two apart meet in one L1 set).
// Per row, with s = rstd: xhat = (x - center) * s - delta * s (memory-efficient: the recovered xhat, scale 1),
// and in float dx = g * s - mean_g * s - xhat * (mean_gx * s): two FMAs after g (in double, as BackwardRow).
// terms_here: the dweight / dbias terms are added here, two rows per read-modify-write (= for the first two with
// overwrite). Otherwise the sums pass added dy * (x - center) * s into dweight, without xhat's correction
// xoffset = -delta * s: where that is beyond C's rounding in some row of the group (|xoffset| > 2^-24 in float:
// rows far from their float mean; the huge-mean rows of test_nonfinite lost 1.5x ATen's accuracy without it),
// dy * xoffset of every row of the group is added here (one read-modify-write per pair of rows).
template <bool kSavedOut, bool kResidual, class S, class G, class C>
void apply_group_as(const BackwardRows& a, const RowGroup<S, G, C>& rows, const C* weight, const C* bias,
                    const BackwardCoefficients* coefficients, C* dweight, C* dbias, bool terms_here, bool overwrite) {
  const int64_t n = a.cols, count = rows.count;
  const S* const* saved = rows.saved;
  const G* const* dy = rows.dy;
  const S* const* residual = rows.residual;
  S* const* dx = rows.dx;
  GroupRowConstants<C> k[kRowGroup];
  bool fix = false;
  for (int64_t i = 0; i < count; ++i) {
    const BackwardCoefficients& c = coefficients[i];
    const double rstd = rows.rstd[i], xs = kSavedOut ? 1.0 : rstd;
    k[i] = {static_cast<C>(rows.center[i]),  static_cast<C>(xs),
            static_cast<C>(-c.delta * xs),   static_cast<C>(rstd),
            static_cast<C>(-c.mean_g * rstd), static_cast<C>(c.mean_gx * rstd),
            static_cast<C>(c.mean_g),        static_cast<C>(c.mean_gx)};
    if (!(__builtin_fabs(c.delta * xs) <= (std::is_same_v<C, double> ? 0x1p-53 : 0x1p-24))) fix = true;
  }
  C* dweight_out = terms_here || fix ? dweight : nullptr;
  C* dbias_out = terms_here ? dbias : nullptr;
  for (int64_t c0 = 0; c0 < n; c0 += kColumnBlock) {
    const int64_t c1 = min64(n, c0 + kColumnBlock);
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      rows_block<2, kSavedOut, kResidual>(c0, c1, weight, bias, saved + i, dy + i, residual + i, dx + i, k + i,
                                          dweight_out, dbias_out, !terms_here, terms_here && overwrite && i == 0);
    }
    if (i < count) {
      rows_block<1, kSavedOut, kResidual>(c0, c1, weight, bias, saved + i, dy + i, residual + i, dx + i, k + i,
                                          dweight_out, dbias_out, !terms_here, terms_here && overwrite && i == 0);
    }
  }
}

template <class S, class G, class C>
void apply_group(const BackwardRows& a, const RowGroup<S, G, C>& rows, const C* weight, const C* bias,
                 const BackwardCoefficients* coefficients, C* dweight, C* dbias, bool terms_here, bool overwrite) {
  auto run = [&](auto saved_out_tag, auto residual_tag) {
    apply_group_as<decltype(saved_out_tag)::value, decltype(residual_tag)::value, S, G, C>(
        a, rows, weight, bias, coefficients, dweight, dbias, terms_here, overwrite);
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
// into double vectors every kFlushVectors vectors. And the rows' dweight / dbias terms, dy * d * xscale and dy
// (xhat from the stored mean, without BackwardRow's correction delta, as ATen's), added into dweight / dbias
// (= with overwrite: the same bits as adding them to zeros, the terms starting at +0).
template <int R, bool kWeight, bool kSavedOut, class S, class G, class C>
void rows_sums(int64_t n, const C* weight, const C* bias, const S* const* saved, const G* const* dy,
               const C* center, const C* xscale, C* dweight, C* dbias, bool overwrite, Array<double, 3>* out) {
  constexpr int64_t L = kLanes<C>;
  const int64_t full = n - n % L;
  Vec<double> total[R][3] = {};
  // Local copies: the intrinsics' stores into dweight / dbias may alias any memory, so what is read through the
  // caller's arrays would be read again after each of them.
  const S* x_rows[R];
  const G* dy_rows[R];
  Vec<C> center_v[R], xscale_v[R];
  for (int i = 0; i < R; ++i) {
    x_rows[i] = saved[i];
    dy_rows[i] = dy[i];
    center_v[i] = broadcast<C>(center[i]);
    xscale_v[i] = broadcast<C>(xscale[i]);
  }
  auto term = [&](int64_t j, int64_t cnt, Vec<C> (&acc)[R][3]) {
    Vec<C> dw = Vec<C>{}, db = Vec<C>{};
    Vec<C> w_v = broadcast<C>(C(1)), b_v = Vec<C>{};
    if constexpr (kWeight) w_v = load_at<C>(weight, j, cnt);
    if constexpr (kSavedOut) {
      if (bias != nullptr) b_v = load_at<C>(bias, j, cnt);
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const Vec<C> dy_v = load_at<C>(dy_rows[i], j, cnt);
      const Vec<C> x = load_at<C>(x_rows[i], j, cnt);
      Vec<C> d;
      if constexpr (kSavedOut) {
        d = x - b_v;  // out = xhat * weight + bias
        if constexpr (kWeight) d = d / w_v;
      } else {
        d = x - center_v[i];
      }
      const Vec<C> g = kWeight ? dy_v * w_v : dy_v;
      acc[i][0] += g;
      acc[i][1] += g * d;
      acc[i][2] += d;
      dw = dw + dy_v * (d * xscale_v[i]);
      db = db + dy_v;
    }
    if (dweight != nullptr) add_or_store<C>(dweight + j, cnt, dw, overwrite);
    if (dbias != nullptr) add_or_store<C>(dbias + j, cnt, db, overwrite);
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

// Rows of at most kShortRowBytes have their sums taken one row at a time: read two at a time, each load met a
// new short stream per pair of rows, which the hardware prefetchers did not follow (16384x128 float32 backward,
// 1 thread: 2.6-2.9 ms two at a time, 1.5-1.9 ms one at a time, ATen's 0.73-0.94 ms, on a loaded machine).
constexpr int64_t kShortRowBytes = 1024;

// The sums of rows [first, first + count): two rows at a time (the weight read once for both), short rows one
// at a time. Either way each row's sums are the same. Their dweight / dbias terms added into dweight / dbias where
// those are not null.
template <class S, class G, class C>
void group_sums(const BackwardRows& a, const RowGroup<S, G, C>& rows, bool short_rows, const C* weight, const C* bias,
                C* dweight, C* dbias, bool overwrite, Array<double, 3>* out) {
  const int64_t count = rows.count;
  const S* const* saved = rows.saved;
  const G* const* dy = rows.dy;
  C center[kRowGroup], xscale[kRowGroup];
  for (int64_t i = 0; i < count; ++i) {
    center[i] = static_cast<C>(rows.center[i]);
    xscale[i] = static_cast<C>(a.saved_is_output ? 1.0 : rows.rstd[i]);
  }
  auto run = [&](auto weight_tag, auto saved_out_tag) {
    constexpr bool kWeight = decltype(weight_tag)::value, kSavedOut = decltype(saved_out_tag)::value;
    int64_t i = 0;
    if (!short_rows) {
      for (; i + 2 <= count; i += 2) {
        rows_sums<2, kWeight, kSavedOut>(a.cols, weight, bias, saved + i, dy + i, center + i, xscale + i, dweight,
                                         dbias, overwrite && i == 0, out + i);
      }
    }
    for (; i < count; ++i) {
      rows_sums<1, kWeight, kSavedOut>(a.cols, weight, bias, saved + i, dy + i, center + i, xscale + i, dweight, dbias,
                                       overwrite && i == 0, out + i);
    }
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
void backward_rows_as(const BackwardRows& a, int64_t begin, int64_t end, C* dweight, C* dbias, bool overwrite) {
  const C* weight = param_as<C>(a, false);
  const C* bias = param_as<C>(a, true);
  const int64_t n = a.cols;
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(S) + sizeof(G));
  const int64_t group = row_bytes >= kRowGroupBytes ? 1 : min64(kRowGroup, kRowGroupBytes / row_bytes);
  // Short rows take their sums one at a time (kShortRowBytes). Their dweight / dbias terms: with the sums (in
  // ATen's order, one read-modify-write of the partials per row) for float rows, in the apply (two rows per
  // read-modify-write) for rows of a narrower type, whose partials are wider than their elements (1 thread,
  // 1024x256: float32 LayerNorm 138 us in the sums pass, 157 in the apply; bfloat16 134 and 125).
  const bool short_rows = n * static_cast<int64_t>(sizeof(S) > sizeof(G) ? sizeof(S) : sizeof(G)) <= kShortRowBytes;
  const bool terms_in_apply = short_rows && sizeof(S) + sizeof(G) < 2 * sizeof(C);
  for (int64_t first = begin; first < end; first += group) {
    const int64_t count = min64(group, end - first);
    const bool first_group = overwrite && first == begin;
    const RowGroup<S, G, C> rows(a, first, count);
    BackwardCoefficients coefficients[kRowGroup];
    Array<double, 3> sums[kRowGroup];
    group_sums<S, G, C>(a, rows, short_rows, weight, bias, terms_in_apply ? nullptr : dweight,
                        terms_in_apply ? nullptr : dbias, first_group, sums);
    for (int64_t i = 0; i < count; ++i) coefficients[i] = backward_coefficients(a, rows.rstd[i], sums[i]);
    apply_group<S, G, C>(a, rows, weight, bias, coefficients, dweight, dbias, terms_in_apply, first_group);
  }
}

template <class S, class G>
void backward_rows(const BackwardRows& a, int64_t begin, int64_t end, void* dweight, void* dbias, bool overwrite) {
  if constexpr (kFloatCapable<S, G>) {
    if (use_float<S, G>(a.cols)) {
      return backward_rows_as<S, G, float>(a, begin, end, static_cast<float*>(dweight), static_cast<float*>(dbias),
                                           overwrite);
    }
  }
  backward_rows_as<S, G, double>(a, begin, end, static_cast<double*>(dweight), static_cast<double*>(dbias), overwrite);
}

}  // namespace
}  // namespace LNX_ISA_NS
}  // namespace cpu
}  // namespace layernorm_ext
