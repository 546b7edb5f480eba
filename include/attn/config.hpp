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

#define ATTN_VERSION_MAJOR 0
#define ATTN_VERSION_MINOR 1
#define ATTN_VERSION_PATCH 0
#define ATTN_VERSION_STRING "0.1.0"

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

/// "[2, 8, 128, 64]"
inline std::string shape_string(std::initializer_list<Index> dims) {
  std::ostringstream s;
  s << '[';
  const char* separator = "";
  for (const Index d : dims) {
    s << separator << d;
    separator = ", ";
  }
  s << ']';
  return s.str();
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
