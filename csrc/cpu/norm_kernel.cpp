// CPU orchestration: picks the instruction set once, resolves dtypes to row kernels (rows_impl.h, compiled
// per ISA), and spreads rows over threads with at::parallel_for.
//
// Forward: rows split across threads, one thread per row (rows_forward.h has the per-row passes); a few long
// rows (M = 1, N = 2^20) are instead split into column ranges, each pass over the ranges in parallel and
// the ranges' sums added in order.
// Channels-first rows (p.plane > 0, columns.h): tasks of kColumnPixels pixels of one image, in parallel; the
// backward's tasks grouped into chunks as the rows are (shape only), each chunk's dweight / dbias into its double
// partial, reduced in chunk order.
// Backward: rows grouped into a fixed number of chunks (it depends on rows and cols only, never on the thread
// count); each chunk adds its rows' dweight/dbias into its own partial buffer (double, or the compute type where a
// chunk is one block of rows), then the partials are reduced in chunk order, in double, parallel over columns: the
// same bits whatever the thread count. Long rows in fewer chunks than column ranges (split_backward: a few rows,
// or cols > 2^18) run each row's column ranges in parallel instead, so that they do not run on one thread.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../norm.h"
#include "row_kernels.h"

namespace layernorm_ext {
namespace cpu {
namespace {

constexpr int64_t kParallelGrainElems = 1 << 15;  // elements per parallel task at least
// A few long rows are split into column ranges across threads (decided by shape only, so the bits do not
// depend on the thread count): rows < kSplitMaxRows with cols >= kSplitMinCols, ranges of kSegmentCols.
constexpr int64_t kSplitMaxRows = 4;
constexpr int64_t kSplitMinCols = 1 << 16;
constexpr int64_t kSegmentCols = 1 << 14;
// Backward partials: up to kMaxChunks chunks of at least kMinChunkRows rows, chunks * cols <= kMaxPartialElems
// (each partial row is read and written once per row of its chunk, so it should stay in cache).
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kMinChunkRows = 8;
constexpr int64_t kMaxPartialElems = 1 << 18;
// Within a chunk, the row kernels add at most this many rows into a block partial of their compute type before
// it is added into the chunk's double partial: float sums of thousands of rows would lose digits.
constexpr int64_t kBlockRows = 64;
// Channels-first rows: pixels per task (a multiple of every ISA's lanes).
constexpr int64_t kColumnPixels = 256;

// ---- instruction set ----------------------------------------------------------------------------------------
bool cpu_has(const char* isa) {
  const std::string name(isa);
  if (name == "scalar") return true;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (name == "avx2") return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (name == "avx512") return avx512;
  if (name == "avx512_bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
  return false;
}

// avx512_bf16 is the AVX-512 copy rounding float -> bfloat16 with AVX512_BF16 (RowKernels::set_native_bf16).
const RowKernels* kernels_for(const std::string& isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == "avx512" || isa == "avx512_bf16") return &avx512_row_kernels();
  if (isa == "avx2") return &avx2_row_kernels();
#endif
  if (isa == "scalar") return &portable_row_kernels();
  return nullptr;
}

constexpr const char* kIsaOrder[] = {"avx512_bf16", "avx512", "avx2", "scalar"};

std::string best_isa() {
  for (const char* isa : kIsaOrder) {
    if (cpu_has(isa)) return isa;
  }
  return "scalar";
}

// The best ISA the CPU has, or LAYERNORM_EXT_CPU_ISA when it names one the CPU has (a lower one).
std::string initial_isa() {
  const char* requested = std::getenv("LAYERNORM_EXT_CPU_ISA");
  if (requested == nullptr || *requested == '\0') return best_isa();
  const std::string want(requested);
  TORCH_CHECK(want == "scalar" || want == "avx2" || want == "avx512" || want == "avx512_bf16",
              message("LAYERNORM_EXT_CPU_ISA must be one of scalar, avx2, avx512, avx512_bf16, but got '", want, "'"));
  if (cpu_has(want.c_str())) return want;
  const std::string fallback = best_isa();
  TORCH_WARN(message("LAYERNORM_EXT_CPU_ISA=", want, ": this CPU lacks it; using ", fallback));
  return fallback;
}

std::mutex isa_mutex;
const RowKernels* active = nullptr;
const char* active_name = nullptr;  // kIsaOrder's entry

// Callers hold isa_mutex.
void activate(const std::string& isa) {
  for (const char* name : kIsaOrder) {
    if (isa == name) active_name = name;
  }
  active = kernels_for(isa);
  active->set_native_bf16(isa == "avx512_bf16");
}

const RowKernels& kernels() {
  std::lock_guard<std::mutex> lock(isa_mutex);
  if (active == nullptr) activate(initial_isa());
  return *active;
}

// ---- non-temporal output ------------------------------------------------------------------------------------
// The forward writes an output of at least stream_bytes with non-temporal stores (ForwardRows::stream_out): one
// larger than the last-level cache leaves no part a consumer could read from there, and a plain store first reads
// each line from DRAM. That cache's size comes from sysfs (glibc's sysconf said 320 MB for this VM's 32 MB L3);
// where none is known, no output streams.
int64_t last_level_cache_bytes() {
  int64_t largest = 0;
  for (int index = 0; index < 16; ++index) {
    std::ifstream file("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    int64_t size = 0;
    char unit = 0;
    if (!(file >> size)) break;
    file >> unit;
    const int64_t bytes = unit == 'K' ? size << 10 : unit == 'M' ? size << 20 : unit == 'G' ? size << 30 : size;
    largest = std::max(largest, bytes);
  }
  return largest;
}

std::atomic<int64_t> stream_bytes{-1};  // -1: the last-level cache's size, read on first use

int64_t stream_threshold() {
  int64_t bytes = stream_bytes.load();
  if (bytes < 0) {
    const int64_t cache = last_level_cache_bytes();
    bytes = cache > 0 ? cache : std::numeric_limits<int64_t>::max();
    stream_bytes.store(bytes);
  }
  return bytes;
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
    default: TORCH_CHECK(false, message("layernorm_ext: unsupported dtype ", t));
  }
}

template <typename T>
constexpr ScalarType scalar_type_of() {
  return std::is_same_v<T, double> ? ScalarType::Double : ScalarType::Float;
}

// The affine parameter as To values: the tensor's own memory when it has that dtype, else a converted copy in
// a per-thread buffer that is reused (slot tells the buffers apart), so that no call page-faults on it.
// Calls fn(T{}) with T the C++ type of a parameter dtype.
template <typename Fn>
void visit_param_dtype(ScalarType type, const Fn& fn) {
  switch (type) {
    case ScalarType::Float:
      return fn(float{});
    case ScalarType::Double:
      return fn(double{});
    case ScalarType::BFloat16:
      return fn(c10::BFloat16{});
    case ScalarType::Half:
      return fn(c10::Half{});
    default: TORCH_CHECK(false, message("layernorm_ext: unsupported parameter dtype ", type));
  }
}

// ---- per-thread scratch ---------------------------------------------------------------------------------
// Buffers reused across calls by the thread that grew them (a fresh multi-megabyte buffer would page-fault on
// every call). A lease lends one for the length of a call; when it ends, a buffer grown past
// kKeptScratchBytes is freed, so one very wide call does not leave cols-sized buffers on every thread for the
// life of the process. kept_scratch_bytes counts what all threads keep (scratch_bytes(), for tests).
constexpr size_t kKeptScratchBytes = size_t{4} << 20;
std::atomic<int64_t> kept_scratch_bytes{0};

template <typename T>
struct KeptBuffer {
  std::vector<T> v;
  KeptBuffer() = default;
  KeptBuffer(const KeptBuffer&) = delete;
  KeptBuffer& operator=(const KeptBuffer&) = delete;
  ~KeptBuffer() { kept_scratch_bytes -= static_cast<int64_t>(v.capacity() * sizeof(T)); }
};

// What each buffer holds (one per element type and slot, per thread).
enum ScratchSlot {
  kWeightSlot, kBiasSlot, kDweightSlot, kDbiasSlot, kBlockDweightSlot, kBlockDbiasSlot, kQuantRowSlot, kLaneSlot
};

template <typename T, int kSlot>
class ScratchLease {
 public:
  ScratchLease() = default;
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  ~ScratchLease() {
    std::vector<T>& v = buffer().v;
    if (v.capacity() * sizeof(T) > kKeptScratchBytes) {
      kept_scratch_bytes -= static_cast<int64_t>(v.capacity() * sizeof(T));
      std::vector<T>().swap(v);
    }
  }
  // At least n elements, contents unspecified.
  T* get(int64_t n) {
    std::vector<T>& v = buffer().v;
    if (static_cast<int64_t>(v.size()) < n) {
      const size_t before = v.capacity();
      v.resize(static_cast<size_t>(n));
      kept_scratch_bytes += static_cast<int64_t>((v.capacity() - before) * sizeof(T));
    }
    return v.data();
  }
  // n zeros.
  T* zeroed(int64_t n) {
    T* p = get(n);
    std::fill(p, p + n, T(0));
    return p;
  }

 private:
  static KeptBuffer<T>& buffer() {
    thread_local KeptBuffer<T> b;
    return b;
  }
};

// The parameter plus offset as To: itself when it has that dtype and no offset, else converted into the
// lease's buffer (the sum rounded once in To, as `1.0 + weight.float()` is; an offset of 0 is not added, so that
// a weight of -0 keeps its sign, as in ATen and the CUDA kernels).
template <typename To, int kSlot>
const To* param_as(const void* ptr, ScalarType type, int64_t cols, ScratchLease<To, kSlot>& lease,
                   double offset = 0.0) {
  if (ptr == nullptr) return nullptr;
  if (type == scalar_type_of<To>() && offset == 0.0) return static_cast<const To*>(ptr);
  To* v = lease.get(cols);
  const To add = static_cast<To>(offset);
  visit_param_dtype(type, [&](auto tag) {
    const auto* src = static_cast<const decltype(tag)*>(ptr);
    if (offset == 0.0) {
      for (int64_t j = 0; j < cols; ++j) v[j] = static_cast<To>(src[j]);
    } else {
      for (int64_t j = 0; j < cols; ++j) v[j] = static_cast<To>(src[j]) + add;
    }
  });
  return v;
}

void store_param(const double* src, void* dst, ScalarType type, int64_t offset, int64_t count) {
  visit_param_dtype(type, [&](auto tag) {
    using To = decltype(tag);
    To* out = static_cast<To*>(dst) + offset;
    for (int64_t j = 0; j < count; ++j) out[j] = static_cast<To>(src[j]);
  });
}

bool split_rows(int64_t rows, int64_t cols) { return rows < kSplitMaxRows && cols >= kSplitMinCols; }

// Backward: the rows' chunks run in parallel, unless long rows split into more column ranges than there are
// chunks (a few rows, or rows too long for more than one chunk's partial to stay in cache: cols > 2^18 gives
// one chunk); then each row's column ranges run in parallel. Shape only, never the thread count.
bool split_backward(int64_t rows, int64_t cols, int64_t chunks) {
  return cols >= kSplitMinCols && (cols + kSegmentCols - 1) / kSegmentCols > chunks;
}

// fn(range index, c0, c1) for every column range of a row, ranges in parallel.
template <typename Fn>
void for_each_range(int64_t cols, const Fn& fn) {
  const int64_t ranges = (cols + kSegmentCols - 1) / kSegmentCols;
  at::parallel_for(0, ranges, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) fn(s, s * kSegmentCols, std::min(cols, (s + 1) * kSegmentCols));
  });
}

// The sums of ranges [begin, end) of partial (K sums per range), added pairwise (halves, recursively): the
// rounding error grows with log(ranges), as within a range (rows_simd.h, PairwiseSums).
template <int K>
std::array<double, K> pairwise_total(const std::vector<double>& partial, int64_t begin, int64_t end) {
  if (end - begin == 1) {
    std::array<double, K> one;
    for (int k = 0; k < K; ++k) one[k] = partial[K * begin + k];
    return one;
  }
  const int64_t middle = begin + (end - begin) / 2;
  std::array<double, K> total = pairwise_total<K>(partial, begin, middle);
  const std::array<double, K> right = pairwise_total<K>(partial, middle, end);
  for (int k = 0; k < K; ++k) total[k] += right[k];
  return total;
}

// Runs sums_of(c0, c1, out[K]) over the ranges of a row and adds the ranges' results in a fixed order.
template <int K, typename Fn>
std::array<double, K> ordered_sums(int64_t cols, const Fn& sums_of) {
  const int64_t ranges = (cols + kSegmentCols - 1) / kSegmentCols;
  std::vector<double> partial(K * ranges);
  for_each_range(cols, [&](int64_t s, int64_t c0, int64_t c1) { sums_of(c0, c1, &partial[K * s]); });
  return pairwise_total<K>(partial, 0, ranges);
}

template <typename C>
void forward_split(const NormForwardParams& p, const RowKernels& k, const ForwardRows& a, Dtype src_dtype) {
  const int64_t cols = p.cols;
  const SegmentSumsFn sums_fn = k.segment_sums(src_dtype);
  const SegmentNormalizeFn normalize_fn = k.segment_normalize(src_dtype, to_dtype(p.input_type));
  TORCH_CHECK(sums_fn != nullptr && normalize_fn != nullptr, "layernorm_ext: no CPU kernel for split rows");
  const void* src = p.residual != nullptr ? p.residual_out : p.input;
  const RowLayout& src_rows = p.residual != nullptr ? p.residual_out_rows : p.input_rows;
  for (int64_t row = 0; row < p.rows; ++row) {
    const int64_t offset = src_rows.offset(row);
    if (p.residual != nullptr) {
      const int64_t input_offset = p.input_rows.offset(row), residual_offset = p.residual_rows.offset(row);
      for_each_range(cols, [&](int64_t, int64_t c0, int64_t c1) {
        a.add_row(p.input, input_offset + c0, p.residual, residual_offset + c0, p.residual_out, offset + c0, c1 - c0);
      });
    }
    auto sums_about = [&](double center) {
      return ordered_sums<2>(cols, [&](int64_t c0, int64_t c1, double* out) {
        sums_fn(src, offset + c0, offset + c1, center, out);
      });
    };
    double mean = 0.0, var_or_ms;
    if (p.rms) {
      var_or_ms = sums_about(0.0)[1] / static_cast<double>(cols);
    } else {
      // Two passes: the mean, then the centered sums about it (corrected two-pass variance).
      const C center = static_cast<C>(sums_about(0.0)[0] / static_cast<double>(cols));
      const auto [dev, sq] = sums_about(static_cast<double>(center));
      const double dev_mean = dev / static_cast<double>(cols);
      var_or_ms = sq / static_cast<double>(cols) - dev_mean * dev_mean;
      mean = static_cast<double>(center) + dev_mean;
    }
    const C rstd = static_cast<C>(1.0 / std::sqrt((var_or_ms < 0.0 ? 0.0 : var_or_ms) + p.eps));
    if (p.mean != nullptr) static_cast<C*>(p.mean)[row] = static_cast<C>(mean);
    if (p.rstd != nullptr) static_cast<C*>(p.rstd)[row] = rstd;  // none stored by the inference ops
    for_each_range(cols, [&](int64_t, int64_t c0, int64_t c1) {
      normalize_fn(a, row, c0, c1, mean, static_cast<double>(rstd));
    });
  }
}

template <typename C>
void forward_with(const NormForwardParams& p, const RowKernels& k) {
  ScratchLease<C, kWeightSlot> weight_scratch;
  ScratchLease<C, kBiasSlot> bias_scratch;
  const C* weight = param_as(p.weight, p.weight_type, p.cols, weight_scratch, p.weight_offset);
  const C* bias = param_as(p.bias, p.weight_type, p.cols, bias_scratch);
  const Dtype src = to_dtype(p.residual != nullptr ? p.h_type : p.input_type);
  const ForwardRowsFn rows_fn = k.forward_rows(src, to_dtype(p.input_type));
  TORCH_CHECK(rows_fn != nullptr,
              message("layernorm_ext: no CPU kernel for rows of ", p.h_type, " and output ", p.input_type));
  ForwardRows a{};
  a.input = p.input;
  a.residual = p.residual;
  a.residual_out = p.residual_out;
  if (p.residual != nullptr) {
    a.add_row = k.add_row(to_dtype(p.input_type), to_dtype(p.residual_type), to_dtype(p.h_type));
    TORCH_CHECK(a.add_row != nullptr, message("layernorm_ext: no CPU kernel adding ", p.input_type, " and ",
                                              p.residual_type, " into ", p.h_type));
  }
  a.out = p.out;
  a.weight = weight;
  a.bias = bias;
  a.mean = p.mean;
  a.rstd = p.rstd;
  a.cols = p.cols;
  a.eps = p.eps;
  a.cast_before_weight = p.cast_before_weight;
  a.rms = p.rms;
  a.codes = p.codes;
  a.quant_code = quant_code(p.quant_type);
  a.scale = p.scale;
  a.scale_ub = p.scale_ub;
  a.row_scales = p.row_scales;
  a.group_size = p.group_size;
  a.mx_scales = p.mx_scales;
  a.nvfp4_scales = p.nvfp4_scales;
  a.scale_row_stride = p.scale_row_stride;
  a.scale_group_stride = p.scale_group_stride;
  a.scales_swizzled = p.scales_swizzled;
  a.row_buffer = nullptr;
  a.input_rows = p.input_rows;
  a.residual_rows = p.residual_rows;
  a.residual_out_rows = p.residual_out_rows;
  a.out_rows = p.out_rows;
  // Only into the caller's buffer: a new tensor's pages fault in on the first store, which brings each line into
  // the cache (4096x4096 float32 LayerNorm into a new tensor: 41.1 ms plain, 45.2 streamed; into out=: 9.8 and 6.7
  // ms); and not in place, where the kernel has just read the row it overwrites.
  a.stream_out = p.out_given && p.codes == nullptr && p.out != p.input &&
                 p.rows * p.cols * static_cast<int64_t>(c10::elementSize(p.input_type)) >= stream_threshold();
  if (p.plane > 0) {
    const ForwardColumnsFn columns_fn = k.forward_columns(src, to_dtype(p.input_type));
    TORCH_CHECK(columns_fn != nullptr,
                message("layernorm_ext: no CPU kernel for channels-first rows of ", p.input_type));
    const int64_t blocks = (p.plane + kColumnPixels - 1) / kColumnPixels;
    const int64_t grain = std::max<int64_t>(1, kParallelGrainElems / (kColumnPixels * p.cols));
    at::parallel_for(0, p.rows / p.plane * blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p0 = t % blocks * kColumnPixels;
        columns_fn(a, p.plane, t / blocks, p0, std::min(p.plane, p0 + kColumnPixels));
      }
    });
    return;
  }
  if (p.codes == nullptr && split_rows(p.rows, p.cols)) {
    forward_split<C>(p, k, a, src);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kParallelGrainElems / p.cols);
  if (p.codes != nullptr) {
    // Quantized output (one thread per row, even for a few long rows: the dynamic scale needs the whole row):
    // each thread normalizes a row into its own buffer of out's dtype, then encodes it.
    const int64_t row_bytes = p.cols * static_cast<int64_t>(c10::elementSize(p.input_type));
    at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
      ScratchLease<double, kQuantRowSlot> row_scratch;
      ForwardRows own = a;
      own.row_buffer = row_scratch.get((row_bytes + 7) / 8);
      rows_fn(own, begin, end);
    });
    return;
  }
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { rows_fn(a, begin, end); });
}

}  // namespace

const char* isa_name() {
  kernels();
  return active_name;
}

int64_t scratch_bytes() { return kept_scratch_bytes.load(); }

int64_t set_stream_bytes(int64_t bytes) {
  const int64_t previous = stream_threshold();
  stream_bytes.store(bytes < 0 ? -1 : bytes);
  return previous;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* isa : kIsaOrder) {
    if (cpu_has(isa)) out.emplace_back(isa);
  }
  return out;
}

std::string set_isa(const std::string& isa) {
  TORCH_CHECK(kernels_for(isa) != nullptr, message("layernorm_ext: unknown CPU instruction set '", isa,
                                                   "' (expected scalar, avx2, avx512 or avx512_bf16)"));
  TORCH_CHECK(cpu_has(isa.c_str()), message("layernorm_ext: this CPU does not support ", isa));
  const std::string previous = isa_name();
  std::lock_guard<std::mutex> lock(isa_mutex);
  activate(isa);
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

namespace {

// Columns per step of reduce_partials: a tile's double sums stay in L1 while the chunks are added into them.
constexpr int64_t kReduceTileCols = 512;

// The chunks' partials (chunks x cols of Q: double, or the row kernels' compute type where each chunk is one
// block) summed in chunk order, in double (the ISA's sum_chunks), parallel over columns, into the gradients of
// the parameters' dtype. Each sum starts as 0.0 + chunk 0, as the zeroed double partials did: the same bits.
template <typename Q>
void reduce_partials(const NormBackwardParams& p, const RowKernels& k, const Q* dweight, const Q* dbias,
                     int64_t chunks) {
  const int64_t cols = p.cols;
  const SumChunksFn sum_fn = k.sum_chunks(std::is_same_v<Q, double> ? Dtype::f64 : Dtype::f32);
  at::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
    double sum[kReduceTileCols];
    for (auto [partial, dst] : {std::pair{dweight, p.grad_weight}, std::pair{dbias, p.grad_bias}}) {
      if (partial == nullptr) continue;
      for (int64_t t0 = begin; t0 < end; t0 += kReduceTileCols) {
        const int64_t n = std::min(kReduceTileCols, end - t0);
        sum_fn(partial + t0, chunks, cols, n, sum);
        store_param(sum, dst, p.weight_type, t0, n);
      }
    }
  });
}

// The dweight / dbias partials of a backward: `chunks` rows of cols Q each (nullptr where that gradient is not
// wanted), zeroed only when asked (the row paths write each chunk's first terms); finish() sums them in chunk
// order into the gradients.
template <typename Q>
struct ParameterPartials {
  ScratchLease<Q, kDweightSlot> dweight_scratch;
  ScratchLease<Q, kDbiasSlot> dbias_scratch;
  Q* dweight;
  Q* dbias;
  int64_t chunks;

  ParameterPartials(const NormBackwardParams& p, int64_t chunk_count, bool zeroed)
      : dweight(p.grad_weight != nullptr ? get(dweight_scratch, chunk_count * p.cols, zeroed) : nullptr),
        dbias(p.grad_bias != nullptr ? get(dbias_scratch, chunk_count * p.cols, zeroed) : nullptr),
        chunks(chunk_count) {}

  template <typename Lease>
  static Q* get(Lease& lease, int64_t n, bool zeroed) {
    return zeroed ? lease.zeroed(n) : lease.get(n);
  }
  Q* dweight_of(int64_t chunk, int64_t cols) const { return dweight != nullptr ? dweight + chunk * cols : nullptr; }
  Q* dbias_of(int64_t chunk, int64_t cols) const { return dbias != nullptr ? dbias + chunk * cols : nullptr; }

  void finish(const NormBackwardParams& p, const RowKernels& k) const { reduce_partials(p, k, dweight, dbias, chunks); }
};

// Channels-first rows: tasks of kColumnPixels pixels of one image, in at most kMaxChunks chunks of consecutive
// tasks (shape only), each chunk's terms into its own double partial.
void backward_columns_with(const NormBackwardParams& p, const RowKernels& k, const BackwardRows& a) {
  const BackwardColumnsFn columns_fn = k.backward_columns(to_dtype(p.saved_type), to_dtype(p.out_type));
  TORCH_CHECK(columns_fn != nullptr, message("layernorm_ext: no CPU backward kernel for channels-first ", p.saved_type,
                                             " rows and ", p.out_type, " gradients"));
  const int64_t cols = p.cols;
  const int64_t blocks = (p.plane + kColumnPixels - 1) / kColumnPixels;
  const int64_t tasks = p.rows / p.plane * blocks;
  const int64_t chunk_tasks = (tasks + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (tasks + chunk_tasks - 1) / chunk_tasks;
  const ParameterPartials<double> partials(p, chunks, /*zeroed=*/true);  // the column kernels add into them
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    ScratchLease<double, kLaneSlot> lane_scratch;
    void* lanes = lane_scratch.get((cols * kColumnScratchBytes + 64) / static_cast<int64_t>(sizeof(double)) + 1);
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      double* dweight = partials.dweight_of(c, cols);
      double* dbias = partials.dbias_of(c, cols);
      for (int64_t t = c * chunk_tasks; t < std::min(tasks, (c + 1) * chunk_tasks); ++t) {
        const int64_t p0 = t % blocks * kColumnPixels;
        columns_fn(a, p.plane, t / blocks, p0, std::min(p.plane, p0 + kColumnPixels), lanes, dweight, dbias);
      }
    }
  });
  partials.finish(p, k);
}

// Columns [c0, c1) of a block partial widened into a chunk's double partial: stored for the chunk's first
// block (its partial holds nothing yet), added for the others.
template <typename P>
void widen_into(double* chunk_partial, const P* block, int64_t c0, int64_t c1, bool first) {
  if (first) {
    for (int64_t j = c0; j < c1; ++j) chunk_partial[j] = static_cast<double>(block[j]);
  } else {
    for (int64_t j = c0; j < c1; ++j) chunk_partial[j] += static_cast<double>(block[j]);
  }
}

// dweight / dbias: each block of <= kBlockRows rows sums its terms into a block partial of P (the row kernels'
// compute type; they overwrite it, so nothing is zeroed), which is added into its chunk's double partial row; then
// the chunks are summed in order, in double, parallel over columns. Where every chunk is one block, the chunks' P
// partials are the block partials (no double partial: 0.0 + the block in double is the block).
template <typename P>
void backward_with(const NormBackwardParams& p, const RowKernels& k, const BackwardRows& a) {
  const int64_t rows = p.rows;
  const int64_t cols = p.cols;
  const Dtype saved = to_dtype(p.saved_type), grad = to_dtype(p.out_type);
  const int64_t chunks_wanted =
      std::clamp<int64_t>(std::min({kMaxChunks, rows / kMinChunkRows, kMaxPartialElems / cols}), 1, rows);
  const int64_t chunk_rows = (rows + chunks_wanted - 1) / chunks_wanted;
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;

  if (split_backward(rows, cols, chunks)) {
    // Each row's column ranges in parallel, rows in blocks whose x and dy fit in about a quarter of L2
    // (kRowGroupBytes), two parallel passes per block: the three sums of every (row, range), added per row in a
    // fixed order; then dx and the dweight / dbias terms, parallel over ranges, each range taking the rows in
    // order into its columns of the block partial and the chunk's double partial. (Both passes over all rows at
    // once read every row twice from beyond L2: 4 x 65536 float32, 1 thread, 0.65x ATen.)
    const ParameterPartials<double> partials(p, chunks, /*zeroed=*/false);
    const BackwardSegmentSumsFn sums_fn = k.backward_segment_sums(saved, grad);
    const BackwardSegmentApplyFn apply_fn = k.backward_segment_apply(saved, grad);
    const int64_t ranges = (cols + kSegmentCols - 1) / kSegmentCols;
    const int64_t row_bytes =
        cols * static_cast<int64_t>(c10::elementSize(p.saved_type) + c10::elementSize(p.out_type));
    const int64_t block_rows = std::max<int64_t>(1, kRowGroupBytes / row_bytes);
    std::vector<double> range_sums(3 * block_rows * ranges);
    std::vector<std::array<double, 3>> row_sums(block_rows);
    ScratchLease<P, kBlockDweightSlot> block_dweight;
    ScratchLease<P, kBlockDbiasSlot> block_dbias;
    P* bw = partials.dweight != nullptr ? block_dweight.zeroed(cols) : nullptr;
    P* bb = partials.dbias != nullptr ? block_dbias.zeroed(cols) : nullptr;
    for (int64_t first = 0; first < rows; first += block_rows) {
      const int64_t count = std::min(block_rows, rows - first);
      at::parallel_for(0, count * ranges, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t c0 = (t % ranges) * kSegmentCols;
          sums_fn(a, first + t / ranges, c0, std::min(cols, c0 + kSegmentCols), &range_sums[3 * t]);
        }
      });
      for (int64_t i = 0; i < count; ++i) row_sums[i] = pairwise_total<3>(range_sums, i * ranges, (i + 1) * ranges);
      for_each_range(cols, [&](int64_t, int64_t c0, int64_t c1) {
        for (int64_t row = first; row < first + count; ++row) {
          apply_fn(a, row, c0, c1, row_sums[row - first].data(), bw, bb);
          // The block partial holds up to kBlockRows rows of a chunk, as the rows path's (widened after each row,
          // it moved more bytes than the rows themselves).
          const int64_t chunk = row / chunk_rows, in_chunk = row % chunk_rows;
          if (row + 1 < rows && in_chunk + 1 < chunk_rows && (in_chunk + 1) % kBlockRows != 0) continue;
          for (auto [block, chunk_partial] :
               {std::pair{bw, partials.dweight_of(chunk, cols)}, std::pair{bb, partials.dbias_of(chunk, cols)}}) {
            if (block == nullptr) continue;
            widen_into(chunk_partial, block, c0, c1, in_chunk < kBlockRows);
            std::fill(block + c0, block + c1, P(0));  // apply_fn adds into it
          }
        }
      });
    }
    partials.finish(p, k);
    return;
  }

  const BackwardRowsFn rows_fn = k.backward_rows(saved, grad);
  if (chunk_rows <= kBlockRows) {
    const ParameterPartials<P> partials(p, chunks, /*zeroed=*/false);
    at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        rows_fn(a, c * chunk_rows, std::min(rows, (c + 1) * chunk_rows), partials.dweight_of(c, cols),
                partials.dbias_of(c, cols), /*overwrite=*/true);
      }
    });
    partials.finish(p, k);
    return;
  }

  const ParameterPartials<double> partials(p, chunks, /*zeroed=*/false);
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    ScratchLease<P, kBlockDweightSlot> block_dweight;
    ScratchLease<P, kBlockDbiasSlot> block_dbias;
    P* bw = partials.dweight != nullptr ? block_dweight.get(cols) : nullptr;
    P* bb = partials.dbias != nullptr ? block_dbias.get(cols) : nullptr;
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t end = std::min(rows, (c + 1) * chunk_rows);
      for (int64_t r0 = c * chunk_rows; r0 < end; r0 += kBlockRows) {
        rows_fn(a, r0, std::min(end, r0 + kBlockRows), bw, bb, /*overwrite=*/true);
        const bool first = r0 == c * chunk_rows;
        if (bw != nullptr) widen_into(partials.dweight_of(c, cols), bw, 0, cols, first);
        if (bb != nullptr) widen_into(partials.dbias_of(c, cols), bb, 0, cols, first);
      }
    }
  });
  partials.finish(p, k);
}

}  // namespace

void backward(const NormBackwardParams& p) {
  const RowKernels& k = kernels();
  TORCH_CHECK(
      k.backward_rows(to_dtype(p.saved_type), to_dtype(p.out_type)) != nullptr,
      message("layernorm_ext: no CPU backward kernel for ", p.saved_type, " rows and ", p.out_type, " gradients"));
  const bool float_math = backward_computes_in_float(p.saved_type == ScalarType::Double,
                                                     p.out_type == ScalarType::Double, p.cols);
  ScratchLease<float, kWeightSlot> weight_f_scratch;
  ScratchLease<float, kBiasSlot> bias_f_scratch;
  ScratchLease<double, kWeightSlot> weight_scratch;
  ScratchLease<double, kBiasSlot> bias_scratch;
  BackwardRows a{};
  a.grad_out = p.grad_out;
  a.grad_residual_out = p.grad_residual_out;
  a.saved = p.saved;
  a.mean = p.mean;
  a.rstd = p.rstd;
  if (float_math) {
    a.weight_f = param_as(p.weight, p.weight_type, p.cols, weight_f_scratch, p.weight_offset);
    a.bias_f = param_as(p.bias, p.weight_type, p.cols, bias_f_scratch);
  } else {
    a.weight = param_as(p.weight, p.weight_type, p.cols, weight_scratch, p.weight_offset);
    a.bias = param_as(p.bias, p.weight_type, p.cols, bias_scratch);
  }
  a.grad_input = p.grad_input;
  a.grad_out_rows = p.grad_out_rows;
  a.saved_rows = p.saved_rows;
  a.grad_residual_rows = p.grad_residual_rows;
  a.cols = p.cols;
  a.rms = p.rms;
  a.saved_is_output = p.saved_is_output;
  a.stats_double = p.acc_type == ScalarType::Double;
  if (p.plane > 0) {
    backward_columns_with(p, k, a);
  } else if (float_math) {
    backward_with<float>(p, k, a);
  } else {
    backward_with<double>(p, k, a);
  }
}

}  // namespace cpu
}  // namespace layernorm_ext
