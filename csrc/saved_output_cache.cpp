// The memory_efficient decision, cached per parameter version (issue 14): whether a forward may save its output
// instead of its input depends on the weight's and bias's values (csrc/norm_autograd.cpp, can_save_output), and
// reading them costs a host synchronization on CUDA. The values of a parameter only change by an in-place
// operation (an optimizer step, `w.zero_()` under no_grad, `w[3] = 0`), and each of those bumps the tensor's
// version counter. So the result of a check holds for as long as the same weight and bias, at the same versions,
// come back: a training loop reads the parameters once per optimizer step, an inference loop once.
//
// Blind spots, on purpose: a write through a tensor that shares the memory but not the version counter is not seen:
// `w.data.zero_()`, a tensor made with `set_` on the same storage, the numpy array under `torch.from_numpy`, a
// raw pointer. Should a weight entry become exactly 0 that way, the backward divides by it and the gradients of
// that column are inf/NaN (loud); a weight that merely became much smaller than its bias gives less accurate
// gradients there. Replacing a tensor's data (`w.data = other`, which keeps the version) is seen: the storage and
// data pointer are part of the key.
#include <c10/core/StorageImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <vector>

#include "norm.h"

namespace layernorm_ext {
namespace {

// Enough for every norm of a large model whose weights are distinct tensors (several per layer share them
// otherwise); beyond it, the oldest entry goes and its parameters are checked again on their next call.
constexpr size_t kMaxEntries = 64;

using WeakTensorImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using WeakStorageImpl = c10::weak_intrusive_ptr<c10::StorageImpl>;

// One parameter (weight or bias) as a check saw it. The weak pointers keep the TensorImpl and StorageImpl objects'
// memory allocated (not their data) while the entry exists, so that no other tensor can be created at the same
// address: comparing the raw pointers of a live call's tensor with them is then an identity test, never a false
// match of a freed parameter whose address was reused. An absent parameter is the UndefinedTensorImpl singleton.
struct ParamSnapshot {
  WeakTensorImpl impl;
  WeakStorageImpl storage;
  const void* data;
  uint32_t version;

  explicit ParamSnapshot(const OptTensor& t)
      : impl(t.has_value() ? WeakTensorImpl(t->getIntrusivePtr())
                           : WeakTensorImpl(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>())),
        storage(t.has_value() ? t->storage().getWeakStorageImpl()
                              : WeakStorageImpl(c10::intrusive_ptr<c10::StorageImpl>())),
        data(t.has_value() ? t->const_data_ptr() : nullptr),
        version(t.has_value() ? static_cast<uint32_t>(t->_version()) : 0) {}

  // Whether t is the very tensor seen, unchanged since (same version, same storage and data pointer).
  bool matches(const OptTensor& t) const {
    if (!t.has_value()) return impl._unsafe_get_target() == c10::UndefinedTensorImpl::singleton();
    return impl._unsafe_get_target() == t->unsafeGetTensorImpl() &&
           storage._unsafe_get_target() == t->storage().unsafeGetStorageImpl() && data == t->const_data_ptr() &&
           version == static_cast<uint32_t>(t->_version());
  }

  // Whether the tensor is gone: then no later call can match the entry.
  bool dead() const {
    return impl._unsafe_get_target() != c10::UndefinedTensorImpl::singleton() && impl.expired();
  }
};

struct Entry {
  ParamSnapshot weight, bias;
  double weight_offset;
  bool safe;
};

// Process-wide, shared by every thread (two threads may run forwards with the same parameters): a mutex guards
// the entries, held only to look up and to store, never while the check reads the values.
std::mutex cache_mutex;
std::vector<Entry> cache_entries;  // oldest first

// Whether a tensor can be a key: it must have a version counter (inference tensors have none) and a storage.
bool cacheable(const OptTensor& t) {
  return !t.has_value() || (!t->is_inference() && t->has_storage());
}

}  // namespace

// The cached result of check(weight, bias), or a fresh check when these tensors at these versions were never
// checked (then remembered). The versions are read before the check runs, so that an update racing with it
// (another thread) leaves an entry for the old version, which no later call matches.
bool params_allow_saved_output(const OptTensor& weight, const OptTensor& bias, double weight_offset,
                               ParamsCheck check) {
  if (!cacheable(weight) || !cacheable(bias)) return check(weight, bias, weight_offset);
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    for (const Entry& e : cache_entries) {
      if (e.weight.matches(weight) && e.bias.matches(bias) && e.weight_offset == weight_offset) return e.safe;
    }
  }
  Entry fresh{ParamSnapshot(weight), ParamSnapshot(bias), weight_offset, false};
  fresh.safe = check(weight, bias, weight_offset);
  std::lock_guard<std::mutex> lock(cache_mutex);
  // One entry per (weight, bias) pair: a newer version (or another offset) replaces the older one.
  for (Entry& e : cache_entries) {
    if (e.weight.impl._unsafe_get_target() == fresh.weight.impl._unsafe_get_target() &&
        e.bias.impl._unsafe_get_target() == fresh.bias.impl._unsafe_get_target()) {
      e = std::move(fresh);
      return e.safe;
    }
  }
  if (cache_entries.size() >= kMaxEntries) {
    // (erase + remove_if, not C++20's std::erase_if: torch 2.5-2.11 build extensions as C++17.)
    cache_entries.erase(std::remove_if(cache_entries.begin(), cache_entries.end(),
                                       [](const Entry& e) { return e.weight.dead() || e.bias.dead(); }),
                        cache_entries.end());
    if (cache_entries.size() >= kMaxEntries) cache_entries.erase(cache_entries.begin());
  }
  const bool safe = fresh.safe;
  cache_entries.push_back(std::move(fresh));
  return safe;
}

}  // namespace layernorm_ext
