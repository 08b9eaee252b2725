// Portable CPU kernels for LayerNorm and RMSNorm (forward, backward, optional fused residual), every dtype.
//
// Mapping: at::parallel_for splits rows across threads; one thread owns a whole row. Each row is converted
// once into a thread-local buffer of acc_t (float, or double for float64 rows), so the statistics and the
// normalize pass re-read it from L1/L2, never from memory. dtypes are resolved once per call into row
// loaders/storers (function pointers), so one kernel body serves every input/weight/residual dtype.
//
// Reductions: sums run in double over blocks of kSumBlock elements, SIMD lanes within a block; the variance
// is the corrected two-pass formula over the buffered row and the mean is applied as hi + lo, so rows with a
// large mean and tiny spread (mean 1e4, std 1e-2) keep full accuracy. The backward accumulates dweight/dbias partials in double
// per fixed chunk of rows (a count that depends only on rows and cols) and reduces the chunks in order: the
// same bits whatever the thread count.
//
// Seam for the SIMD issue: forward()/backward() at the bottom are the only entry points; vectorized
// variants slot in there behind isa_name().
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "../norm.h"

namespace layernorm_ext {
namespace cpu {
namespace {

constexpr int64_t kSumBlock = 512;
constexpr int64_t kParallelGrainElems = 1 << 15;  // elements per parallel task at least
constexpr int64_t kMaxChunks = 64;                // backward partials: chunks of rows
constexpr int64_t kMaxPartialElems = 1 << 22;     // cap on chunks * cols per partial buffer

// ---- dtype-resolved row conversions -----------------------------------------------------------------------
template <typename acc_t>
struct RowIO {
  void (*load)(const void* base, int64_t offset, acc_t* dst, int64_t n);  // dst = src
  void (*add)(const void* base, int64_t offset, acc_t* dst, int64_t n);   // dst += src
  void (*store)(acc_t* src, void* base, int64_t offset, int64_t n);       // dst = T(src)
  void (*store_rounded)(acc_t* src, void* base, int64_t offset, int64_t n);  // dst = T(src); src = dst
};

template <typename T, typename acc_t>
void load_row(const void* base, int64_t offset, acc_t* dst, int64_t n) {
  const T* src = static_cast<const T*>(base) + offset;
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[j]);
}

template <typename T, typename acc_t>
void add_row(const void* base, int64_t offset, acc_t* dst, int64_t n) {
  const T* src = static_cast<const T*>(base) + offset;
  for (int64_t j = 0; j < n; ++j) dst[j] += static_cast<acc_t>(src[j]);
}

template <typename T, typename acc_t>
void store_row(acc_t* src, void* base, int64_t offset, int64_t n) {
  T* dst = static_cast<T*>(base) + offset;
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j]);
}

template <typename T, typename acc_t>
void store_row_rounded(acc_t* src, void* base, int64_t offset, int64_t n) {
  T* dst = static_cast<T*>(base) + offset;
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = static_cast<T>(src[j]);
    src[j] = static_cast<acc_t>(dst[j]);
  }
}

template <typename T, typename acc_t>
RowIO<acc_t> make_io() {
  return {&load_row<T, acc_t>, &add_row<T, acc_t>, &store_row<T, acc_t>, &store_row_rounded<T, acc_t>};
}

template <typename acc_t>
RowIO<acc_t> row_io(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return make_io<float, acc_t>();
    case ScalarType::Double:
      return make_io<double, acc_t>();
    case ScalarType::Half:
      return make_io<c10::Half, acc_t>();
    case ScalarType::BFloat16:
      return make_io<c10::BFloat16, acc_t>();
    default:
      TORCH_CHECK(false, "layernorm_ext: unsupported dtype ", t);
  }
}

// Affine parameters converted once per call (empty when absent).
template <typename acc_t>
std::vector<acc_t> load_param(const void* ptr, ScalarType type, int64_t cols) {
  std::vector<acc_t> v(ptr ? cols : 0);
  if (ptr) row_io<acc_t>(type).load(ptr, 0, v.data(), cols);
  return v;
}

// Sums of term(j) over j < n, in blocks of kSumBlock: each block reduces in acc_t across SIMD lanes (the
// omp simd reduction lets the compiler keep independent partial sums), block sums are added in double.
template <typename acc_t, typename Term>
double blocked_sum(int64_t n, Term term) {
  double total = 0.0;
  for (int64_t start = 0; start < n; start += kSumBlock) {
    const int64_t end = std::min(n, start + kSumBlock);
    acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = start; j < end; ++j) sum += term(j);
    total += static_cast<double>(sum);
  }
  return total;
}

// Two sums in one pass: {sum of first(j), sum of second(j)}.
template <typename acc_t, typename First, typename Second>
std::pair<double, double> blocked_sum2(int64_t n, First first, Second second) {
  double total_a = 0.0, total_b = 0.0;
  for (int64_t start = 0; start < n; start += kSumBlock) {
    const int64_t end = std::min(n, start + kSumBlock);
    acc_t a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
    for (int64_t j = start; j < end; ++j) {
      a += first(j);
      b += second(j);
    }
    total_a += static_cast<double>(a);
    total_b += static_cast<double>(b);
  }
  return {total_a, total_b};
}

// ---- forward ----------------------------------------------------------------------------------------------
template <typename acc_t>
void forward_impl(const NormForwardParams& p) {
  const int64_t cols = p.cols;
  const std::vector<acc_t> weight = load_param<acc_t>(p.weight, p.weight_type, cols);
  const std::vector<acc_t> bias = load_param<acc_t>(p.bias, p.weight_type, cols);
  const RowIO<acc_t> input_io = row_io<acc_t>(p.input_type);
  const RowIO<acc_t> residual_io = row_io<acc_t>(p.residual_type);
  const RowIO<acc_t> h_io = row_io<acc_t>(p.h_type);
  acc_t* mean_out = static_cast<acc_t*>(p.mean);
  acc_t* rstd_out = static_cast<acc_t*>(p.rstd);
  const int64_t grain = std::max<int64_t>(1, kParallelGrainElems / cols);

  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row_buf(cols);
    acc_t* row = row_buf.data();
    for (int64_t r = begin; r < end; ++r) {
      const int64_t offset = r * cols;
      input_io.load(p.input, offset, row, cols);
      if (p.residual) {
        // h = input + residual, rounded to its dtype: the stored residual_out is exactly what is normalized.
        residual_io.add(p.residual, offset, row, cols);
        h_io.store_rounded(row, p.residual_out, offset, cols);
      }
      // Sums in double lanes. The mean is kept as hi + lo (two acc_t): x - hi is exact for x near the mean,
      // so (x - hi) - lo keeps rows like mean 1e4 / std 1e-2 accurate in float32.
      acc_t mean_hi = 0, mean_lo = 0;
      double var_or_ms;
      if (p.rms) {
        var_or_ms = blocked_sum<double>(cols, [&](int64_t j) { return double(row[j]) * double(row[j]); }) / cols;
      } else {
        const double mean = blocked_sum<double>(cols, [&](int64_t j) { return double(row[j]); }) / cols;
        mean_hi = static_cast<acc_t>(mean);
        mean_lo = static_cast<acc_t>(mean - static_cast<double>(mean_hi));
        const auto [dev, sq] = blocked_sum2<double>(
            cols, [&](int64_t j) { return double(row[j] - mean_hi); },
            [&](int64_t j) { return double(row[j] - mean_hi) * double(row[j] - mean_hi); });
        var_or_ms = sq / cols - (dev / cols) * (dev / cols);
      }
      const acc_t rstd = static_cast<acc_t>(1.0 / std::sqrt(std::max(var_or_ms, 0.0) + p.eps));
      if (mean_out) mean_out[r] = mean_hi;
      rstd_out[r] = rstd;

      auto centered = [&](int64_t j) { return ((row[j] - mean_hi) - mean_lo) * rstd; };
      if (!weight.empty() && !bias.empty()) {
        for (int64_t j = 0; j < cols; ++j) row[j] = centered(j) * weight[j] + bias[j];
      } else if (!weight.empty()) {
        for (int64_t j = 0; j < cols; ++j) row[j] = centered(j) * weight[j];
      } else if (!bias.empty()) {
        for (int64_t j = 0; j < cols; ++j) row[j] = centered(j) + bias[j];
      } else {
        for (int64_t j = 0; j < cols; ++j) row[j] = centered(j);
      }
      input_io.store(row, p.out, offset, cols);
    }
  });
}

// ---- backward ---------------------------------------------------------------------------------------------
// Per row, with xhat the normalized input and g = dy * weight:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
//   dweight += dy * xhat, dbias += dy (per chunk of rows, then reduced in chunk order)
// The row math runs in double whatever the dtype: dx = rstd * (g - xhat * mean(g * xhat)) cancels badly when
// xhat is close to +-1 (tiny rows, N = 1), and float rounding of xhat there cost more than ATen's error.
template <typename stat_t>
void backward_impl(const NormBackwardParams& p) {
  using acc_t = double;
  const int64_t rows = p.rows;
  const int64_t cols = p.cols;
  const std::vector<acc_t> weight = load_param<acc_t>(p.weight, p.weight_type, cols);
  const std::vector<acc_t> bias = load_param<acc_t>(p.bias, p.weight_type, cols);
  const RowIO<acc_t> out_io = row_io<acc_t>(p.out_type);
  const RowIO<acc_t> saved_io = row_io<acc_t>(p.saved_type);
  const RowIO<acc_t> grad_residual_io = row_io<acc_t>(p.grad_residual_type);
  const stat_t* rstd_in = static_cast<const stat_t*>(p.rstd);

  const int64_t chunks_wanted = std::clamp<int64_t>(std::min(kMaxChunks, kMaxPartialElems / cols), 1, rows);
  const int64_t chunk_rows = (rows + chunks_wanted - 1) / chunks_wanted;
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  const bool want_dweight = p.grad_weight != nullptr;
  const bool want_dbias = p.grad_bias != nullptr;
  // Partials in double: each holds a sum over up to rows / chunks rows.
  std::vector<double> dweight_partial(want_dweight ? chunks * cols : 0);
  std::vector<double> dbias_partial(want_dbias ? chunks * cols : 0);

  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<acc_t> xhat_buf(cols), dy_buf(cols);
    acc_t* xhat = xhat_buf.data();
    acc_t* dy = dy_buf.data();
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      double* dweight = want_dweight ? dweight_partial.data() + c * cols : nullptr;
      double* dbias = want_dbias ? dbias_partial.data() + c * cols : nullptr;
      const int64_t row_end = std::min(rows, (c + 1) * chunk_rows);
      for (int64_t r = c * chunk_rows; r < row_end; ++r) {
        const int64_t offset = r * cols;
        const acc_t rstd = static_cast<acc_t>(rstd_in[r]);
        saved_io.load(p.saved, offset, xhat, cols);
        if (p.saved_is_output) {
          if (!bias.empty()) for (int64_t j = 0; j < cols; ++j) xhat[j] -= bias[j];
          if (!weight.empty()) for (int64_t j = 0; j < cols; ++j) xhat[j] /= weight[j];
        } else {
          // The row's mean again, in double: the float32 mean the forward stored is off by up to half an ulp
          // of the mean, which for a mean of 1e4 and a std of 1e-2 is 5% of xhat.
          const acc_t mean = p.rms ? acc_t(0) : blocked_sum<acc_t>(cols, [&](int64_t j) { return xhat[j]; }) / cols;
          for (int64_t j = 0; j < cols; ++j) xhat[j] = (xhat[j] - mean) * rstd;
        }
        out_io.load(p.grad_out, offset, dy, cols);
        if (dweight) for (int64_t j = 0; j < cols; ++j) dweight[j] += dy[j] * xhat[j];
        if (dbias) for (int64_t j = 0; j < cols; ++j) dbias[j] += dy[j];
        if (!weight.empty()) for (int64_t j = 0; j < cols; ++j) dy[j] *= weight[j];  // dy is g from here
        const auto [sum_g, sum_gx] = blocked_sum2<acc_t>(
            cols, [&](int64_t j) { return dy[j]; }, [&](int64_t j) { return dy[j] * xhat[j]; });
        const acc_t mean_g = p.rms ? acc_t(0) : static_cast<acc_t>(sum_g / cols);
        const acc_t mean_gx = static_cast<acc_t>(sum_gx / cols);
        for (int64_t j = 0; j < cols; ++j) xhat[j] = rstd * (dy[j] - mean_g - xhat[j] * mean_gx);
        if (p.grad_residual_out) grad_residual_io.add(p.grad_residual_out, offset, xhat, cols);
        saved_io.store(xhat, p.grad_input, offset, cols);
      }
    }
  });

  // Fixed-order reduction of the chunk partials, parallel over columns.
  const RowIO<double> weight_io = row_io<double>(p.weight_type);
  auto reduce = [&](const std::vector<double>& partial, void* dst) {
    at::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
      std::vector<double> sum(partial.begin() + begin, partial.begin() + end);
      for (int64_t c = 1; c < chunks; ++c) {
        const double* src = partial.data() + c * cols;
        for (int64_t j = begin; j < end; ++j) sum[j - begin] += src[j];
      }
      weight_io.store(sum.data(), dst, begin, end - begin);
    });
  };
  if (want_dweight) reduce(dweight_partial, p.grad_weight);
  if (want_dbias) reduce(dbias_partial, p.grad_bias);
}

}  // namespace

const char* isa_name() { return "scalar"; }

void forward(const NormForwardParams& p) {
  if (p.acc_type == ScalarType::Double) {
    forward_impl<double>(p);
  } else {
    forward_impl<float>(p);
  }
}

void backward(const NormBackwardParams& p) {
  if (p.acc_type == ScalarType::Double) {
    backward_impl<double>(p);
  } else {
    backward_impl<float>(p);
  }
}

}  // namespace cpu
}  // namespace layernorm_ext
