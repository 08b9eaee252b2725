// CPU registrations: every op of csrc/bindings.cpp, bound to the shared op bodies with the CPU kernels.
#include "../device_ops.h"

namespace layernorm_ext {

TORCH_LIBRARY_IMPL(layernorm_ext, CPU, m) { DeviceOps<cpu::forward, cpu::backward>::register_to(m); }

}  // namespace layernorm_ext
