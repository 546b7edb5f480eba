// attn/viz/svg_text.hpp: numbers and text as the heatmaps write them (attn/viz.hpp):
// locale-independent (std::to_chars), coordinates with at most 2 decimals, XML escaping,
// colours as #rrggbb, and the estimates of text width and luminance that the layout uses.
#pragma once

#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

#include "attn/config.hpp"

namespace attn::detail::viz {

inline void append_int(std::string& out, Index value) {
  std::array<char, 24> buffer{};
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  out.append(buffer.data(), result.ptr);
}

/// Fixed-point with `decimals` digits ("nan", "inf", "-inf" for non-finite values).
inline void append_fixed(std::string& out, double value, int decimals) {
  if (std::isnan(value)) {
    out += "NaN";
    return;
  }
  if (std::isinf(value)) {
    out += value > 0 ? "inf" : "-inf";
    return;
  }
  std::array<char, 64> buffer{};
  auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value,
                              std::chars_format::fixed, decimals);
  if (result.ec != std::errc()) {  // |value| >= 1e40 or so: scientific instead
    result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value,
                           std::chars_format::scientific, decimals);
  }
  std::string text(buffer.data(), result.ptr);
  if (text.find_first_not_of("-0.") == std::string::npos && text[0] == '-')
    text.erase(0, 1);  // "-0.00" -> "0.00"
  out += text;
}

/// A coordinate: at most 2 decimals, trailing zeros dropped ("12", "12.5").
inline void append_number(std::string& out, double value) {
  if (std::abs(value) < 0.005)
    value = 0;  // never "-0"
  std::array<char, 64> buffer{};
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value,
                                    std::chars_format::fixed, 2);
  const char* end = result.ptr;
  while (end > buffer.data() && end[-1] == '0')
    --end;
  if (end > buffer.data() && end[-1] == '.')
    --end;
  out.append(buffer.data(), static_cast<std::size_t>(end - buffer.data()));
}

/// Text content or attribute value with &, <, >, " and ' escaped; control characters that
/// XML 1.0 forbids become '?'.
inline void append_escaped(std::string& out, const std::string& text) {
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r')
          out += '?';
        else
          out += c;
    }
  }
}

inline void append_hex(std::string& out, const std::array<std::uint8_t, 3>& rgb) {
  static constexpr char digits[] = "0123456789abcdef";
  out += '#';
  for (const std::uint8_t v : rgb) {
    out += digits[v >> 4U];
    out += digits[v & 0xfU];
  }
}

/// Relative luminance (WCAG) of an sRGB colour, in [0, 1].
inline double luminance(const std::array<std::uint8_t, 3>& rgb) {
  std::array<double, 3> linear{};
  for (std::size_t c = 0; c < 3; ++c) {
    const double v = rgb[c] / 255.0;
    linear[c] = v <= 0.04045 ? v / 12.92 : std::pow((v + 0.055) / 1.055, 2.4);
  }
  return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2];
}

/// Estimated width of `text` at `font` px: 0.6 em per ASCII character, 1 em otherwise.
inline double text_width(const std::string& text, double font) {
  double em = 0;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80)
      em += 0.6;
    else if ((u & 0xc0U) == 0xc0U)  // first byte of a multi-byte character
      em += 1.0;
  }
  return em * font;
}

inline Index ceil_div(Index a, Index b) {
  return (a + b - 1) / b;
}

inline std::vector<std::string> labels_or_indices(const std::vector<std::string>& labels,
                                                  Index count) {
  if (!labels.empty())
    return labels;
  std::vector<std::string> out;
  out.reserve(static_cast<std::size_t>(count));
  for (Index i = 0; i < count; ++i)
    out.push_back(std::to_string(i));
  return out;
}

/// Shortest round-trip form of a double, for messages.
inline std::string shortest(double value) {
  std::array<char, 32> buffer{};
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  std::string text(buffer.data(), result.ptr);
  return text;
}

}  // namespace attn::detail::viz
