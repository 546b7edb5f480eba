// attn/config.hpp: version, the index type, OpenMP detection and argument checking.
//
// Public entry points validate their arguments in every build type and throw
// std::invalid_argument with a message of the form
//   "<function>: <what> is [2, 8, 128, 64] but <other> is [2, 8, 128, 32]: <rule>".
// Internal invariants use ATTN_ASSERT, which is active only in debug builds.
#pragma once

#include <cassert>
#include <cstddef>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

// The one source of the version: CMakeLists.txt reads these three lines.
#define ATTN_VERSION_MAJOR 0
#define ATTN_VERSION_MINOR 2
#define ATTN_VERSION_PATCH 0
#define ATTN_DETAIL_STRINGIFY_(x) #x
#define ATTN_DETAIL_STRINGIFY(x) ATTN_DETAIL_STRINGIFY_(x)
/// "0.2.0"
#define ATTN_VERSION_STRING                 \
  ATTN_DETAIL_STRINGIFY(ATTN_VERSION_MAJOR) \
  "." ATTN_DETAIL_STRINGIFY(ATTN_VERSION_MINOR) "." ATTN_DETAIL_STRINGIFY(ATTN_VERSION_PATCH)

#if defined(_OPENMP)
#include <omp.h>
#define ATTN_HAS_OPENMP 1
#else
#define ATTN_HAS_OPENMP 0
#endif

#ifndef ATTN_ASSERT
#define ATTN_ASSERT(condition) assert(condition)
#endif

namespace attn {

/// Every dimension and index in the library (same type as Eigen::Index).
using Index = std::ptrdiff_t;

namespace detail {

/// "[2, 8, 128, 64]": a shape, or any list of sizes (lengths per sequence, ...).
template <class Sizes>
std::string list_string(const Sizes& sizes) {
  std::ostringstream s;
  s << '[';
  const char* separator = "";
  for (const Index d : sizes) {
    s << separator << d;
    separator = ", ";
  }
  s << ']';
  return s.str();
}

inline std::string shape_string(std::initializer_list<Index> dims) {
  return list_string(dims);
}

/// Throws std::invalid_argument("<function>: <message>"). Kept out of line of the
/// hot path: callers build the message only once a check has failed.
[[noreturn]] inline void throw_invalid_argument(const char* function, const std::string& message) {
  throw std::invalid_argument(std::string(function) + ": " + message);
}

/// Number of OpenMP threads a parallel region would use here (1 without OpenMP).
inline int max_threads() {
#if ATTN_HAS_OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace detail
}  // namespace attn
