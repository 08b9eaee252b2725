// The CUDA kernel family of layernorm_ext: one templated forward and one templated backward serve LayerNorm
// and RMSNorm (template flag kRms), every dtype combination and the fused residual add (a runtime pointer).
// Instantiated by launch_{f32,f64,f16,bf16}.cu, one file per input dtype so that the builds run in parallel.
//
// Mapping, chosen on the host by plan_rows() from the row length in vectors ("units": 16-byte packs when every
// pointer is aligned and cols is a multiple of the pack width, single elements otherwise):
//   - short rows (<= 32 threads x 4 packs): a sub-warp of 4/8/16 lanes or a warp per row, several rows per
//     block of 128 threads, the row held in registers;
//   - medium rows: one block of 64..512 threads per row (a multiple of 32), the row held in registers;
//   - long rows (beyond the registers of 512 threads): one block per row; the forward stages the row in
//     shared memory when it fits, else reads it twice (the second read mostly from L2); the backward, on sm_90,
//     holds the row in the registers of a thread-block cluster of 2-16 blocks (backward_cluster_kernel), and
//     beyond that takes two kernels: a block per row for the row sums, then blocks of (column slice, row group)
//     for dx, keeping dweight / dbias in registers (backward_kernels.cuh).
// Statistics: rows in registers take two passes over them (LayerNorm: the sum for a shift, the rounded mean;
// then the sums of h - shift and of its square; RMSNorm: the sum of squares). Each thread adds its own
// values in the compute type; the threads' sums are added in double over __shfl_xor_sync butterflies, always
// lower lane first so every lane gets the same bits; a row of several warps then takes one shared-memory round
// (one barrier per row): the forward merges the warps' moments, the backward adds the warps' sums with
// butterflies over their lanes (row_allreduce_one_barrier), a fixed order.
// Long rows merge per-thread Welford states (count, mean, M2) in double with Chan's formula. rstd is rounded
// once from a double variance. The backward corrects xhat for the stored mean's rounding (delta = mean(d)).
//
// The kernels are in forward_kernels.cuh and backward_kernels.cuh, on the element types and reductions of
// kernel_common.cuh; this header, the one the launch files include, holds the host side: planning, launching
// and the dtype dispatch.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../message.h"
#include "../norm_params.h"
#include "kernel_common.cuh"
#include "launch_plan.h"
#include "forward_kernels.cuh"
#include "backward_kernels.cuh"
#include "columns_kernels.cuh"

namespace layernorm_ext {
namespace cuda {

// ---- host side: planning and launching -------------------------------------------------------------------

constexpr int kSmallRowsBlock = 128;  // block size when a (sub-)warp handles a row
constexpr int kMaxCluster = 16;       // blocks of a thread-block cluster (beyond 8: a non-portable size)

struct RowPlan {
  bool long_path = false;
  int lanes = 0;           // threads per row
  int rows_per_block = 1;  // > 1 only when lanes <= 32
  int packs = 0;           // packs per lane (register paths)
};

// Choose the register mapping for rows of `units` packs, with min_packs to max_packs packs per lane (min_packs
// at most 4); a long path when even kMaxRowThreads lanes cannot hold the row.
inline RowPlan plan_rows(int64_t units, int max_packs, int min_packs = 1) {
  RowPlan plan;
  const int small_packs = std::min(max_packs, 4);
  if (units <= 32 * small_packs) {
    int lanes = 4;
    while (lanes < 32 && static_cast<int64_t>(lanes) * small_packs < units) lanes *= 2;
    int packs = min_packs;
    while (static_cast<int64_t>(packs) * lanes < units) packs *= 2;
    plan.lanes = lanes;
    plan.packs = packs;
    plan.rows_per_block = kSmallRowsBlock / lanes;
    return plan;
  }
  int64_t best_waste = -1;
  for (int packs : {4, 2, 8, 1}) {  // ties go to the earlier entry: 4 packs balance registers and lanes
    if (packs > max_packs || packs < min_packs) continue;
    const int64_t lanes = (units + packs - 1) / packs;
    const int64_t lanes_rounded = (lanes + 31) / 32 * 32;
    if (lanes_rounded > kMaxRowThreads) continue;
    const int64_t waste = lanes_rounded * packs - units;
    if (best_waste < 0 || waste < best_waste) {
      best_waste = waste;
      plan.lanes = static_cast<int>(lanes_rounded);
      plan.packs = packs;
    }
  }
  if (best_waste < 0) plan.long_path = true;
  return plan;
}

// float64 rows for a narrower input (or grad_out): only a float64 residual makes them. They take one variant,
// single elements and one pack per lane (rows beyond 512 elements on the long kernels): with all their vectorized
// and multi-pack variants this combination was a quarter of the build's code (sm_90 SASS: 14 of 55 MB, 10 of them
// quantized), for a speed that matters to no model.
template <typename Tin, typename Th>
constexpr bool kWidenedRows = std::is_same_v<Th, double> && !std::is_same_v<Tin, double>;

// Packs per lane a kernel may hold: the forward keeps one row (<= 32 values per lane), the backward three
// rows and two partial rows (<= 16 values per lane); half that in double. Unaligned rows (kVec = 1) use
// at most 4 packs; widened rows one.
template <typename Tin, typename Th, int kVec>
constexpr int max_packs(bool backward) {
  using A = acc_t<Th>;
  if (kWidenedRows<Tin, Th>) return 1;
  constexpr bool kDouble = std::is_same_v<A, double>;
  const int values = backward ? (kDouble ? 8 : 16) : (kDouble ? 16 : 32);
  const int packs = values / kVec;
  const int cap = kVec == 1 ? 4 : 8;  // element-wise accesses: 8 separate 64-bit addresses per array spill
  return packs < cap ? packs : cap;
}

// The fewest packs per lane of the forward's register path: 4 (max_packs where that is fewer: widened rows), so
// that its variants are 4 and 8 packs where the plain and quantized kernels had 1, 2, 4, 8 (the quantized one
// takes the plain one's mapping, for the plain output's bits). Those were 29% of the bf16 file's compile time
// (nvcc sm_90: 251 -> 177 CPU seconds). Every audited size took 4 or 8 already; bf16 rows of 1536, 2560 or 3584
// elements (2 packs before) now leave 25, 17 or 12% of their lanes' slots idle, and rows of 64 bf16 elements or
// fewer more.
template <typename Tin, typename Th, int kVec>
constexpr int min_forward_packs() {
  constexpr int kMax = max_packs<Tin, Th, kVec>(false);
  return kMax < 4 ? kMax : 4;
}

// Packs per lane of the backward on a cluster: half the register path's where it holds 4 or more (float rows and
// single elements), so that the cluster's all-reduce does not spill (ptxas sm_90, LayerNorm float rows at 4 packs:
// 8 bytes).
template <typename Tg, typename Ts, int kVec>
constexpr int cluster_packs() {
  constexpr int kMax = max_packs<Tg, Ts, kVec>(true);
  return kMax >= 4 ? kMax / 2 : kMax;
}

inline bool aligned(const void* p, size_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// A layout in elements as one in units of kVec elements (every row then starts on a unit), where its strides are
// whole units.
template <int kVec>
bool whole_units(const RowLayout& layout) {
  return layout.outer_stride % kVec == 0 && (layout.inner == 1 || layout.inner_stride % kVec == 0);
}
template <int kVec>
RowLayout in_units(const RowLayout& layout) {
  return RowLayout{layout.inner, layout.inner_stride / kVec, layout.outer_stride / kVec};
}

inline int device_attribute(cudaDeviceAttr attr) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

inline int64_t grid_for(int64_t groups) { return std::max<int64_t>(1, std::min<int64_t>(groups, 1 << 30)); }

// Calls f(packs as a type) for the plan's packs per lane, the kernels' counts being the powers of two from
// kMinPacks to kMaxPacks.
template <int kMaxPacks, int kMinPacks = 1, typename F>
void with_packs(int packs, F&& f) {
  auto call = [&](auto count) {
    constexpr int kCount = decltype(count)::value;
    if constexpr (kCount >= kMinPacks && kCount <= kMaxPacks) {
      if (packs != kCount) return false;
      f(count);
      return true;
    } else {
      return false;
    }
  };
  const bool called = call(std::integral_constant<int, 1>{}) || call(std::integral_constant<int, 2>{}) ||
                      call(std::integral_constant<int, 4>{}) || call(std::integral_constant<int, 8>{});
  TORCH_INTERNAL_ASSERT(called, message("layernorm_ext: no kernel for ", packs, " packs per lane"));
}

// The current device's limits, asked only when a plan needs them.
inline DeviceLimits current_device_limits() {
  DeviceLimits device;
  device.max_shared_per_block = [] {
    return static_cast<int64_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
  };
  device.resident_blocks = [](const void* kernel, int threads, size_t shared_bytes) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes));
    return static_cast<int64_t>(std::max(per_sm, 1)) * device_attribute(cudaDevAttrMultiProcessorCount);
  };
  device.has_clusters = [](const void* kernel) {
    if (device_attribute(cudaDevAttrComputeCapabilityMajor) < 9) return false;
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    return attributes.binaryVersion >= 90;  // the code that runs has the cluster barriers (LNX_CLUSTERS)
  };
  device.resident_clusters = [](const void* kernel, int threads, size_t shared_bytes, int cluster) {
    const ClusterLaunch launch(kernel, static_cast<unsigned>(cluster), static_cast<unsigned>(threads), shared_bytes,
                               nullptr, static_cast<unsigned>(cluster));
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config));
    return static_cast<int64_t>(clusters);
  };
  return device;
}

// ---- kernel names, as the demangled symbols spell them (the audit finds a plan's kernel in the SASS) ------

template <typename T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, __half>) return "__half";
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return "__nv_bfloat16";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else return "float";
}

// residual: the register paths' compile-time residual flag (forward: residual; backward: grad_residual_out);
// the plan names the variant without a residual, but for forward rows wider than the input (only a residual makes
// them).
template <typename... T>
std::string kernel_name(const char* function, bool rms, int vec, int packs, bool quant, bool residual = false) {
  std::string name = std::string(function) + "<";
  for (const char* type : {type_name<T>()...}) name += std::string(type) + ", ";
  name += std::string(rms ? "true" : "false") + ", " + std::to_string(vec);
  if (packs > 0) name += ", " + std::to_string(packs);
  if (std::string(function) == "forward_rows_kernel" || std::string(function) == "backward_rows_kernel" ||
      std::string(function) == "backward_cluster_kernel" || std::string(function) == "backward_long_kernel") {
    name += residual ? ", true" : ", false";
  }
  if (quant) name += ", layernorm_ext::cuda::QuantArgs";  // the per-token variant (a scale per row)
  // The forward register path's variants with a residual and its per-token quantized one take the rows' layouts.
  if ((quant || residual) && std::string(function) == "forward_rows_kernel") {
    name += ", layernorm_ext::cuda::StridedRows";
  }
  return name + ">";
}

// Whether per-group quantized rows of Th in packs of kVec have a register variant: packed rows no wider than float,
// what models quantize per group (fp8 groups, MX, NVFP4). Single elements (misaligned or odd rows) and float64
// rows take the long kernel instead: their 50 of the 82 per-group register variants cost the build (CI's, on 2
// cores) compile time that no model's call needs.
template <typename Th, int kVec>
constexpr bool kGroupRows = kVec > 1 && !std::is_same_v<Th, double>;

// groups: a quantized output with a scale per group (the long kernel where kGroupRows has no register variant).
template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, bool kQuant>
LaunchPlan plan_forward_vec(int64_t rows, int64_t cols, const DeviceLimits& device, bool groups = false) {
  using A = acc_t<Th>;
  constexpr int kMax = max_packs<Tin, Th, kVec>(false);
  const RowPlan rows_plan = plan_rows(cols / kVec, kMax, min_forward_packs<Tin, Th, kVec>());
  LaunchPlan plan;
  plan.vec = kVec;
  if (!rows_plan.long_path && !(kQuant && groups && !kGroupRows<Th, kVec>)) {
    plan.lanes = rows_plan.lanes;
    plan.rows_per_block = rows_plan.rows_per_block;
    plan.packs = rows_plan.packs;
    plan.threads = plan.lanes * plan.rows_per_block;
    plan.row_groups = (rows + plan.rows_per_block - 1) / plan.rows_per_block;
    plan.grid = grid_for(plan.row_groups);
    plan.kernel = kernel_name<Tin, Th, Tw>("forward_rows_kernel", kRms, kVec, plan.packs, kQuant,
                                           !std::is_same_v<Th, Tin>);
  } else {
    // The stage holds the row in its own dtype Th (a block's share of it on a cluster: kMaxRowThreads slots per
    // kMaxRowThreads x cluster packs of the row), beside the kernel's warps' states and static shared memory.
    const int64_t budget = device.max_shared_per_block() - static_cast<int64_t>(kLongStaticShared + kLongScratchBytes);
    const int64_t units = cols / kVec;
    auto stage_bytes = [&](int cluster) {
      const int64_t row_threads = static_cast<int64_t>(kMaxRowThreads) * cluster;
      return (units + row_threads - 1) / row_threads * kMaxRowThreads * static_cast<int64_t>(kVec * sizeof(Th));
    };
    // Every thread's chunks of kLongChunk packs whole (the kernel's whole_chunks).
    auto whole_chunks = [&](int cluster) {
      return units % (static_cast<int64_t>(kLongChunk) * kMaxRowThreads * cluster) == 0;
    };
    // A row that one block cannot stage goes to the fewest blocks of a cluster (2 to kMaxCluster) that can: each
    // input element is then read from DRAM once. sm_90 only; not for float64 rows (their Welford all-reduce).
    // The quantized output takes the same mapping as the plain one (its codes are those of the plain output).
    int cluster = 1;
    if (stage_bytes(1) > budget && !std::is_same_v<A, double> &&
        device.has_clusters(reinterpret_cast<const void*>(forward_long_kernel<Tin, Th, Tw, kRms, kVec>))) {
      int fits = 2;
      while (fits <= kMaxCluster && stage_bytes(fits) > budget) ++fits;
      if (fits <= kMaxCluster) {
        cluster = fits;
        // Where the kernel has a body for whole chunks, the fewest blocks that make them whole, if any do (bf16
        // RMSNorm of 2^18 on sm_90: 4 blocks where 3 can stage it, 14.8 -> 11.6 instructions per element). The
        // quantized output plans alike: its codes come of the same statistics.
        if constexpr (kLongWholeBody<Tin, Th, Tw, kRms>) {
          int whole = fits;
          while (whole <= kMaxCluster && !whole_chunks(whole)) ++whole;
          if (whole <= kMaxCluster) cluster = whole;
        }
      }
    }
    plan.cluster = cluster;
    plan.lanes = kMaxRowThreads * cluster;
    plan.threads = kMaxRowThreads;
    plan.staged = stage_bytes(cluster) <= budget;
    plan.whole_chunks = whole_chunks(cluster);
    plan.dynamic_shared = kLongScratchBytes + (plan.staged ? static_cast<size_t>(stage_bytes(cluster)) : 0);
    plan.row_groups = rows;
    plan.grid = grid_for(rows * cluster) / cluster * cluster;  // whole clusters
    plan.kernel = kernel_name<Tin, Th, Tw>("forward_long_kernel", kRms, kVec, 0, kQuant);
  }
  return plan;
}

// A call's kernel arguments in units of kVec elements (the mapping's fields, lanes and rows_per_block, left to
// the launcher).
template <typename A>
ForwardArgs<A> forward_args(const NormForwardParams& p, int vec) {
  ForwardArgs<A> a{};
  a.input = p.input;
  a.residual = p.residual;
  a.weight = p.weight;
  a.bias = p.bias;
  a.out = p.out;
  a.residual_out = p.residual_out;
  a.mean = static_cast<A*>(p.mean);
  a.rstd = static_cast<A*>(p.rstd);
  a.rows = p.rows;
  a.cols = p.cols;
  a.units = p.cols / vec;
  a.inv_cols = 1.0 / static_cast<double>(p.cols);
  a.eps = p.eps;
  a.weight_offset = static_cast<A>(p.weight_offset);
  a.cast_before_weight = p.cast_before_weight;
  a.residual_type = p.residual_type;
  return a;
}

template <typename A>
BackwardArgs<A> backward_args(const NormBackwardParams& p, int vec) {
  BackwardArgs<A> a{};
  a.grad_out = p.grad_out;
  a.grad_residual_out = p.grad_residual_out;
  a.saved = p.saved;
  a.mean = static_cast<const A*>(p.mean);
  a.rstd = static_cast<const A*>(p.rstd);
  a.weight = p.weight;
  a.bias = p.bias;
  a.grad_input = p.grad_input;
  a.rows = p.rows;
  a.cols = p.cols;
  a.units = p.cols / vec;
  a.inv_cols = 1.0 / static_cast<double>(p.cols);
  a.weight_offset = static_cast<A>(p.weight_offset);
  a.saved_is_output = p.saved_is_output;
  return a;
}

// dweight / dbias from the [parts, cols] partial buffers a backward kernel wrote (those not wanted are nullptr),
// summed in a fixed order by reduce_partials_kernel.
template <typename Tw, typename A>
void reduce_partials(const BackwardArgs<A>& a, const NormBackwardParams& p, int64_t parts, cudaStream_t stream) {
  const dim3 reduce_block(kReduceColumns, kReduceSlices);
  const unsigned reduce_grid = static_cast<unsigned>((p.cols + kReduceColumns - 1) / kReduceColumns);
  auto reduce = reduce_partials_kernel<Tw, A>;
  if (a.partial_dweight != nullptr) {
    LNX_LAUNCH(reduce, reduce_grid, reduce_block, 0, stream)(a.partial_dweight, p.grad_weight, parts, p.cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (a.partial_dbias != nullptr) {
    LNX_LAUNCH(reduce, reduce_grid, reduce_block, 0, stream)(a.partial_dbias, p.grad_bias, parts, p.cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Whether the register path's variant without a residual (forward; backward: without grad_residual_out) has a
// strided twin (forward_kernels.cuh, StridedRows): where the rows' dtype is the input's (always, but for the float64
// rows of a narrower input that only a residual makes), so that the build (CI's, on 2 cores) stays near its size:
// the twins took it from 902 to 1133 s before that bound. The variants with a residual and the per-token quantized
// one always take strided rows; the per-group quantized one never does.
template <typename Tin, typename Th>
constexpr bool kStridedTwin = std::is_same_v<Th, Tin>;

// An operand's rows' layout in units for the kernels; packed (cols elements apart) where the operand is absent.
template <int kVec>
RowLayout layout_in_units(const void* rows, const RowLayout& layout, int64_t cols) {
  return in_units<kVec>(rows != nullptr ? layout : RowLayout::packed(cols));
}

// The layouts of a plain forward's operands, in units.
template <int kVec>
StridedRows strided_rows(const NormForwardParams& p) {
  return StridedRows{layout_in_units<kVec>(p.input, p.input_rows, p.cols),
                     layout_in_units<kVec>(p.residual, p.residual_rows, p.cols), in_units<kVec>(p.out_rows),
                     layout_in_units<kVec>(p.residual_out, p.residual_out_rows, p.cols)};
}

// Whether the kernels' 32-bit row offsets (RowLayout::offset32) reach every operand's rows.
inline bool rows_fit_offset32(const NormForwardParams& p) {
  return p.input_rows.fits_offset32(p.rows) && p.out_rows.fits_offset32(p.rows) &&
         (p.residual == nullptr || p.residual_rows.fits_offset32(p.rows)) &&
         (p.residual_out == nullptr || p.residual_out_rows.fits_offset32(p.rows));
}

// Whether every operand's rows' strides are whole packs of kVec elements (the kernels then index them in units).
template <int kVec>
bool rows_in_whole_units(const NormForwardParams& p) {
  const StridedRows elements = strided_rows<1>(p);
  return whole_units<kVec>(elements.input) && whole_units<kVec>(elements.residual) &&
         whole_units<kVec>(elements.out) && whole_units<kVec>(elements.residual_out);
}

// Returns false, launching nothing, for strided rows (p's layouts not all packed: the caller copies them) that the
// register path does not take: rows beyond its registers (per-group quantized rows without a register variant
// included, kGroupRows), or no variant for them (kStridedTwin).
template <typename Tin, typename Th, typename Tw, bool kRms, int kVec, bool kQuant>
bool launch_forward_vec(const NormForwardParams& p, bool strided, cudaStream_t stream) {
  using A = acc_t<Th>;
  const bool has_twin = kQuant || p.residual != nullptr || kStridedTwin<Tin, Th>;
  if (strided && !has_twin) return false;
  if (strided && !rows_fit_offset32(p)) return false;
  ForwardArgs<A> a = forward_args<A>(p, kVec);
  QuantArgs q{p.codes, p.scale, p.scale_ub, p.row_scales, quant_code(p.quant_type)};
  if (p.group_size > 0) {
    const int64_t group_units = p.group_size / kVec;
    // A group's lanes all in one block (group_absmax), the long path's blocks being kMaxRowThreads.
    TORCH_CHECK_NOT_IMPLEMENTED(
        p.group_size % kVec == 0 && group_units <= kMaxRowThreads && (group_units & (group_units - 1)) == 0,
        message(
            "layernorm_ext: per-group and block scales on CUDA need a group_size that is a power of two and at most ",
            kMaxRowThreads, " times the elements of the kernel's vector (", kVec, " here: ", 16 / sizeof(Tin), " for ",
            sizeof(Tin),
            "-byte elements when the tensors are 16-byte aligned, else 1; 1 for float64 rows of a narrower ",
            "input), but got group_size=", p.group_size));
    q.group_units = static_cast<int>(group_units);
    q.groups = p.cols / p.group_size;
    q.block_scales = p.nvfp4_scales != nullptr ? p.nvfp4_scales : p.mx_scales;
    q.scale_row_stride = p.scale_row_stride;
    q.scale_group_stride = p.scale_group_stride;
    q.swizzled = p.scales_swizzled;
  }
  TORCH_INTERNAL_ASSERT(p.residual == nullptr || residual_fits<Th>(p.residual_type),
                        "layernorm_ext: a residual dtype that does not promote to the rows' dtype");
  constexpr int kMax = max_packs<Tin, Th, kVec>(false);
  const LaunchPlan plan =
      plan_forward_vec<Tin, Th, Tw, kRms, kVec, kQuant>(p.rows, p.cols, current_device_limits(), q.group_units > 0);
  if (strided && plan.packs == 0) return false;
  a.lanes = plan.lanes;
  a.rows_per_block = plan.rows_per_block;
  const unsigned grid = static_cast<unsigned>(plan.grid);
  if (plan.packs > 0) {
    auto launch_rows = [&](auto packs, auto residual) {
      constexpr int kPacks = decltype(packs)::value;
      constexpr bool kResidual = decltype(residual)::value;
      if constexpr (kQuant) {
        if (q.group_units > 0) {
          if constexpr (kGroupRows<Th, kVec>) {
            StridedRows rows = strided_rows<kVec>(p);
            // NVFP4's codes, two a byte: its rows' layout counts bytes, the kernel packs of kVec / 2 of them.
            if (p.quant_type == ScalarType::Float4_e2m1fn_x2) rows.out = in_units<kVec / 2>(p.out_rows);
            auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, kPacks, kResidual, GroupQuantArgs, StridedRows>;
            LNX_LAUNCH(kernel, grid, plan.threads, 0, stream)(a, GroupQuantArgs{q}, rows);
          } else {
            TORCH_INTERNAL_ASSERT(false, "layernorm_ext: per-group rows without a register variant planned on it");
          }
        } else {
          auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, kPacks, kResidual, QuantArgs, StridedRows>;
          LNX_LAUNCH(kernel, grid, plan.threads, 0, stream)(a, q, strided_rows<kVec>(p));
        }
      } else if constexpr (kResidual) {
        auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, kPacks, true, StridedRows>;
        LNX_LAUNCH(kernel, grid, plan.threads, 0, stream)(a, strided_rows<kVec>(p));
      } else if (strided) {
        if constexpr (kStridedTwin<Tin, Th>) {
          auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, kPacks, false, StridedRows>;
          LNX_LAUNCH(kernel, grid, plan.threads, 0, stream)(a, strided_rows<kVec>(p));
        }
      } else {
        auto kernel = forward_rows_kernel<Tin, Th, Tw, kRms, kVec, kPacks, kResidual>;
        LNX_LAUNCH(kernel, grid, plan.threads, 0, stream)(a);
      }
    };
    with_packs<kMax, min_forward_packs<Tin, Th, kVec>()>(plan.packs, [&](auto packs) {
      // Rows wider than the input come of a residual only (residual_out_dtype): no variants without one (sm_90:
      // 78 kernels fewer in the build).
      if constexpr (!std::is_same_v<Th, Tin>) {
        TORCH_INTERNAL_ASSERT(p.residual != nullptr, "layernorm_ext: rows wider than the input without a residual");
        launch_rows(packs, std::true_type{});
      } else if (p.residual != nullptr) {
        launch_rows(packs, std::true_type{});
      } else {
        launch_rows(packs, std::false_type{});
      }
    });
  } else {
    auto launch = [&](auto kernel, auto... quant) {
      if (plan.staged) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(plan.dynamic_shared)));
      }
      if (plan.cluster == 1) {
        LNX_LAUNCH(kernel, grid, plan.threads, plan.dynamic_shared, stream)(a, plan.staged, plan.whole_chunks, quant...);
      } else {
        launch_on_clusters(kernel, grid, plan.threads, plan.dynamic_shared, stream, static_cast<unsigned>(plan.cluster), a,
                           plan.staged, plan.whole_chunks, quant...);
      }
    };
    if constexpr (kQuant) {
      launch(forward_long_kernel<Tin, Th, Tw, kRms, kVec, QuantArgs>, q);
    } else {
      launch(forward_long_kernel<Tin, Th, Tw, kRms, kVec>);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// Elements per 16-byte pack of T (at most 8).
template <typename T>
constexpr int pack_width() {
  return 16 / sizeof(T) < 8 ? static_cast<int>(16 / sizeof(T)) : 8;
}

// Elements per pack of the kernels for input (grad_out) Tin and rows Th: single elements for widened rows.
template <typename Tin, typename Th>
constexpr int row_pack_width() {
  return kWidenedRows<Tin, Th> ? 1 : pack_width<Tin>();
}

// Whether a tensor of element_size-byte elements can be accessed in packs of kVec elements.
template <int kVec>
bool pack_aligned(const void* p, size_t element_size) {
  return aligned(p, std::min<size_t>(16, element_size * kVec));
}

// Calls f(rms, width) with the call's kernel variant as types: RMSNorm or LayerNorm; packs of kVec elements
// when every pointer allows them, else single elements.
template <int kVec, typename F>
void with_variant(bool rms, bool vectorized, F&& f) {
  auto with_width = [&](auto rms_tag) {
    if (vectorized) f(rms_tag, std::integral_constant<int, kVec>{});
    else f(rms_tag, std::integral_constant<int, 1>{});
  };
  if (rms) with_width(std::true_type{});
  else with_width(std::false_type{});
}

template <typename Tin, typename Th, typename Tw>
bool launch_forward(const NormForwardParams& p) {
  constexpr int kVec = row_pack_width<Tin, Th>();
  const int64_t out_cols = p.quant_type == ScalarType::Float4_e2m1fn_x2 && p.codes != nullptr ? p.cols / 2 : p.cols;
  const bool strided = !p.input_rows.is_packed(p.cols) || !p.out_rows.is_packed(out_cols) ||
                       (p.residual != nullptr &&
                        (!p.residual_rows.is_packed(p.cols) || !p.residual_out_rows.is_packed(p.cols)));
  const bool vectorized = p.cols % kVec == 0 && pack_aligned<kVec>(p.input, sizeof(Tin)) &&
                          pack_aligned<kVec>(p.out, sizeof(Tin)) && pack_aligned<kVec>(p.weight, sizeof(Tw)) &&
                          pack_aligned<kVec>(p.bias, sizeof(Tw)) &&
                          pack_aligned<kVec>(p.residual, c10::elementSize(p.residual_type)) &&
                          pack_aligned<kVec>(p.residual_out, sizeof(Th)) && pack_aligned<kVec>(p.codes, 1) &&
                          p.group_size % kVec == 0 &&  // a pack in one group (of a power of two: any kVec divides it)
                          (!strided || rows_in_whole_units<kVec>(p));
  // Quantized output is a kernel variant of its own (kQuant), so that the plain kernels' registers are not
  // sized for its extra pass.
  bool launched = false;
  with_variant<kVec>(p.rms, vectorized, [&](auto rms, auto width) {
    constexpr bool kRms = decltype(rms)::value;
    constexpr int kWidth = decltype(width)::value;
    if (p.codes != nullptr) launched = launch_forward_vec<Tin, Th, Tw, kRms, kWidth, true>(p, strided, current_stream());
    else launched = launch_forward_vec<Tin, Th, Tw, kRms, kWidth, false>(p, strided, current_stream());
  });
  return launched;
}

template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec>
LaunchPlan plan_backward_vec(int64_t rows, int64_t cols, const DeviceLimits& device) {
  using A = acc_t<Ts>;
  constexpr int kMax = max_packs<Tg, Ts, kVec>(true);
  const RowPlan rows_plan = plan_rows(cols / kVec, kMax);
  LaunchPlan plan;
  plan.vec = kVec;
  plan.persistent = true;
  if (!rows_plan.long_path) {
    plan.lanes = rows_plan.lanes;
    plan.rows_per_block = rows_plan.rows_per_block;
    plan.packs = rows_plan.packs;
    plan.threads = plan.lanes * plan.rows_per_block;
    plan.dynamic_shared =
        plan.rows_per_block > 1 ? static_cast<size_t>(plan.threads) * plan.packs * kVec * sizeof(A) : 0;
    const void* kernel = nullptr;
    with_packs<kMax>(plan.packs, [&](auto packs) {
      kernel = reinterpret_cast<const void*>(backward_rows_kernel<Tg, Ts, Tw, kRms, kVec, decltype(packs)::value, false>);
    });
    plan.kernel = kernel_name<Tg, Ts, Tw>("backward_rows_kernel", kRms, kVec, plan.packs, false);
    // Persistent: as many blocks as fit on the GPU at once, no more than there are row groups.
    plan.row_groups = (rows + plan.rows_per_block - 1) / plan.rows_per_block;
    const int64_t resident = device.resident_blocks(kernel, plan.threads, plan.dynamic_shared);
    plan.grid = std::max<int64_t>(1, resident > 0 ? std::min(plan.row_groups, resident) : plan.row_groups);
    return plan;
  }
  const int64_t units = cols / kVec;
  // Long rows on sm_90: the register path on the fewest blocks of a cluster (2 to kMaxCluster) whose registers hold
  // the row, one row per cluster: dy and saved read once. Not for float64 rows (as the forward's clusters).
  if constexpr (!std::is_same_v<A, double>) {
    constexpr int kPacks = cluster_packs<Tg, Ts, kVec>();
    const void* cluster_kernel = reinterpret_cast<const void*>(backward_cluster_kernel<Tg, Ts, Tw, kRms, kVec, kPacks, false>);
    const int64_t block_units = static_cast<int64_t>(kMaxRowThreads) * kPacks;
    const int64_t cluster = (units + block_units - 1) / block_units;
    if (cluster <= kMaxCluster && device.has_clusters(cluster_kernel)) {
      plan.cluster = static_cast<int>(cluster);
      plan.packs = kPacks;
      plan.rows_per_block = 1;
      plan.threads = kMaxRowThreads;  // the kernel's constant (cluster_allreduce)
      plan.lanes = plan.threads * plan.cluster;
      plan.kernel = kernel_name<Tg, Ts, Tw>("backward_cluster_kernel", kRms, kVec, plan.packs, false);
      plan.row_groups = rows;
      plan.dynamic_shared = kClusterScratchBytes<A>;
      // Persistent clusters, but at least one per kLongGroupRows rows: a thread adds at most that many rows' terms
      // of its dweight / dbias in float (130 rows of 40000 floats on one cluster: dweight 1.5x ATen's error).
      const int64_t resident = device.resident_clusters(cluster_kernel, plan.threads, plan.dynamic_shared, plan.cluster);
      const int64_t clusters = std::max(resident > 0 ? std::min(rows, resident) : rows,
                                        (rows + kLongGroupRows - 1) / kLongGroupRows);
      plan.grid = std::max<int64_t>(1, clusters) * cluster;
      return plan;
    }
  }
  // Long rows: pass 1, a persistent block per row for the row sums; pass 2, blocks of (column slice, row group).
  const int64_t slices = (units + kLongThreads - 1) / kLongThreads;
  plan.threads = kLongThreads;
  plan.lanes = static_cast<int>(std::min<int64_t>(slices * kLongThreads, 1 << 30));  // threads per row, pass 2
  plan.kernel = kernel_name<Tg, Ts, Tw>("backward_long_kernel", kRms, kVec, 0, false, false);
  const int64_t resident = device.resident_blocks(
      reinterpret_cast<const void*>(backward_long_kernel<Tg, Ts, Tw, kRms, kVec, false>), plan.threads, 0);
  // Row groups: enough (slices x groups) blocks to fill the GPU once, and at most kLongGroupRows rows per group;
  // then the fewest groups of that size (none empty). Each group costs a [cols] partial row per buffer.
  const int64_t fill = resident > 0 ? resident / slices : 1;
  int64_t groups = std::clamp<int64_t>(std::max(fill, (rows + kLongGroupRows - 1) / kLongGroupRows), 1, rows);
  plan.group_rows = (rows + groups - 1) / groups;
  plan.row_groups = (rows + plan.group_rows - 1) / plan.group_rows;
  plan.grid = slices * plan.row_groups;
  plan.sums_kernel = kernel_name<Tg, Ts, Tw>("backward_long_sums_kernel", kRms, kVec, 0, false);
  const int64_t sums_resident = device.resident_blocks(
      reinterpret_cast<const void*>(backward_long_sums_kernel<Tg, Ts, Tw, kRms, kVec>), kLongThreads, 0);
  plan.sums_grid = std::max<int64_t>(1, sums_resident > 0 ? std::min(rows, sums_resident) : rows);
  return plan;
}

// The layouts of a backward's rows read, in units (grad_residual_out's packed where it is absent).
template <int kVec>
StridedGradRows strided_grad_rows(const NormBackwardParams& p) {
  return StridedGradRows{in_units<kVec>(p.grad_out_rows), in_units<kVec>(p.saved_rows),
                         layout_in_units<kVec>(p.grad_residual_out, p.grad_residual_rows, p.cols)};
}

// As rows_fit_offset32 and rows_in_whole_units, for a backward's rows.
inline bool grad_rows_fit_offset32(const NormBackwardParams& p) {
  return p.grad_out_rows.fits_offset32(p.rows) && p.saved_rows.fits_offset32(p.rows) &&
         (p.grad_residual_out == nullptr || p.grad_residual_rows.fits_offset32(p.rows));
}
template <int kVec>
bool grad_rows_in_whole_units(const NormBackwardParams& p) {
  const StridedGradRows elements = strided_grad_rows<1>(p);
  return whole_units<kVec>(elements.grad_out) && whole_units<kVec>(elements.saved) &&
         whole_units<kVec>(elements.grad_residual_out);
}

// Returns false, launching nothing, for strided rows that the register path does not take (rows beyond one block's
// registers, or no variant for them: kStridedTwin): the caller copies them.
template <typename Tg, typename Ts, typename Tw, bool kRms, int kVec>
bool launch_backward_vec(const NormBackwardParams& p, bool strided, cudaStream_t stream) {
  using A = acc_t<Ts>;
  BackwardArgs<A> a = backward_args<A>(p, kVec);
  constexpr int kMax = max_packs<Tg, Ts, kVec>(true);
  const LaunchPlan plan = plan_backward_vec<Tg, Ts, Tw, kRms, kVec>(p.rows, p.cols, current_device_limits());
  const bool long_path = plan.packs == 0;
  if (strided && (long_path || plan.cluster > 1 || !grad_rows_fit_offset32(p) ||
                  (p.grad_residual_out == nullptr && !kStridedTwin<Tg, Ts>))) {
    return false;
  }
  a.lanes = plan.lanes;
  a.rows_per_block = long_path ? static_cast<int>(plan.group_rows) : plan.rows_per_block;
  const int64_t grid = plan.grid;
  const int threads = plan.threads;
  const size_t smem = plan.dynamic_shared;

  // One workspace from the caching allocator on the current stream (graph-safe): the long path's row terms
  // ([rows, 4], 16-byte aligned, first), then the partial buffers, [parts, cols] each for dweight and (LayerNorm
  // with a bias) dbias: parts = grid <= the row groups (rows path), the row groups (long path). So the workspace
  // is (dweight + dbias) * parts * cols * sizeof(A) (+ 4 * rows * sizeof(A)) bytes (README, "Workspace").
  const bool want_dweight = p.grad_weight != nullptr;
  const bool want_dbias = !kRms && p.grad_bias != nullptr;
  const int64_t parts = long_path ? plan.row_groups : grid / plan.cluster;
  const size_t partial_elements = static_cast<size_t>(parts) * p.cols;
  const size_t buffers = static_cast<size_t>(want_dweight) + static_cast<size_t>(want_dbias);
  const size_t terms_elements = long_path ? 4 * static_cast<size_t>(p.rows) : 0;
  c10::DataPtr scratch;
  a.partial_dweight = nullptr;
  a.partial_dbias = nullptr;
  A* row_terms = nullptr;
  if (buffers > 0 || long_path) {
    scratch = workspace((terms_elements + buffers * partial_elements) * sizeof(A));
    A* base = static_cast<A*>(scratch.get());
    row_terms = long_path ? base : nullptr;
    A* partials = base + terms_elements;
    a.partial_dweight = want_dweight ? partials : nullptr;
    a.partial_dbias = want_dbias ? partials + (want_dweight ? partial_elements : 0) : nullptr;
  }

  if (!long_path) {
    auto launch_rows = [&](auto packs, auto residual) {
      constexpr int kPacks = decltype(packs)::value;
      constexpr bool kResidual = decltype(residual)::value;
      if (plan.cluster > 1) {
        if constexpr (kPacks == cluster_packs<Tg, Ts, kVec>() && !std::is_same_v<A, double>) {
          auto kernel = backward_cluster_kernel<Tg, Ts, Tw, kRms, kVec, kPacks, kResidual>;
          launch_on_clusters(kernel, static_cast<unsigned>(grid), static_cast<unsigned>(threads), smem, stream,
                             static_cast<unsigned>(plan.cluster), a);
        } else {
          TORCH_INTERNAL_ASSERT(false,
                                message("backward plan on clusters with ", kPacks, " packs per lane: no such kernel"));
        }
      } else if constexpr (kResidual) {
        auto kernel = backward_rows_kernel<Tg, Ts, Tw, kRms, kVec, kPacks, true, StridedGradRows>;
        LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, smem, stream)(a, strided_grad_rows<kVec>(p));
      } else if (strided) {
        if constexpr (kStridedTwin<Tg, Ts>) {
          auto kernel = backward_rows_kernel<Tg, Ts, Tw, kRms, kVec, kPacks, false, StridedGradRows>;
          LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, smem, stream)(a, strided_grad_rows<kVec>(p));
        }
      } else {
        auto kernel = backward_rows_kernel<Tg, Ts, Tw, kRms, kVec, kPacks, false>;
        LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, smem, stream)(a);
      }
    };
    with_packs<kMax>(plan.packs, [&](auto packs) {
      if (p.grad_residual_out != nullptr) launch_rows(packs, std::true_type{});
      else launch_rows(packs, std::false_type{});
    });
  } else {
    auto sums = backward_long_sums_kernel<Tg, Ts, Tw, kRms, kVec>;
    LNX_LAUNCH(sums, static_cast<unsigned>(plan.sums_grid), kLongThreads, 0, stream)(a, row_terms);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto launch_long = [&](auto residual) {
      auto kernel = backward_long_kernel<Tg, Ts, Tw, kRms, kVec, decltype(residual)::value>;
      LNX_LAUNCH(kernel, static_cast<unsigned>(grid), threads, 0, stream)(a, static_cast<const A*>(row_terms));
    };
    if (p.grad_residual_out != nullptr) launch_long(std::true_type{});
    else launch_long(std::false_type{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  reduce_partials<Tw>(a, p, parts, stream);
  return true;
}

template <typename Tg, typename Ts, typename Tw>
bool launch_backward(const NormBackwardParams& p) {
  constexpr int kVec = row_pack_width<Tg, Ts>();
  const bool strided = !p.grad_out_rows.is_packed(p.cols) || !p.saved_rows.is_packed(p.cols) ||
                       (p.grad_residual_out != nullptr && !p.grad_residual_rows.is_packed(p.cols));
  const bool vectorized = p.cols % kVec == 0 && pack_aligned<kVec>(p.grad_out, sizeof(Tg)) &&
                          pack_aligned<kVec>(p.saved, sizeof(Ts)) && pack_aligned<kVec>(p.grad_input, sizeof(Ts)) &&
                          pack_aligned<kVec>(p.grad_residual_out, sizeof(Ts)) &&
                          pack_aligned<kVec>(p.weight, sizeof(Tw)) && pack_aligned<kVec>(p.bias, sizeof(Tw)) &&
                          (!strided || grad_rows_in_whole_units<kVec>(p));
  bool launched = false;
  with_variant<kVec>(p.rms, vectorized, [&](auto rms, auto width) {
    launched = launch_backward_vec<Tg, Ts, Tw, decltype(rms)::value, decltype(width)::value>(p, strided, current_stream());
  });
  return launched;
}

// ---- channels-first rows (columns_kernels.cuh) ------------------------------------------------------------

inline ColumnRows column_rows(int64_t plane) { return {plane, (plane + 31) / 32}; }

template <typename Tin, typename Tw>
void launch_forward_columns(const NormForwardParams& p) {
  using A = acc_t<Tin>;
  TORCH_INTERNAL_ASSERT(p.residual == nullptr && p.codes == nullptr,
                        "layernorm_ext: channels-first rows with a residual or a quantized output");
  ForwardArgs<A> a = forward_args<A>(p, 1);
  a.lanes = 32;
  a.rows_per_block = 1;
  const ColumnRows c = column_rows(p.plane);
  const unsigned grid = static_cast<unsigned>(grid_for(p.rows / p.plane * c.tiles_per_image));
  auto launch = [&](auto rms) {
    auto kernel = forward_columns_kernel<Tin, Tw, decltype(rms)::value>;
    LNX_LAUNCH(kernel, grid, kColumnThreads, 0, current_stream())(a, c);
  };
  if (p.rms) launch(std::true_type{});
  else launch(std::false_type{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Tg, typename Tw>
void launch_backward_columns(const NormBackwardParams& p) {
  using A = acc_t<Tg>;
  const cudaStream_t stream = current_stream();
  BackwardArgs<A> a = backward_args<A>(p, 1);
  a.lanes = 32;
  a.rows_per_block = 1;
  const ColumnRows c = column_rows(p.plane);
  const int64_t images = p.rows / p.plane;
  // dweight / dbias: a block per channel and group of images, each thread adding about 64 terms (float sums, as
  // the long path's row groups), in a grid of at most 2^31 - 1 blocks.
  const int64_t max_groups = std::max<int64_t>(1, std::numeric_limits<int32_t>::max() / p.cols);
  int64_t per_group = std::max<int64_t>(1, 64 * kParamGradThreads / p.plane);
  per_group = std::max<int64_t>(per_group, (images + max_groups - 1) / max_groups);
  const int64_t groups = (images + per_group - 1) / per_group;
  const bool want_dweight = p.grad_weight != nullptr;
  const bool want_dbias = !p.rms && p.grad_bias != nullptr;
  const size_t buffers = static_cast<size_t>(want_dweight) + static_cast<size_t>(want_dbias);
  // One workspace (graph-safe, the current stream's): the rows' terms [rows], then [groups, cols] partials each.
  const size_t terms_bytes = buffers > 0 ? static_cast<size_t>(p.rows) * sizeof(ColumnRowTerms<A>) : 0;
  const size_t partial_elements = static_cast<size_t>(groups) * p.cols;
  c10::DataPtr scratch;
  ColumnRowTerms<A>* row_terms = nullptr;
  if (buffers > 0) {
    scratch = workspace(terms_bytes + buffers * partial_elements * sizeof(A));
    row_terms = static_cast<ColumnRowTerms<A>*>(scratch.get());
    A* partials = reinterpret_cast<A*>(static_cast<unsigned char*>(scratch.get()) + terms_bytes);
    a.partial_dweight = want_dweight ? partials : nullptr;
    a.partial_dbias = want_dbias ? partials + (want_dweight ? partial_elements : 0) : nullptr;
  }
  const unsigned grid = static_cast<unsigned>(grid_for(images * c.tiles_per_image));
  const unsigned param_grid = static_cast<unsigned>(p.cols * groups);
  auto launch = [&](auto rms) {
    constexpr bool kRms = decltype(rms)::value;
    auto kernel = backward_columns_kernel<Tg, Tg, Tw, kRms>;
    LNX_LAUNCH(kernel, grid, kColumnThreads, 0, stream)(a, c, row_terms);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (buffers > 0) {
      auto param_grads = columns_param_grads_kernel<Tg, Tg, Tw, kRms>;
      LNX_LAUNCH(param_grads, param_grid, kParamGradThreads, 0, stream)(a, c, row_terms, per_group);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  if (p.rms) launch(std::true_type{});
  else launch(std::false_type{});
  reduce_partials<Tw>(a, p, groups, stream);
}

// ---- dtype dispatch --------------------------------------------------------------------------------------

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<Th>{}, Tag<Tw>{}) for the compiled combinations with input (or grad_out) dtype Tin: the row
// dtype is Tin, float32 (for half inputs) or float64; the parameters are Tin's or float32 (for half inputs).
template <typename Tin, typename F>
void dispatch_row_and_param_types(ScalarType row_type, ScalarType param_type, F&& f) {
  constexpr bool kHalfInput = std::is_same_v<Tin, __half> || std::is_same_v<Tin, __nv_bfloat16>;
  auto with_param = [&](auto row_tag) {
    if (kHalfInput && param_type == ScalarType::Float) {
      if constexpr (kHalfInput) f(row_tag, Tag<float>{});
    } else {
      f(row_tag, Tag<Tin>{});
    }
  };
  if (row_type == ScalarType::Double) {
    with_param(Tag<double>{});
  } else if (row_type == ScalarType::Float) {
    if constexpr (!std::is_same_v<Tin, double>) with_param(Tag<float>{});
    else TORCH_INTERNAL_ASSERT(false, "layernorm_ext: float64 input with float32 rows");
  } else {
    if constexpr (kHalfInput) with_param(Tag<Tin>{});
    else TORCH_INTERNAL_ASSERT(false, "layernorm_ext: half rows for a wider input");
  }
}

// Launches p on its rows' layouts; returns false, launching nothing, where the kernels do not take them (strided
// rows beyond the register path, or with a quantized output: launch_on_rows copies them).
template <typename Tin>
bool forward_for_input(const NormForwardParams& p) {
  bool launched = false;
  dispatch_row_and_param_types<Tin>(p.h_type, p.weight_type, [&](auto h_tag, auto w_tag) {
    using Th = typename decltype(h_tag)::type;
    using Tw = typename decltype(w_tag)::type;
    if (p.plane > 0) {  // channels-first rows: never declined (they are no rows launch_on_rows could copy)
      if constexpr (std::is_same_v<Th, Tin>) launch_forward_columns<Tin, Tw>(p);
      else TORCH_INTERNAL_ASSERT(false, "layernorm_ext: channels-first rows with a residual");
      launched = true;
    } else {
      launched = launch_forward<Tin, Th, Tw>(p);
    }
  });
  return launched;
}

template <typename Tg>
bool backward_for_grad(const NormBackwardParams& p) {
  bool launched = false;
  dispatch_row_and_param_types<Tg>(p.saved_type, p.weight_type, [&](auto s_tag, auto w_tag) {
    using Ts = typename decltype(s_tag)::type;
    using Tw = typename decltype(w_tag)::type;
    if (p.plane > 0) {  // norm_ops.cpp gives channels-first rows only with grad_out in saved's dtype
      if constexpr (std::is_same_v<Ts, Tg>) launch_backward_columns<Tg, Tw>(p);
      else TORCH_INTERNAL_ASSERT(false, "layernorm_ext: channels-first rows with grad_out narrower than saved");
      launched = true;
    } else {
      launched = launch_backward<Tg, Ts, Tw>(p);
    }
  });
  return launched;
}

// The plan of a call described by `query` (launch_plan.h), through the launchers' own dispatch; the device's
// figures come from the query, so no GPU is needed.
template <typename Tin>
LaunchPlan plan_for_input(const PlanQuery& query) {
  DeviceLimits device;
  device.max_shared_per_block = [&] { return query.max_shared_per_block; };
  device.resident_blocks = [&](const void*, int, size_t) {
    return static_cast<int64_t>(query.blocks_per_sm) * query.sm_count;
  };
  device.has_clusters = [&](const void*) { return query.compute_capability >= 90; };
  device.resident_clusters = [&](const void* kernel, int threads, size_t shared_bytes, int cluster) {
    return device.resident_blocks(kernel, threads, shared_bytes) / cluster;
  };
  LaunchPlan plan;
  dispatch_row_and_param_types<Tin>(query.row_type, query.param_type, [&](auto row_tag, auto param_tag) {
    using Th = typename decltype(row_tag)::type;
    using Tw = typename decltype(param_tag)::type;
    constexpr int kVec = row_pack_width<Tin, Th>();
    // As the launchers: packs only when cols is a multiple of the pack width (and the pointers allow them).
    const bool vectorized = query.vectorized && query.cols % kVec == 0;
    with_variant<kVec>(query.rms, vectorized, [&](auto rms, auto width) {
      constexpr bool kRms = decltype(rms)::value;
      constexpr int kWidth = decltype(width)::value;
      if (query.backward) {
        plan = plan_backward_vec<Tin, Th, Tw, kRms, kWidth>(query.rows, query.cols, device);
      } else if (query.quantized) {
        plan = plan_forward_vec<Tin, Th, Tw, kRms, kWidth, true>(query.rows, query.cols, device);
      } else {
        plan = plan_forward_vec<Tin, Th, Tw, kRms, kWidth, false>(query.rows, query.cols, device);
      }
    });
  });
  return plan;
}

}  // namespace cuda
}  // namespace layernorm_ext
