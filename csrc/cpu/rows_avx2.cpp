// Row kernels for AVX2 + FMA + F16C. Only this file's kernels are compiled for them (LNX_TARGET: rows_impl.h
// applies it after the shared headers, to functions of internal linkage only), and it includes no torch
// header; the dispatcher (norm_kernel.cpp) calls in only after checking the CPU has these features.
#define LNX_TARGET "avx2,fma,f16c"
#define LNX_ISA_NS isa_avx2
#define LNX_ISA_NAME "avx2"
#define LNX_FLOAT_LANES 8
#define LNX_F16C 1
#define LNX_ENTRY avx2_row_kernels
#include "rows_impl.h"
