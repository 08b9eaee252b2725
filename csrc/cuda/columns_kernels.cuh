// Channels-first rows on CUDA (norm_ops.cpp, column_plane; csrc/cpu/columns.h is the CPU's twin): LayerNorm2d /
// RMSNorm2d over the C of a contiguous (N, C, *spatial) tensor, read and written in place. Every operand (input,
// out; grad_out, saved, grad_input) is a dense [images][cols][plane] block: row r is pixel r % plane of image
// r / plane, its cols elements plane apart. No residual and no quantized output here (norm_ops.cpp copies those).
//
// Thread mapping (forward_columns_kernel, backward_columns_kernel): a block of kColumnWarps warps takes a tile of 32
// consecutive pixels of one image, lane l pixel l, warp w the channels w, w + kColumnWarps, ...: a load is one
// channel of 32 consecutive pixels (coalesced), and a pixel's channels are split over the warps. Each thread sums
// its channels in the compute type A; the warps' sums meet in double through shared memory, added in warp order
// (a fixed order: every thread of a pixel gets the same bits), one barrier per round. The passes after the first
// re-read the tile's channels, from L1 (32 pixels x cols: 48 KB for 768 bfloat16 channels).
// Forward: LayerNorm's sum for a shift (the mean, rounded), then the sums of d = x - shift and d^2 (the rows'
// exact centring); RMSNorm the sum of squares; rstd rounded once from a double variance (finish_stats); a float
// sum of squares that overflowed is taken again in double. Then the normalizing pass.
// Backward: each pixel's sums of g = dy * weight, g * d (and d), then dx (the rows' row_coefficients and
// grad_input_term), and the pixel's (mean, delta, xscale) in row_terms for columns_param_grads_kernel: a block per
// (channel, group of images) sums dy * xhat and dy over its pixels into [groups, cols] partials, which
// reduce_partials_kernel adds in a fixed order (deterministic dweight / dbias).
#pragma once

#include <cstdint>
#include <limits>

#include "backward_kernels.cuh"
#include "forward_kernels.cuh"
#include "kernel_common.cuh"

namespace layernorm_ext {
namespace cuda {

constexpr int kColumnWarps = 8;
constexpr int kColumnThreads = 32 * kColumnWarps;
constexpr int kParamGradThreads = 256;

// The block of channels-first rows: pixels per image, and tiles of 32 of them per image.
struct ColumnRows {
  int64_t plane;
  int64_t tiles_per_image;
};

// A tile's pixel of this lane: its row, and the index of its channel 0.
struct ColumnPixel {
  bool valid;
  int64_t row, first;
};

__device__ __forceinline__ ColumnPixel column_pixel(const ColumnRows& c, int64_t cols, int64_t tile, int lane) {
  const int64_t image = tile / c.tiles_per_image;
  const int64_t pixel = tile % c.tiles_per_image * 32 + lane;
  return {pixel < c.plane, image * c.plane + pixel, image * cols * c.plane + pixel};
}

// The sum over the block's warps of each one's value for this lane's pixel, in warp order; slots[w][lane] hold them
// (the caller's barrier before).
__device__ __forceinline__ double warps_sum(const double (&slots)[kColumnWarps][32], int lane) {
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < kColumnWarps; ++w) total += slots[w][lane];
  return total;
}

// A thread's sum of its cols / kColumnWarps channels, one after another, with Kahan's compensation: a plain float
// sum of 640 squares (5125 channels) left rstd 6.5e-7 off, and RMSNorm's grad_weight at 6.8x ATen's error (H200,
// reproduced by the emulation). Only additions: nvcc keeps their order (no fast-math).
template <typename A>
struct CompensatedSum {
  A sum = A(0), carry = A(0);
  __device__ __forceinline__ void add(A v) {
    const A y = v - carry;
    const A t = sum + y;
    carry = (t - sum) - y;
    sum = t;
  }
  // sum less the carry where the carry is finite (an infinite term leaves it NaN: then the plain sum, as before)
  __device__ __forceinline__ double value() const {
    const double c = static_cast<double>(carry);
    return c - c == 0.0 ? static_cast<double>(sum) - c : static_cast<double>(sum);
  }
};

template <typename Tin, typename Tw, bool kRms>
__global__ void __launch_bounds__(kColumnThreads) forward_columns_kernel(ForwardArgs<acc_t<Tin>> a, ColumnRows c) {
  using A = acc_t<Tin>;
  __shared__ double slots[2][kColumnWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Tin* input = static_cast<const Tin*>(a.input);
  const int64_t tiles = a.rows / c.plane * c.tiles_per_image;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const ColumnPixel px = column_pixel(c, a.cols, tile, lane);
    auto x_at = [&](int64_t channel) { return to_acc<A>(load_global(input + px.first + channel * c.plane)); };
    A shift = A(0);
    if constexpr (!kRms) {
      CompensatedSum<A> sum;
      if (px.valid) {
        for (int64_t ch = warp; ch < a.cols; ch += kColumnWarps) sum.add(x_at(ch));
      }
      slots[0][warp][lane] = sum.value();
      __syncthreads();
      shift = static_cast<A>(warps_sum(slots[0], lane) * a.inv_cols);
      __syncthreads();  // slots[0] is written again below
    }
    CompensatedSum<A> first, second;  // LayerNorm: sum(d), sum(d^2); RMSNorm: sum(x^2)
    if (px.valid) {
      for (int64_t ch = warp; ch < a.cols; ch += kColumnWarps) {
        const A d = x_at(ch) - shift;
        if constexpr (!kRms) first.add(d);
        second.add(d * d);
      }
    }
    double first_wide = first.value(), second_wide = second.value();
    if (!(second.sum <= std::numeric_limits<A>::max())) {  // float squares beyond ~1.8e19, an infinity, a NaN carry
      cold_path();
      first_wide = second_wide = 0.0;
      for (int64_t ch = warp; ch < a.cols; ch += kColumnWarps) {
        const double d = static_cast<double>(x_at(ch)) - static_cast<double>(shift);
        first_wide += d;
        second_wide += d * d;
      }
    }
    slots[0][warp][lane] = first_wide;
    slots[1][warp][lane] = second_wide;
    __syncthreads();
    const double m1 = warps_sum(slots[0], lane), m2 = warps_sum(slots[1], lane);
    const bool writer = px.valid && warp == 0;
    RowStats<A> st;
    if constexpr (kRms) {
      st = finish_stats<kRms>(a, px.row, writer, A(0), A(0), m2);
    } else {
      const A rest = static_cast<A>(m1 * a.inv_cols);  // mean(d): what the shift lacks of the mean
      st = finish_stats<kRms>(a, px.row, writer, shift, rest, ::fma(-m1, static_cast<double>(rest), m2));
    }
    if (px.valid) {
      for (int64_t ch = warp; ch < a.cols; ch += kColumnWarps) {
        const A h[1] = {x_at(ch)};
        A y[1];
        normalize_pack<Tin, Tw, kRms, A, 1>(a, h, st, load_affine<Tw, kRms, A, 1>(a, ch), a.cast_before_weight, y);
        store_global(static_cast<Tin*>(a.out) + px.first + ch * c.plane, from_acc<Tin>(y[0]));
      }
    }
    __syncthreads();  // the next tile writes the slots again
  }
}

// An element's terms (dy, d, g) at channel ch of a pixel whose channel 0 is at `first`.
template <bool kFromOutput, bool kRms, typename Tg, typename Ts, typename Tw, typename A>
__device__ __forceinline__ void column_terms(const BackwardArgs<A>& a, const ColumnRows& c, int64_t first,
                                             int64_t ch, A w_base, A mean, A& dy, A& d, A& g) {
  RawPack<Tg, 1> dy_raw[1];
  RawPack<Ts, 1> saved_raw[1];
  RawPack<Tw, 1> w_raw[1], b_raw[1];
  const bool yes[1] = {true};
  const bool has_weight[1] = {a.weight != nullptr};
  const bool has_bias[1] = {kFromOutput && !kRms && a.bias != nullptr};
  load_packs<Tg, 1, 1>(a.grad_out, first + ch * c.plane, 0, yes, dy_raw);
  load_packs<Ts, 1, 1>(a.saved, first + ch * c.plane, 0, yes, saved_raw);
  load_packs<Tw, 1, 1>(a.weight, ch, 0, has_weight, w_raw);
  load_packs<Tw, 1, 1>(a.bias, ch, 0, has_bias, b_raw);
  element_terms<kFromOutput, kRms>(dy_raw[0], saved_raw[0], w_raw[0], b_raw[0], w_base, mean, 0, dy, d, g);
}

// Per row, what columns_param_grads_kernel needs of it: xhat = ((saved - mean) - delta) * xscale.
template <typename A>
struct ColumnRowTerms {
  A mean, delta, xscale, unused;
};

template <typename Tg, typename Ts, typename Tw, bool kRms>
__global__ void __launch_bounds__(kColumnThreads)
    backward_columns_kernel(BackwardArgs<acc_t<Ts>> a, ColumnRows c, ColumnRowTerms<acc_t<Ts>>* row_terms) {
  using A = acc_t<Ts>;
  constexpr int K = kRms ? 2 : 3;
  __shared__ double slots[K][kColumnWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const A w_base = a.weight != nullptr ? a.weight_offset : A(1);
  const int64_t tiles = a.rows / c.plane * c.tiles_per_image;
  auto tile_pass = [&](int64_t tile, auto from_output) {
    constexpr bool kFromOutput = decltype(from_output)::value;
    const ColumnPixel px = column_pixel(c, a.cols, tile, lane);
    A mean = A(0), rstd = A(0);
    if (px.valid) row_stats(a, px.row, kRms, &mean, &rstd);
    BackwardSums<A, kRms> s{};
    if (px.valid) {
      for (int64_t ch = warp; ch < a.cols; ch += kColumnWarps) {
        A dy, d, g;
        column_terms<kFromOutput, kRms, Tg, Ts, Tw>(a, c, px.first, ch, w_base, mean, dy, d, g);
        s.v[0] += g;
        s.v[1] += g * d;
        if constexpr (!kRms) s.v[2] += d;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) slots[k][warp][lane] = static_cast<double>(s.v[k]);
    __syncthreads();
    Sums<double, K> total;
#pragma unroll
    for (int k = 0; k < K; ++k) total.v[k] = warps_sum(slots[k], lane);
    const RowCoefficients<A> k = row_coefficients<kRms>(a, rstd, total);
    if (px.valid) {
      if (warp == 0 && row_terms != nullptr) row_terms[px.row] = ColumnRowTerms<A>{mean, k.delta, k.xscale, A(0)};
      for (int64_t ch = warp; ch < a.cols; ch += kColumnWarps) {
        A dy, d, g;
        column_terms<kFromOutput, kRms, Tg, Ts, Tw>(a, c, px.first, ch, w_base, mean, dy, d, g);
        store_global(static_cast<Ts*>(a.grad_input) + px.first + ch * c.plane,
                     from_acc<Ts>(grad_input_term(k, d - k.delta, g)));
      }
    }
    __syncthreads();  // the next tile writes the slots again
  };
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    if (a.saved_is_output) tile_pass(tile, std::true_type{});
    else tile_pass(tile, std::false_type{});
  }
}

// dweight / dbias partials: block (channel, group of images) = (blockIdx.x % cols, blockIdx.x / cols), the group
// images [group * images_per_group, ...); its threads
// stride over the pixels of each image (coalesced), summing dy * xhat and dy in A (at most about 64 terms each:
// the launcher's group size), then the block's warps in order. partial_dweight / partial_dbias: [groups, cols].
template <typename Tg, typename Ts, typename Tw, bool kRms>
__global__ void __launch_bounds__(kParamGradThreads)
    columns_param_grads_kernel(BackwardArgs<acc_t<Ts>> a, ColumnRows c, const ColumnRowTerms<acc_t<Ts>>* row_terms,
                               int64_t images_per_group) {
  using A = acc_t<Ts>;
  __shared__ Sums<A, 2> warp_sums[kParamGradThreads / 32];
  const int64_t ch = blockIdx.x % a.cols, group = blockIdx.x / a.cols;
  const int64_t images = a.rows / c.plane;
  const int64_t group_end = (group + 1) * images_per_group;
  const int64_t image_end = group_end < images ? group_end : images;
  const A w_base = a.weight != nullptr ? a.weight_offset : A(1);
  Sums<A, 2> s{};
  for (int64_t image = group * images_per_group; image < image_end; ++image) {
    for (int64_t pixel = threadIdx.x; pixel < c.plane; pixel += kParamGradThreads) {
      const int64_t row = image * c.plane + pixel;
      const ColumnRowTerms<A> t = row_terms[row];
      A dy, d, g;
      if (a.saved_is_output) {
        column_terms<true, kRms, Tg, Ts, Tw>(a, c, image * a.cols * c.plane + pixel, ch, w_base, t.mean, dy, d, g);
      } else {
        column_terms<false, kRms, Tg, Ts, Tw>(a, c, image * a.cols * c.plane + pixel, ch, w_base, t.mean, dy, d, g);
      }
      s.v[0] += dy * ((d - t.delta) * t.xscale);
      s.v[1] += dy;
    }
  }
  s = warp_allreduce_32(s);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    Sums<A, 2> total = warp_sums[0];
    for (int w = 1; w < kParamGradThreads / 32; ++w) total = combine(total, warp_sums[w]);
    const int64_t at = group * a.cols + ch;
    if (a.partial_dweight != nullptr) store_global(a.partial_dweight + at, total.v[0]);
    if (a.partial_dbias != nullptr) store_global(a.partial_dbias + at, total.v[1]);
  }
}

}  // namespace cuda
}  // namespace layernorm_ext
