// A host emulation of the little of CUDA that the kernels of csrc/cuda/*.cuh use, so that the very same kernel
// and launcher code can run (slowly) on a machine without a GPU. Each CUDA thread of a block is a fiber on
// the calling thread (a context switch of our own on x86-64, ucontext elsewhere); blocks run one after another. __syncthreads switches to the next fiber,
// so the block's threads advance in lockstep from barrier to barrier (the order within a phase is the fiber
// order; the kernels must not depend on it, and on a GPU they could not). __shfl_xor_sync goes through a
// per-block exchange buffer between two barriers (the kernels call it with every thread of the block, as
// they must on the GPU for whole-warp masks). __shared__ variables are static: shared by the threads of the
// one block that runs at a time. Half types are c10::Half / c10::BFloat16.
//
// Tests only (tests/test_cuda_emulation.py). It checks indexing, thread mappings, reductions, plans and
// launch logic; it cannot check GPU timing, memory ordering on real hardware or the CUDA compiler.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

using __half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;

inline float __half2float(__half v) { return static_cast<float>(v); }
inline __half __ushort_as_half(unsigned short bits) { return __half(bits, __half::from_bits()); }
inline __half __float2half_rn(float v) { return __half(v); }
inline __half __double2half(double v) { return __half(static_cast<float>(v)); }
inline float __bfloat162float(__nv_bfloat16 v) { return static_cast<float>(v); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return __nv_bfloat16(v); }
inline __nv_bfloat16 __double2bfloat16(double v) { return __nv_bfloat16(static_cast<float>(v)); }
inline float __frcp_rn(float v) { return 1.0f / v; }
inline double __drcp_rn(double v) { return 1.0 / v; }
inline float __frsqrt_rn(float v) {  // correctly rounded, as on the GPU (1.0f / sqrtf(v) rounds twice)
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(v)));
}
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Set by the fiber scheduler before it resumes a fiber.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

using cudaStream_t = void*;
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };

namespace emulation {

// ---- fibers ------------------------------------------------------------------------------------------------
#if defined(__x86_64__)
// x86-64: switch by saving the callee-saved registers on the current stack and exchanging stack pointers.
// ucontext's swapcontext also saves and restores the signal mask, a system call per switch: a kernel with
// thousands of blocks of 1024 threads (reduce_partials_kernel of a 2^18-column backward) spent minutes in it.
extern "C" void lnx_emulation_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .globl lnx_emulation_switch
  .type lnx_emulation_switch, @function
lnx_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lnx_emulation_switch, .-lnx_emulation_switch
  .popsection
)");

struct Context {
  void* sp = nullptr;
};

inline void switch_context(Context& from, const Context& to) { lnx_emulation_switch(&from.sp, to.sp); }

// A fiber that starts in entry() (which must never return) on `stack`.
inline void make_context(Context& c, std::vector<char>& stack, void (*entry)()) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack.data()) + stack.size()) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top) - 8;  // six saved registers, entry() as the return address, a slot
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(entry);
  sp[7] = nullptr;  // entry() starts with the stack aligned as after a call
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};

inline void switch_context(Context& from, const Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make_context(Context& c, std::vector<char>& stack, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack.data();
  c.uc.uc_stack.ss_size = stack.size();
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// The emulated GPU: few SMs, so that persistent grids stride over rows; 100 KiB of shared memory per block.
constexpr int kSMs = 3;
constexpr int kBlocksPerSM = 2;
constexpr int kSharedOptin = 100 * 1024;

// Global memory traffic per launch (and per cudaMemsetAsync), in bytes: the kernels count their global
// accesses through kernel_common.cuh's helpers (load_pack(s), store_pack, load_global, store_global). Tests read
// it (tests/test_cuda_emulation.py) to check the bytes each kernel moves per element.
struct Traffic {
  unsigned grid = 0, threads = 0;
  uint64_t loaded = 0, stored = 0;
};

inline std::vector<Traffic>& traffic_log() {
  static std::vector<Traffic> log;
  return log;
}

inline Traffic*& current_traffic() {
  static Traffic* current = nullptr;
  return current;
}

inline void count_global_load(size_t bytes) {
  if (current_traffic() != nullptr) current_traffic()->loaded += bytes;
}

inline void count_global_store(size_t bytes) {
  if (current_traffic() != nullptr) current_traffic()->stored += bytes;
}

// The running block: one fiber per CUDA thread, resumed in turn until each reaches the next barrier.
struct Block {
  std::vector<Context> fibers;
  std::vector<std::vector<char>> stacks;
  std::vector<bool> done;
  Context scheduler;
  unsigned current = 0;
  unsigned count = 0;
  std::function<void()> body;  // the kernel call, run by every fiber
  std::exception_ptr error;
  std::vector<double> exchange;  // one slot per thread, for shuffles
  std::vector<unsigned char> dynamic_shared;
};

inline Block& block() {
  static Block b;
  return b;
}

inline unsigned thread_rank() { return threadIdx.x + threadIdx.y * blockDim.x; }

inline void fiber_main() {
  Block& b = block();
  try {
    b.body();
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  b.done[b.current] = true;
  switch_context(b.fibers[b.current], b.scheduler);  // never resumed
}

// A barrier: back to the scheduler, which resumes every other fiber up to this barrier first.
inline void yield_to_scheduler() {
  Block& b = block();
  switch_context(b.fibers[b.current], b.scheduler);
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 threads, size_t shared_bytes, Args... args) {
  TORCH_CHECK(grid.x > 0 && threads.x > 0, "emulated launch: empty grid or block");
  TORCH_CHECK(threads.x * threads.y <= 1024, "emulated launch: more than 1024 threads per block");
  TORCH_CHECK(shared_bytes <= static_cast<size_t>(kSharedOptin), "emulated launch: too much shared memory");
  constexpr size_t kStack = 256 * 1024;
  Block& b = block();
  b.count = threads.x * threads.y;
  b.exchange.assign(b.count, 0.0);
  b.fibers.resize(b.count);
  if (b.stacks.size() < b.count) b.stacks.resize(b.count);
  b.body = [&] { kernel(args...); };
  b.error = nullptr;
  traffic_log().push_back(Traffic{grid.x, b.count, 0, 0});
  Traffic traffic = traffic_log().back();
  current_traffic() = &traffic;  // a local: the log may grow (reallocate) only after this launch
  struct Record {
    Traffic& traffic;
    ~Record() {
      traffic_log().back() = traffic;
      current_traffic() = nullptr;
    }
  } record{traffic};
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    b.dynamic_shared.assign(shared_bytes + 16, 0xAB);  // garbage: nothing may read it before writing
    b.done.assign(b.count, false);
    for (unsigned t = 0; t < b.count; ++t) {
      b.stacks[t].resize(kStack);
      make_context(b.fibers[t], b.stacks[t], fiber_main);
    }
    blockIdx = {bx, 0, 0};
    blockDim = threads;
    gridDim = grid;
    unsigned finished = 0;
    while (finished < b.count) {  // one phase: every fiber runs to its next barrier (or its end)
      unsigned finished_now = 0;
      for (unsigned t = 0; t < b.count; ++t) {
        if (b.done[t]) continue;
        b.current = t;
        threadIdx = {t % threads.x, t / threads.x, 0};
        switch_context(b.scheduler, b.fibers[t]);
        if (b.done[t]) ++finished_now;
      }
      TORCH_CHECK(finished_now == 0 || finished + finished_now == b.count,
                  "emulated launch: some threads of a block left while others wait at a barrier");
      finished += finished_now;
    }
    if (b.error) std::rethrow_exception(b.error);
  }
}

struct Launcher {
  dim3 grid, threads;
  size_t shared_bytes;
};

template <typename Kernel>
struct BoundLaunch {
  Kernel kernel;
  Launcher launcher;
  template <typename... Args>
  void operator()(Args... args) const {
    launch(kernel, launcher.grid, launcher.threads, launcher.shared_bytes, args...);
  }
};

template <typename Kernel>
BoundLaunch<Kernel> bind(Kernel kernel, const Launcher& launcher) {
  return {kernel, launcher};
}

}  // namespace emulation

inline void __syncthreads() { emulation::yield_to_scheduler(); }

template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int offset) {
  emulation::Block& b = emulation::block();
  const unsigned me = emulation::thread_rank();
  b.exchange[me] = static_cast<double>(value);
  emulation::yield_to_scheduler();
  const T other = static_cast<T>(b.exchange[me ^ static_cast<unsigned>(offset)]);
  emulation::yield_to_scheduler();
  return other;
}

// The value of lane src_lane of the caller's warp (the kernels call it with every thread of the block).
template <typename T>
T __shfl_sync(unsigned /*mask*/, T value, int src_lane) {
  emulation::Block& b = emulation::block();
  const unsigned me = emulation::thread_rank();
  b.exchange[me] = static_cast<double>(value);
  emulation::yield_to_scheduler();
  const T other = static_cast<T>(b.exchange[(me & ~31u) + static_cast<unsigned>(src_lane & 31)]);
  emulation::yield_to_scheduler();
  return other;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  *value = attr == cudaDevAttrMultiProcessorCount ? emulation::kSMs : emulation::kSharedOptin;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = emulation::kBlocksPerSM;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int value) {
  TORCH_CHECK(value <= emulation::kSharedOptin, "emulated cudaFuncSetAttribute: ", value, " bytes");
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  emulation::traffic_log().push_back(emulation::Traffic{0, 0, 0, bytes});  // grid 0: a memset
  std::memset(p, value, bytes);
  return cudaSuccess;
}

#define C10_CUDA_CHECK(expr) TORCH_CHECK((expr) == cudaSuccess, #expr)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)
#define LNX_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::emulation::bind(kernel, ::emulation::Launcher{dim3(grid), dim3(block), static_cast<size_t>(shared_bytes)})
#define LNX_DYNAMIC_SHARED(name) unsigned char* name = ::emulation::block().dynamic_shared.data()
#define LNX_COUNT_LOAD(bytes) ::emulation::count_global_load(bytes)
#define LNX_COUNT_STORE(bytes) ::emulation::count_global_store(bytes)

namespace layernorm_ext {
namespace cuda {
inline cudaStream_t current_stream() { return nullptr; }
// Bytes of the last workspace() request (tests inspect the backward's partial buffers).
inline size_t last_workspace_bytes = 0;
inline c10::DataPtr workspace(size_t bytes) {
  last_workspace_bytes = bytes;
  c10::DataPtr p = c10::GetCPUAllocator()->allocate(bytes);
  std::memset(p.get(), 0xAB, bytes);  // garbage: nothing may read it before writing
  return p;
}
}  // namespace cuda
}  // namespace layernorm_ext
