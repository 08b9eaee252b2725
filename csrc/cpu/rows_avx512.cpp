// Row kernels for AVX-512 (F, BW, VL, DQ) + FMA + F16C. Only this file's kernels are compiled for them
// (LNX_TARGET: rows_impl.h applies it after the shared headers, to functions of internal linkage only), and
// it includes no torch header; the dispatcher (norm_kernel.cpp) calls in only after checking the CPU has
// these features.
// GCC 12's own avx512fintrin.h trips this warning in _mm512_cvtph_ps (its undefined-vector idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define LNX_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define LNX_ISA_NS isa_avx512
#define LNX_ISA_NAME "avx512"
#define LNX_FLOAT_LANES 16
#define LNX_F16C 1
#define LNX_ENTRY avx512_row_kernels
#include "rows_impl.h"
