// Where a tensor's rows lie in memory (issue 24): the normalized dims packed (each row `cols` consecutive
// elements), the leading dims with any strides. The leading dims, coalesced, fit in at most two: `outer` steps
// of outer_stride, each holding `inner` rows inner_stride apart, e.g. QK-norm's [tokens, heads] view of a fused
// qkv projection (strides 3 * heads * head_dim and head_dim). A contiguous tensor, a slice x[..., :d] and any
// rows evenly spaced in memory have inner == 1: one multiply per row. Offsets are in elements from the tensor's
// data pointer (its storage offset included). Plain C++ (the CPU row kernels and the CUDA kernels include it).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LNX_HOST_DEVICE __host__ __device__ __forceinline__
#else
// Always inlined, even at -O0: an out-of-line copy would be a weak symbol that each CPU instruction-set object
// defines, and the linker may keep the AVX-512 one for every caller (tests/test_cpu_isa.py).
#define LNX_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace layernorm_ext {

struct RowLayout {
  int64_t inner = 1;         // rows per outer step; 1: rows evenly spaced, outer_stride apart
  int64_t inner_stride = 0;  // between rows of one outer step (unused when inner == 1)
  int64_t outer_stride = 0;  // between outer steps

  // The rows of a contiguous [rows, cols] tensor.
  static RowLayout packed(int64_t cols) { return RowLayout{1, 0, cols}; }

  LNX_HOST_DEVICE int64_t offset(int64_t row) const {
    if (inner == 1) return row * outer_stride;
    // A 32-bit division where both fit (on a GPU a 64-bit one is a subroutine of some 70 instructions).
    const int64_t outer = (row | inner) >> 31 == 0
                              ? static_cast<int64_t>(static_cast<uint32_t>(row) / static_cast<uint32_t>(inner))
                              : row / inner;
    return outer * outer_stride + (row - outer * inner) * inner_stride;
  }

  // offset() for row and inner below 2^31, a 32-bit division only: the CUDA kernels' (with offset()'s 64-bit
  // division, a subroutine call, 64 of 260 strided kernels took more registers, up to 28, and 20 fewer, up to 14;
  // ptxas sm_90). Their launchers copy strided rows of more than 2^31 rows (fits_offset32).
  LNX_HOST_DEVICE int64_t offset32(int64_t row) const {
    if (inner == 1) return row * outer_stride;
    const int64_t outer = static_cast<int64_t>(static_cast<uint32_t>(row) / static_cast<uint32_t>(inner));
    return outer * outer_stride + (row - outer * inner) * inner_stride;
  }
  bool fits_offset32(int64_t rows) const { return inner == 1 || rows <= (int64_t{1} << 31); }

  bool is_packed(int64_t cols) const { return inner == 1 && outer_stride == cols; }
};

}  // namespace layernorm_ext
