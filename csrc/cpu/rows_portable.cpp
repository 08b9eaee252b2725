// Row kernels for any x86-64 (or other) CPU: the compiler's baseline vectors (SSE2 on x86-64), no flags.
#define LNX_ISA_NS isa_portable
#define LNX_ISA_NAME "scalar"
#define LNX_FLOAT_LANES 4
#define LNX_F16C 0
#define LNX_ENTRY portable_row_kernels
#include "rows_impl.h"
