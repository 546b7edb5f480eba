// attn/safetensors/dtype.hpp: the element types of .safetensors files (attn/safetensors.hpp)
// and the correctly rounded conversions between them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

// The data section is used in place (views, memcpy): the host must be little-endian, as the
// format is. Every platform attn targets is; a big-endian one would need byte swaps.
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "attn/safetensors.hpp supports little-endian hosts only"
#endif

namespace attn {

/// The element types attn reads and writes ("F64", "F32", "F16", "BF16" in a file).
enum class DType : std::uint8_t { f64, f32, f16, bf16 };

/// "F64", "F32", "F16" or "BF16" ("?" for a value outside the enum).
inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return "F64";
    case DType::f32:
      return "F32";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
  }
  return "?";
}

/// Bytes per element (0 for a value outside the enum).
inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return 8;
    case DType::f32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
  }
  return 0;
}

/// The scalars a safetensors tensor is read into or written from.
template <class T>
inline constexpr bool is_safetensors_scalar_v =
    std::is_same_v<T, double> || std::is_same_v<T, float> || std::is_same_v<T, Eigen::half> ||
    std::is_same_v<T, Eigen::bfloat16>;

/// The DType of double, float, Eigen::half, Eigen::bfloat16.
template <class T>
constexpr DType dtype_of() {
  static_assert(is_safetensors_scalar_v<T>,
                "safetensors: T must be double, float, Eigen::half or Eigen::bfloat16");
  if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, Eigen::half>)
    return DType::f16;
  else
    return DType::bf16;
}

namespace detail {

/// Round to odd, double to float: the float nearest d towards zero, its last bit set when
/// that is inexact. Rounding the result to nearest even at 16 bits then gives the correctly
/// rounded 16-bit value (float keeps at least 2 more bits than half and bfloat16 in every
/// range), where double -> float -> 16 bits, both to nearest, can round twice.
inline float round_to_odd_float(double d) {
  auto f = static_cast<float>(d);
  if (d != d || static_cast<double>(f) == d)  // NaN, or exact (zeros, infinities included)
    return f;
  if (std::abs(static_cast<double>(f)) > std::abs(d))
    f = std::nextafter(f, 0.0F);
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= 1U;
  std::memcpy(&f, &bits, sizeof bits);
  return f;
}

/// d as T, correctly rounded.
template <class T>
T from_double(double d) {
  if constexpr (std::is_same_v<T, double>)
    return d;
  else if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(d);
  else
    return T(round_to_odd_float(d));
}

/// f as T (exact to double and float; correctly rounded to the 16-bit types).
template <class T>
T from_float(float f) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return f;
  else
    return T(f);
}

template <class S>
S load_scalar(const std::uint8_t* p) {
  S s;
  std::memcpy(&s, p, sizeof(S));
  return s;
}

/// out[0:n) = the n elements of dtype `source` at `bytes` (any alignment), as T.
template <class T>
void convert_safetensors(DType source, const std::uint8_t* bytes, Index n, T* out) {
  static_assert(is_safetensors_scalar_v<T>);
  const auto count = static_cast<std::size_t>(n);
  if (source == dtype_of<T>()) {  // bit for bit, NaN payloads included
    if (count > 0)
      std::memcpy(static_cast<void*>(out), bytes, count * sizeof(T));
    return;
  }
  switch (source) {
    case DType::f64:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_double<T>(load_scalar<double>(bytes + 8 * i));
      break;
    case DType::f32:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_float<T>(load_scalar<float>(bytes + 4 * i));
      break;
    case DType::f16:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_float<T>(static_cast<float>(load_scalar<Eigen::half>(bytes + 2 * i)));
      break;
    case DType::bf16:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_float<T>(static_cast<float>(load_scalar<Eigen::bfloat16>(bytes + 2 * i)));
      break;
  }
}

}  // namespace detail

}  // namespace attn
