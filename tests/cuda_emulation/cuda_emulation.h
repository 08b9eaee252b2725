// A host emulation of the little of CUDA that the kernels of csrc/cuda/*.cuh use, so that the very same kernel
// and launcher code can run (slowly) on a machine without a GPU. Each CUDA thread of a block is a fiber on
// the calling thread (a context switch of our own on x86-64, ucontext elsewhere); blocks run one after another,
// the blocks of one thread-block cluster together (their threads' fibers interleaved, so that a cluster barrier
// can wait for all of them; a __syncthreads then waits for the whole cluster too). __syncthreads switches to the next fiber,
// so the block's threads advance in lockstep from barrier to barrier (the order within a phase is the fiber
// order; the kernels must not depend on it, and on a GPU they could not). __shfl_xor_sync goes through a
// per-block exchange buffer between two barriers (the kernels call it with every thread of the block, as
// they must on the GPU for whole-warp masks). __shared__ variables are static: shared by the threads of the
// one block that runs at a time (and by all the blocks of a cluster: kernels launched on clusters keep what is
// per block in dynamic shared memory, one buffer per block, which cluster.map_shared_rank checks). Half types
// are c10::Half / c10::BFloat16.
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
#include <memory>
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
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount,
  cudaDevAttrMaxSharedMemoryPerBlockOptin,
  cudaDevAttrComputeCapabilityMajor
};
struct cudaFuncAttributes {
  int binaryVersion = 0;
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributeNonPortableClusterSizeAllowed };
enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension };
struct cudaLaunchAttributeValue {
  struct {
    unsigned x, y, z;
  } clusterDim;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};
// Device code with thread-block clusters: the emulation has them (an sm_90 mapping).
#define LNX_CLUSTERS 1

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
inline void make_context(Context& c, char* stack, size_t stack_bytes, void (*entry)()) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + stack_bytes) & ~uintptr_t{15};
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

inline void make_context(Context& c, char* stack, size_t stack_bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = stack_bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// The emulated GPU: few SMs, so that persistent grids stride over rows; 100 KiB of shared memory per block.
constexpr int kSMs = 3;
constexpr int kBlocksPerSM = 2;
constexpr int kSharedOptin = 100 * 1024;
constexpr int kComputeCapability = 90;  // the sm_90 mapping: long rows on thread-block clusters
constexpr unsigned kMaxCluster = 16;    // non-portable cluster sizes allowed

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

// The running block, or cluster of blocks: one fiber per CUDA thread (block b's thread t is fiber b * count + t),
// resumed in turn until each reaches the next barrier.
struct Block {
  std::vector<Context> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;  // not zeroed: a page is taken only where a fiber reaches it
  std::vector<bool> done;
  Context scheduler;
  unsigned current = 0;
  unsigned count = 0;    // threads per block
  unsigned cluster = 1;  // blocks run together
  std::function<void()> body;  // the kernel call, run by every fiber
  std::exception_ptr error;
  std::vector<double> exchange;  // one slot per thread, for shuffles
  std::vector<std::vector<unsigned char>> dynamic_shared;  // one buffer per block of the cluster
  unsigned block_of_current() const { return current / count; }
};

inline Block& block() {
  static Block b;
  return b;
}

// The running fiber's index among the cluster's threads (a shuffle's lane: warps never straddle blocks).
inline unsigned thread_rank() { return block().current; }

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
void launch(Kernel kernel, dim3 grid, dim3 threads, size_t shared_bytes, unsigned cluster, Args... args) {
  TORCH_CHECK(grid.x > 0 && threads.x > 0, "emulated launch: empty grid or block");
  TORCH_CHECK(threads.x * threads.y <= 1024, "emulated launch: more than 1024 threads per block");
  TORCH_CHECK(shared_bytes <= static_cast<size_t>(kSharedOptin), "emulated launch: too much shared memory");
  TORCH_CHECK(cluster >= 1 && cluster <= kMaxCluster && grid.x % cluster == 0,
              "emulated launch: the grid is not a whole number of clusters of ", cluster, " blocks");
  TORCH_CHECK((threads.x * threads.y) % 32 == 0 || cluster == 1, "emulated launch: clusters of partial warps");
  constexpr size_t kStack = 256 * 1024;
  Block& b = block();
  b.count = threads.x * threads.y;
  b.cluster = cluster;
  const unsigned fibers = b.count * cluster;
  b.exchange.assign(fibers, 0.0);
  b.fibers.resize(fibers);
  while (b.stacks.size() < fibers) b.stacks.emplace_back(new char[kStack]);
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
  b.dynamic_shared.resize(cluster);
  for (unsigned first_block = 0; first_block < grid.x; first_block += cluster) {
    for (auto& shared : b.dynamic_shared) shared.assign(shared_bytes + 16, 0xAB);  // garbage: nothing may read it before writing
    b.done.assign(fibers, false);
    for (unsigned f = 0; f < fibers; ++f) {
      make_context(b.fibers[f], b.stacks[f].get(), kStack, fiber_main);
    }
    blockDim = threads;
    gridDim = grid;
    unsigned finished = 0;
    while (finished < fibers) {  // one phase: every fiber runs to its next barrier (or its end)
      unsigned finished_now = 0;
      for (unsigned f = 0; f < fibers; ++f) {
        if (b.done[f]) continue;
        b.current = f;
        const unsigned t = f % b.count;
        blockIdx = {first_block + f / b.count, 0, 0};
        threadIdx = {t % threads.x, t / threads.x, 0};
        switch_context(b.scheduler, b.fibers[f]);
        if (b.done[f]) ++finished_now;
      }
      TORCH_CHECK(finished_now == 0 || finished + finished_now == fibers,
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
    launch(kernel, launcher.grid, launcher.threads, launcher.shared_bytes, 1u, args...);
  }
};

template <typename Kernel>
BoundLaunch<Kernel> bind(Kernel kernel, const Launcher& launcher) {
  return {kernel, launcher};
}

}  // namespace emulation

inline void __syncthreads() { emulation::yield_to_scheduler(); }

// Thread-block clusters: the cluster's blocks run together (emulation::launch), so a cluster barrier is a switch
// to the scheduler like __syncthreads; map_shared_rank finds the same offset in another block's dynamic shared
// memory (the only per-block shared memory of the emulation: a static __shared__ pointer is refused).
namespace cooperative_groups {
struct cluster_group {
  void sync() const { emulation::yield_to_scheduler(); }
  unsigned block_rank() const { return emulation::block().block_of_current(); }
  unsigned num_blocks() const { return emulation::block().cluster; }
  template <typename T>
  T* map_shared_rank(T* p, unsigned rank) const {
    emulation::Block& b = emulation::block();
    const auto& mine = b.dynamic_shared[b.block_of_current()];
    const auto* bytes = reinterpret_cast<const unsigned char*>(p);
    TORCH_CHECK(rank < b.cluster && bytes >= mine.data() && bytes < mine.data() + mine.size(),
                "emulated map_shared_rank: not in this block's dynamic shared memory, or no block ", rank);
    return reinterpret_cast<T*>(b.dynamic_shared[rank].data() + (bytes - mine.data()));
  }
};
inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups

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
  *value = attr == cudaDevAttrMultiProcessorCount      ? emulation::kSMs
           : attr == cudaDevAttrComputeCapabilityMajor ? emulation::kComputeCapability / 10
                                                       : emulation::kSharedOptin;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Kernel) {
  attributes->binaryVersion = emulation::kComputeCapability;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = emulation::kBlocksPerSM;
  return cudaSuccess;
}
// Clusters of config's cluster dimension resident at once: the resident blocks, whole clusters of them.
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveClusters(int* clusters, Kernel, const cudaLaunchConfig_t* config) {
  unsigned cluster = 1;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension) cluster = config->attrs[i].val.clusterDim.x;
  }
  *clusters = static_cast<int>(emulation::kSMs * emulation::kBlocksPerSM / cluster);
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute attribute, int value) {
  TORCH_CHECK(attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value <= emulation::kSharedOptin,
              "emulated cudaFuncSetAttribute: ", value, " bytes");
  return cudaSuccess;
}
// The cluster dimension attribute (1-D clusters) is the only one the kernels set.
template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args... args) {
  unsigned cluster = 1;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension) {
      TORCH_CHECK(config->attrs[i].val.clusterDim.y == 1 && config->attrs[i].val.clusterDim.z == 1,
                  "emulated cudaLaunchKernelEx: 1-D clusters only");
      cluster = config->attrs[i].val.clusterDim.x;
    }
  }
  emulation::launch(kernel, config->gridDim, config->blockDim, config->dynamicSmemBytes, cluster,
                    static_cast<Params>(args)...);
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
#define LNX_DYNAMIC_SHARED(name) \
  unsigned char* name = ::emulation::block().dynamic_shared[::emulation::block().block_of_current()].data()
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
