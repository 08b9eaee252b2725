// Error and warning messages as one std::string, numbers written by std::to_string / snprintf, never by a
// std::ostream of this library: a single string passes through TORCH_CHECK's c10::str unchanged, so no stream is made.
// Why: on an H200 machine (torch 2.11) the compiler linked a private static libstdc++ into this library and
// -Wl,-Bsymbolic-functions bound our calls to it; a stream of ours then formatted an integer with that copy's num_put
// against a locale of the process's libstdc++.so.6, and every refused call whose message held an integer died with
// SIGSEGV (benchmarks/crash_probe.py; .ci/static_libstdcxx relinks the library that way).
//
//   TORCH_CHECK(ok, message(op, ": expected rows of ", cols, " elements, but got ", t.sizes()));
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace layernorm_ext {
namespace message_detail {

template <class T>
inline constexpr bool kNoText = false;

// The texts of c10::str's stream: integers in decimal, a char as itself, bool as 1 / 0, floating point as "%g"
// (a stream's default precision of 6), a shape as [4, 8], a dtype by c10::toString, a device by Device::str().
template <class T>
void append(std::string& s, const T& v) {
  if constexpr (std::is_same_v<T, char>) {
    s += v;
  } else if constexpr (std::is_same_v<T, bool>) {
    s += v ? '1' : '0';
  } else if constexpr (std::is_integral_v<T>) {
    s += std::to_string(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%g", static_cast<double>(v));
    s += buffer;
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    s += std::string_view(v);
  } else if constexpr (std::is_same_v<T, c10::ScalarType>) {
    s += c10::toString(v);
  } else if constexpr (std::is_same_v<T, c10::Device>) {
    s += v.str();
  } else if constexpr (std::is_convertible_v<const T&, c10::IntArrayRef>) {
    const c10::IntArrayRef values(v);
    s += '[';
    for (size_t i = 0; i < values.size(); ++i) {
      if (i > 0) s += ", ";
      s += std::to_string(values[i]);
    }
    s += ']';
  } else {
    static_assert(kNoText<T>, "layernorm_ext::message: no text for this type");
  }
}

}  // namespace message_detail

template <class... Args>
std::string message(const Args&... args) {
  std::string s;
  (message_detail::append(s, args), ...);
  return s;
}

}  // namespace layernorm_ext
