// attn/viz.hpp: attention weights as SVG heatmaps, the picture of the self-attention tutorial
// (seaborn's heatmap: Key on x, Query on y, values in the cells, YlGnBu) without a plotting
// library: the SVG is written as text, with the standard library only.
//
// Shape legend: B batch, H heads, Lq = L queries (rows, y axis), Lk = S keys (columns, x
// axis).
//
//   attention_heatmap_svg(weights (Lq, Lk), options)          one heatmap, any Eigen matrix
//   attention_heads_svg(weights (B, H, Lq, Lk), b, options)   one panel per head of batch b
//   write_attention_heatmap(path, ...), write_attention_heads(path, ...)
//
// Hidden (masked) cells are given explicitly, never guessed from the values (a weight of 0
// is a real weight, and NaN must stay visible as NaN): HeatmapOptions::visible is an (Lq, Lk)
// boolean matrix, true = query i may see key j (the polarity of AttentionOptions::keep_mask);
// visibility_matrix() builds it for a causal mask, a window and padding. Hidden cells are
// drawn hatched and carry no value; NaN cells are drawn red with the text "NaN".
//
// What the SVG contains, so that tools and tests can find it (every element has a class):
//   Lq, Lk <= cell_limit (and at most cell_limit^2 cells in all panels together): one
//     <rect class="cell"> per cell in row-major order ("cell hidden",
//     "cell nan" for hidden and NaN cells), and when Lq, Lk <= annotate_limit one
//     <text class="value"> per visible cell, in the same order;
//   larger: the cells of a row are merged into runs of equal colour (the scale quantised to
//     64 levels) and drawn as one stroked <path class="cells"> per colour, which keeps
//     L = 512 under 2 MB even for noise (see tests/test_viz.cpp), and no per-cell text;
//   <text class="query-label"> / "key-label" ticks (thinned to at most max_ticks per axis),
//   "axis-label", "title", "panel-title", and a <g class="colorbar">.
// Output is deterministic and locale-independent (std::to_chars).
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/mask.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Sequential colour maps (light = low, dark = high), 9 ColorBrewer anchors each,
/// interpolated linearly in sRGB.
enum class ColorMap : std::uint8_t {
  ylgnbu,  ///< yellow-green-blue, seaborn's "YlGnBu" (the tutorial's)
  greys,   ///< white to black
};

/// How a heatmap is drawn. Sizes are in SVG pixels.
struct HeatmapOptions {
  std::string title = "Attention weights";  ///< above the figure; empty = none
  std::string query_axis = "Query";         ///< y axis name; empty = none
  std::string key_axis = "Key";             ///< x axis name; empty = none
  std::vector<std::string> query_labels;    ///< Lq tick labels; empty = "0", "1", ...
  std::vector<std::string> key_labels;      ///< Lk tick labels; empty = "0", "1", ...
  /// (Lq, Lk), true = query i may see key j; empty = every cell visible. Hidden cells are
  /// drawn hatched, without a value, and are left out of the automatic colour range.
  Matrix<bool> visible;
  /// Colour scale. Unset: the range of the visible finite values (seaborn's default; when
  /// they are all equal, widened to include 0). Values outside are clamped to the ends.
  std::optional<double> vmin, vmax;
  ColorMap color_map = ColorMap::ylgnbu;
  int decimals = 2;           ///< digits after the point, values and colour bar, [0, 6]
  Index cell_size = 56;       ///< largest cell side
  Index max_plot_size = 720;  ///< cells shrink (to >= 1 px) so a panel's longer side fits
  Index annotate_limit = 32;  ///< print values only when Lq, Lk <= this (and they fit)
  /// One <rect> per cell when Lq, Lk <= this and all panels have <= cell_limit^2 cells in
  /// total; else each row's cells are merged into runs of equal colour (64 levels).
  Index cell_limit = 128;
  Index max_ticks = 32;                   ///< at most this many tick labels per axis (0 = none)
  Index columns = 0;                      ///< heads grid: panels per row; 0 = ceil(sqrt(H))
  std::vector<std::string> panel_titles;  ///< heads grid: H titles; empty = "head 0", ...
};

/// The colour of `map` at t in [0, 1] (clamped) as {r, g, b}.
inline std::array<std::uint8_t, 3> colormap_rgb(ColorMap map, double t) {
  static constexpr std::array<std::uint32_t, 9> ylgnbu{
      0xffffd9, 0xedf8b1, 0xc7e9b4, 0x7fcdbb, 0x41b6c4, 0x1d91c0, 0x225ea8, 0x253494, 0x081d58};
  static constexpr std::array<std::uint32_t, 9> greys{
      0xffffff, 0xf0f0f0, 0xd9d9d9, 0xbdbdbd, 0x969696, 0x737373, 0x525252, 0x252525, 0x000000};
  const auto& anchors = map == ColorMap::greys ? greys : ylgnbu;
  const double x = (std::isnan(t) ? 0.0 : std::clamp(t, 0.0, 1.0)) * 8.0;
  const auto segment = std::min(static_cast<std::size_t>(x), std::size_t{7});
  const double f = x - static_cast<double>(segment);
  std::array<std::uint8_t, 3> rgb{};
  for (std::size_t c = 0; c < 3; ++c) {
    const auto shift = static_cast<unsigned>(16 - 8 * c);
    const auto a = static_cast<double>((anchors[segment] >> shift) & 0xffU);
    const auto b = static_cast<double>((anchors[segment + 1] >> shift) & 0xffU);
    rgb[c] = static_cast<std::uint8_t>(std::lround(a + (b - a) * f));
  }
  return rgb;
}

/// (Lq, Lk) visibility, true = query i may see key j, of a causal mask and a window exactly
/// as AttentionOptions applies them (see attn/mask.hpp), and of padding: keys j >=
/// key_length are hidden (-1 = no padding). For HeatmapOptions::visible.
inline Matrix<bool> visibility_matrix(Index q_length, Index k_length, Causal causal,
                                      Window window = {}, Index key_length = -1) {
  constexpr const char* function = "visibility_matrix";
  if (q_length < 0 || k_length < 0) {
    detail::throw_invalid_argument(
        function,
        "shape is " + detail::shape_string({q_length, k_length}) + ": lengths must be >= 0");
  }
  if (key_length < -1 || key_length > k_length) {
    detail::throw_invalid_argument(
        function,
        "key_length is " + std::to_string(key_length) +
            ": must be -1 (no padding) or lie in [0, Lk] with Lk = " + std::to_string(k_length));
  }
  std::vector<Index> key_lengths;
  if (key_length >= 0)
    key_lengths.push_back(key_length);
  const Mask<float> mask(function, 1, 1, q_length, k_length, causal, window, key_lengths, {}, {});
  Matrix<bool> visible(q_length, k_length);
  for (Index i = 0; i < q_length; ++i) {
    for (Index j = 0; j < k_length; ++j)
      visible(i, j) = mask.visible(0, 0, i, j);
  }
  return visible;
}

namespace detail::viz {

constexpr double tick_font = 11;
constexpr double axis_font = 12;
constexpr double panel_title_font = 13;
constexpr double title_font = 16;
constexpr double margin = 12;
constexpr double panel_gap = 20;
constexpr double bar_width = 14;
constexpr int levels = 64;  // colour levels of the merged-run encoding
constexpr const char* hidden_fill = "url(#attn-hidden)";
constexpr const char* nan_fill = "#e41a1c";
constexpr const char* dark_text = "#262626";

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

/// Everything a figure is drawn from: panels of (Lq, Lk) values in double.
struct Figure {
  std::vector<Matrix<double>> panels;  // each (Lq, Lk)
  std::vector<std::string> panel_titles;
  Index columns = 1;
};

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

/// Checks the options against weights of (Lq, Lk) = (q_length, k_length); `shape` is the
/// full shape of the weights for messages.
inline void validate(const char* function, const HeatmapOptions& o, Index q_length, Index k_length,
                     const std::string& shape) {
  if (q_length < 1 || k_length < 1) {
    throw_invalid_argument(function,
                           "weights are " + shape + ": need at least one query and one key");
  }
  const auto check_labels = [&](const std::vector<std::string>& labels, const char* name,
                                Index expected) {
    if (!labels.empty() && static_cast<Index>(labels.size()) != expected) {
      throw_invalid_argument(function, std::to_string(labels.size()) + " " + name +
                                           " for weights " + shape + ": need 0 or " +
                                           std::to_string(expected));
    }
  };
  check_labels(o.query_labels, "query_labels", q_length);
  check_labels(o.key_labels, "key_labels", k_length);
  if (o.visible.size() != 0 && (o.visible.rows() != q_length || o.visible.cols() != k_length)) {
    throw_invalid_argument(
        function, "visible is " + shape_string({o.visible.rows(), o.visible.cols()}) +
                      " but weights are " + shape +
                      ": need (Lq, Lk) = " + shape_string({q_length, k_length}) + " (or empty)");
  }
  if (o.decimals < 0 || o.decimals > 6) {
    throw_invalid_argument(function,
                           "decimals is " + std::to_string(o.decimals) + ": must lie in [0, 6]");
  }
  const auto check_at_least = [&](Index value, const char* name, Index minimum) {
    if (value < minimum) {
      throw_invalid_argument(function, std::string(name) + " is " + std::to_string(value) +
                                           ": must be >= " + std::to_string(minimum));
    }
  };
  check_at_least(o.cell_size, "cell_size", 1);
  check_at_least(o.max_plot_size, "max_plot_size", 1);
  check_at_least(o.annotate_limit, "annotate_limit", 0);
  check_at_least(o.cell_limit, "cell_limit", 0);
  check_at_least(o.max_ticks, "max_ticks", 0);
  check_at_least(o.columns, "columns", 0);
  const auto finite_or_unset = [](const std::optional<double>& v) {
    return !v || std::isfinite(*v);
  };
  if (!finite_or_unset(o.vmin) || !finite_or_unset(o.vmax) ||
      (o.vmin && o.vmax && !(*o.vmin < *o.vmax))) {
    throw_invalid_argument(function, "vmin is " + (o.vmin ? shortest(*o.vmin) : "unset") +
                                         " and vmax is " + (o.vmax ? shortest(*o.vmax) : "unset") +
                                         ": each must be finite or unset, and vmin < vmax");
  }
}

/// Draws the figure (validated already).
inline std::string render(const Figure& figure, const HeatmapOptions& o) {
  const Matrix<double>& first = figure.panels.front();
  const Index q_length = first.rows(), k_length = first.cols();
  const bool has_mask = o.visible.size() != 0;
  const auto visible = [&](Index i, Index j) { return !has_mask || o.visible(i, j); };

  // Colour range over visible finite values; hidden / NaN present?
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  bool any_hidden = false, any_nan = false;
  for (const Matrix<double>& panel : figure.panels) {
    for (Index i = 0; i < q_length; ++i) {
      for (Index j = 0; j < k_length; ++j) {
        if (!visible(i, j)) {
          any_hidden = true;
          continue;
        }
        const double v = panel(i, j);
        any_nan = any_nan || std::isnan(v);
        if (std::isfinite(v)) {
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
      }
    }
  }
  if (!(lo <= hi)) {  // no visible finite value
    lo = 0;
    hi = 1;
  } else if (lo == hi) {
    lo = std::min(lo, 0.0);
    hi = lo < hi ? hi : lo + 1;
  }
  double vmin = o.vmin.value_or(lo), vmax = o.vmax.value_or(hi);
  if (!(vmin < vmax)) {  // one end given, the data on the wrong side of it
    if (o.vmin)
      vmax = vmin + 1;
    else
      vmin = vmax - 1;
  }
  const auto scaled = [&](double v) { return (v - vmin) / (vmax - vmin); };

  // Geometry of one panel.
  const Index longest = std::max(q_length, k_length);
  const Index cell = std::min(o.cell_size, std::max(Index(1), o.max_plot_size / longest));
  const auto cs = static_cast<double>(cell);
  const double plot_w = cs * static_cast<double>(k_length);
  const double plot_h = cs * static_cast<double>(q_length);
  const auto panel_count = static_cast<Index>(figure.panels.size());
  // One <rect> per cell only while a panel is small and all panels together have at most
  // cell_limit^2 cells (12 heads of 128 x 128 would be 17 MB).
  const bool per_cell =
      longest <= o.cell_limit && panel_count * q_length * k_length <= o.cell_limit * o.cell_limit;
  const std::vector<std::string> q_labels = labels_or_indices(o.query_labels, q_length);
  const std::vector<std::string> k_labels = labels_or_indices(o.key_labels, k_length);

  // Values: the widest text decides the font; skip them when they would not be readable.
  bool annotate = per_cell && longest <= o.annotate_limit;
  double value_font = 0;
  if (annotate) {
    double widest = 0;
    std::string text;
    for (const Matrix<double>& panel : figure.panels) {
      for (Index i = 0; i < q_length; ++i) {
        for (Index j = 0; j < k_length; ++j) {
          text.clear();
          append_fixed(text, panel(i, j), o.decimals);
          widest = std::max(widest, text_width(text, 1.0));
        }
      }
    }
    value_font = std::min(12.0, 0.85 * cs / std::max(widest, 0.6));
    annotate = value_font >= 5.0;
  }

  // Ticks: every step-th token, at most max_ticks, at least a line apart.
  const auto min_pitch = static_cast<Index>(std::ceil(tick_font * 1.2 / cs));
  const auto tick_step = [&](Index n) {
    return o.max_ticks == 0 ? n + 1 : std::max({Index(1), ceil_div(n, o.max_ticks), min_pitch});
  };
  const Index q_step = tick_step(q_length), k_step = tick_step(k_length);
  double q_label_w = 0, k_label_w = 0;
  for (Index i = 0; i < q_length; i += q_step)
    q_label_w = std::max(q_label_w, text_width(q_labels[static_cast<std::size_t>(i)], tick_font));
  for (Index j = 0; j < k_length; j += k_step)
    k_label_w = std::max(k_label_w, text_width(k_labels[static_cast<std::size_t>(j)], tick_font));
  const bool rotate_keys = k_label_w + 4 > cs * static_cast<double>(k_step);

  const bool grid = figure.panels.size() > 1 || !figure.panel_titles.empty();
  const double panel_title_h = grid ? panel_title_font + 10 : 0;
  const double y_axis_w = o.query_axis.empty() ? 0 : axis_font + 8;
  const double plot_x = y_axis_w + (q_label_w > 0 ? q_label_w + 6 : 0);
  const double plot_y = panel_title_h;
  const double k_ticks_h = k_label_w > 0 ? (rotate_keys ? k_label_w + 6 : tick_font + 6) : 0;
  const double x_axis_h = o.key_axis.empty() ? 0 : axis_font + 8;
  const double panel_w = plot_x + plot_w + 4;
  const double panel_h = plot_y + plot_h + k_ticks_h + x_axis_h;

  const Index columns = std::min(figure.columns, panel_count);
  const Index rows = ceil_div(panel_count, columns);
  const double title_h = o.title.empty() ? 0 : title_font + 14;
  const double panels_w =
      static_cast<double>(columns) * panel_w + static_cast<double>(columns - 1) * panel_gap;
  const double panels_h =
      static_cast<double>(rows) * panel_h + static_cast<double>(rows - 1) * panel_gap;

  // Colour bar right of the first row's plot, 5 ticks (3 when short).
  const double bar_x = margin + panels_w + 16;
  const double bar_y = margin + title_h + plot_y;
  const double bar_h = std::max(plot_h, 100.0);
  const int bar_ticks = bar_h >= 150 ? 5 : 3;
  std::vector<std::string> bar_labels;
  double bar_label_w = 0;
  for (int t = 0; t < bar_ticks; ++t) {
    std::string text;
    append_fixed(text, vmin + (vmax - vmin) * t / (bar_ticks - 1), o.decimals);
    bar_label_w = std::max(bar_label_w, text_width(text, tick_font));
    bar_labels.push_back(std::move(text));
  }
  double legend_h = 0;
  double legend_w = 0;
  if (any_hidden) {
    legend_h += 20;
    legend_w = std::max(legend_w, 18 + text_width("masked", tick_font));
  }
  if (any_nan) {
    legend_h += 20;
    legend_w = std::max(legend_w, 18 + text_width("NaN", tick_font));
  }
  const double width = std::ceil(bar_x + std::max(bar_width + 6 + bar_label_w, legend_w) + margin);
  const double height = std::ceil(
      std::max(margin + title_h + panels_h, bar_y + bar_h + (legend_h > 0 ? 12 + legend_h : 0)) +
      margin);

  std::string svg;
  svg.reserve(per_cell ? 4096 + static_cast<std::size_t>(q_length * k_length) *
                                    static_cast<std::size_t>(panel_count) * 100
                       : 1 << 20);
  const auto num = [&](double v) { append_number(svg, v); };
  const auto text = [&](const std::string& s) { append_escaped(svg, s); };

  svg += "<?xml version='1.0' encoding='UTF-8'?>\n<svg xmlns='http://www.w3.org/2000/svg' ";
  svg += "width='";
  num(width);
  svg += "' height='";
  num(height);
  svg += "' viewBox='0 0 ";
  num(width);
  svg += ' ';
  num(height);
  svg += "' font-family='DejaVu Sans, Helvetica, Arial, sans-serif'>\n<title>";
  text(o.title.empty() ? std::string("attention heatmap") : o.title);
  svg +=
      "</title>\n<defs><pattern id='attn-hidden' width='6' height='6' "
      "patternUnits='userSpaceOnUse' patternTransform='rotate(45)'><rect width='6' "
      "height='6' fill='#f4f4f4'/><rect width='1.5' height='6' "
      "fill='#b0b0b0'/></pattern>\n<linearGradient id='attn-colorbar' x1='0' y1='1' "
      "x2='0' y2='0'>";
  for (int s = 0; s <= 8; ++s) {
    svg += "<stop offset='";
    num(12.5 * s);
    svg += "%' stop-color='";
    append_hex(svg, colormap_rgb(o.color_map, s / 8.0));
    svg += "'/>";
  }
  svg += "</linearGradient></defs>\n<rect class='background' width='100%' height='100%' ";
  svg += "fill='#ffffff'/>\n";
  if (!o.title.empty()) {
    svg += "<text class='title' x='";
    num(grid ? margin + panels_w / 2 : margin + plot_x + plot_w / 2);
    svg += "' y='";
    num(margin + title_font);
    svg += "' font-size='";
    num(title_font);
    svg += "' text-anchor='middle'>";
    text(o.title);
    svg += "</text>\n";
  }

  std::vector<std::string> runs;  // merged-run encoding: one path per colour level
  for (Index p = 0; p < panel_count; ++p) {
    const Matrix<double>& values = figure.panels[static_cast<std::size_t>(p)];
    const Index grid_row = p / columns, grid_column = p % columns;
    const double px = margin + static_cast<double>(grid_column) * (panel_w + panel_gap);
    const double py = margin + title_h + static_cast<double>(grid_row) * (panel_h + panel_gap);
    svg += "<g class='panel' transform='translate(";
    num(px);
    svg += ' ';
    num(py);
    svg += ")'>\n";
    if (grid) {
      svg += "<text class='panel-title' x='";
      num(plot_x + plot_w / 2);
      svg += "' y='";
      num(panel_title_font);
      svg += "' font-size='";
      num(panel_title_font);
      svg += "' text-anchor='middle'>";
      text(figure.panel_titles[static_cast<std::size_t>(p)]);
      svg += "</text>\n";
    }

    if (per_cell) {
      svg += "<g class='cells'>\n";
      for (Index i = 0; i < q_length; ++i) {
        for (Index j = 0; j < k_length; ++j) {
          const double v = values(i, j);
          svg += "<rect class='cell";
          if (!visible(i, j))
            svg += " hidden";
          else if (std::isnan(v))
            svg += " nan";
          svg += "' x='";
          num(plot_x + cs * static_cast<double>(j));
          svg += "' y='";
          num(plot_y + cs * static_cast<double>(i));
          svg += "' width='";
          num(cs);
          svg += "' height='";
          num(cs);
          svg += "' fill='";
          if (!visible(i, j))
            svg += hidden_fill;
          else if (std::isnan(v))
            svg += nan_fill;
          else
            append_hex(svg, colormap_rgb(o.color_map, scaled(v)));
          svg += "'/>\n";
        }
      }
      svg += "</g>\n";
      if (annotate) {
        svg += "<g class='values' font-size='";
        num(value_font);
        svg += "' text-anchor='middle'>\n";
        for (Index i = 0; i < q_length; ++i) {
          for (Index j = 0; j < k_length; ++j) {
            if (!visible(i, j))
              continue;
            const double v = values(i, j);
            const bool light =
                std::isnan(v) || luminance(colormap_rgb(o.color_map, scaled(v))) < 0.408;
            svg += "<text class='value' x='";
            num(plot_x + cs * (static_cast<double>(j) + 0.5));
            svg += "' y='";
            num(plot_y + cs * (static_cast<double>(i) + 0.5));
            svg += "' dy='0.35em' fill='";
            svg += light ? "#ffffff" : dark_text;
            svg += "'>";
            append_fixed(svg, v, o.decimals);
            svg += "</text>\n";
          }
        }
        svg += "</g>\n";
      }
    } else {
      // Runs of equal colour level along each row, one stroked path per level: "M x y" to
      // the first run's start (y at the cell's middle), "h w" along it, "m dx dy" from the
      // end of one run to the start of the next.
      constexpr int hidden_key = levels, nan_key = levels + 1;
      constexpr auto keys = static_cast<std::size_t>(levels) + 2;
      runs.assign(keys, std::string());
      std::vector<std::array<Index, 2>> pen(keys, std::array<Index, 2>{-1, -1});  // end of last run
      const auto key_of = [&](Index i, Index j) {
        if (!visible(i, j))
          return hidden_key;
        const double v = values(i, j);
        if (std::isnan(v))
          return nan_key;
        const double t = std::clamp(scaled(v), 0.0, 1.0);
        return std::min(levels - 1, static_cast<int>(t * levels));
      };
      for (Index i = 0; i < q_length; ++i) {
        Index j = 0;
        while (j < k_length) {
          const int key = key_of(i, j);
          Index end = j + 1;
          while (end < k_length && key_of(i, end) == key)
            ++end;
          std::string& d = runs[static_cast<std::size_t>(key)];
          auto& at = pen[static_cast<std::size_t>(key)];  // in cells
          if (at[0] < 0) {
            d += 'M';
            append_number(d, plot_x + cs * static_cast<double>(j));
            d += ' ';
            append_number(d, plot_y + cs * (static_cast<double>(i) + 0.5));
          } else {
            d += 'm';
            append_int(d, (j - at[0]) * cell);
            d += ' ';
            append_int(d, (i - at[1]) * cell);
          }
          d += 'h';
          append_int(d, (end - j) * cell);
          at = {end, i};
          j = end;
        }
      }
      svg += "<g class='cells' fill='none' stroke-width='";
      num(cs);
      svg += "' shape-rendering='crispEdges'>\n";
      for (int key = 0; key < levels + 2; ++key) {
        const std::string& d = runs[static_cast<std::size_t>(key)];
        if (d.empty())
          continue;
        svg += "<path class='cells";
        svg += key == hidden_key ? " hidden" : key == nan_key ? " nan" : "";
        svg += "' stroke='";
        if (key == hidden_key)
          svg += hidden_fill;
        else if (key == nan_key)
          svg += nan_fill;
        else
          append_hex(svg, colormap_rgb(o.color_map, (key + 0.5) / levels));
        svg += "' d='";
        svg += d;
        svg += "'/>\n";
      }
      svg += "</g>\n";
    }
    svg += "<rect class='frame' x='";
    num(plot_x);
    svg += "' y='";
    num(plot_y);
    svg += "' width='";
    num(plot_w);
    svg += "' height='";
    num(plot_h);
    svg += "' fill='none' stroke='#9e9e9e' stroke-width='0.5'/>\n";

    // Tick labels.
    if (q_label_w > 0) {
      svg += "<g class='query-labels' font-size='";
      num(tick_font);
      svg += "' text-anchor='end'>\n";
      for (Index i = 0; i < q_length; i += q_step) {
        svg += "<text class='query-label' x='";
        num(plot_x - 4);
        svg += "' y='";
        num(plot_y + cs * (static_cast<double>(i) + 0.5));
        svg += "' dy='0.35em'>";
        text(q_labels[static_cast<std::size_t>(i)]);
        svg += "</text>\n";
      }
      svg += "</g>\n";
    }
    if (k_label_w > 0) {
      svg += "<g class='key-labels' font-size='";
      num(tick_font);
      svg += rotate_keys ? "' text-anchor='end'>\n" : "' text-anchor='middle'>\n";
      for (Index j = 0; j < k_length; j += k_step) {
        const double x = plot_x + cs * (static_cast<double>(j) + 0.5);
        const double y = plot_y + plot_h + 4;
        svg += "<text class='key-label' x='";
        num(x);
        svg += "' y='";
        num(rotate_keys ? y : y + tick_font);
        if (rotate_keys) {
          svg += "' dy='0.35em' transform='rotate(-90 ";
          num(x);
          svg += ' ';
          num(y);
          svg += ')';
        }
        svg += "'>";
        text(k_labels[static_cast<std::size_t>(j)]);
        svg += "</text>\n";
      }
      svg += "</g>\n";
    }
    if (!o.key_axis.empty()) {
      svg += "<text class='axis-label' x='";
      num(plot_x + plot_w / 2);
      svg += "' y='";
      num(plot_y + plot_h + k_ticks_h + axis_font + 2);
      svg += "' font-size='";
      num(axis_font);
      svg += "' text-anchor='middle'>";
      text(o.key_axis);
      svg += "</text>\n";
    }
    if (!o.query_axis.empty()) {
      const double x = axis_font;
      const double y = plot_y + plot_h / 2;
      svg += "<text class='axis-label' x='";
      num(x);
      svg += "' y='";
      num(y);
      svg += "' font-size='";
      num(axis_font);
      svg += "' text-anchor='middle' transform='rotate(-90 ";
      num(x);
      svg += ' ';
      num(y);
      svg += ")'>";
      text(o.query_axis);
      svg += "</text>\n";
    }
    svg += "</g>\n";
  }

  // Colour bar: the gradient of the 9 anchors, ticks, and a legend for masked / NaN cells.
  svg += "<g class='colorbar' font-size='";
  num(tick_font);
  svg += "'>\n<rect x='";
  num(bar_x);
  svg += "' y='";
  num(bar_y);
  svg += "' width='";
  num(bar_width);
  svg += "' height='";
  num(bar_h);
  svg += "' fill='url(#attn-colorbar)' stroke='#9e9e9e' stroke-width='0.5'/>\n";
  for (int t = 0; t < bar_ticks; ++t) {
    const double y = bar_y + bar_h - bar_h * t / (bar_ticks - 1);
    svg += "<text x='";
    num(bar_x + bar_width + 6);
    svg += "' y='";
    num(y);
    svg += "' dy='0.35em'>";
    svg += bar_labels[static_cast<std::size_t>(t)];
    svg += "</text>\n";
  }
  double legend_y = bar_y + bar_h + 12;
  const auto legend = [&](const char* fill, const char* label) {
    svg += "<rect x='";
    num(bar_x);
    svg += "' y='";
    num(legend_y);
    svg += "' width='14' height='14' fill='";
    svg += fill;
    svg += "' stroke='#9e9e9e' stroke-width='0.5'/><text x='";
    num(bar_x + 18);
    svg += "' y='";
    num(legend_y + 7);
    svg += "' dy='0.35em'>";
    svg += label;
    svg += "</text>\n";
    legend_y += 20;
  };
  if (any_hidden)
    legend(hidden_fill, "masked");
  if (any_nan)
    legend(nan_fill, "NaN");
  svg += "</g>\n</svg>\n";
  return svg;
}

inline void write_file(const char* function, const std::filesystem::path& path,
                       const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out)
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
  if (!out)
    throw std::runtime_error(std::string(function) + ": cannot write '" + path.string() + "'");
}

template <class Derived>
std::string heatmap_svg(const char* function, const Eigen::DenseBase<Derived>& weights,
                        const HeatmapOptions& options) {
  static_assert(std::is_arithmetic_v<typename Derived::Scalar>,
                "attention_heatmap_svg: weights must hold real numbers");
  validate(function, options, weights.rows(), weights.cols(),
           shape_string({weights.rows(), weights.cols()}));
  Figure figure;
  Matrix<double> values(weights.rows(), weights.cols());  // (Lq, Lk)
  for (Index i = 0; i < values.rows(); ++i) {
    for (Index j = 0; j < values.cols(); ++j)
      values(i, j) = static_cast<double>(weights.derived().coeff(i, j));
  }
  figure.panels.push_back(std::move(values));
  return render(figure, options);
}

template <class Weights>
std::string heads_svg(const char* function, const Weights& weights, Index batch_index,
                      const HeatmapOptions& options) {
  static_assert(is_rank4_tensor_v<Weights>,
                "attention_heads_svg: weights must be a rank-4 (B, H, Lq, Lk) Tensor, TensorMap "
                "or HeadsView");
  const auto view = as_heads_view(weights);  // (B, H, Lq, Lk)
  const std::string shape = shape_string({view.batch, view.heads, view.length, view.dim});
  if (view.batch < 1 || view.heads < 1) {
    throw_invalid_argument(function,
                           "weights are " + shape + ": need at least one batch entry and one head");
  }
  validate(function, options, view.length, view.dim, shape);
  if (batch_index < 0 || batch_index >= view.batch) {
    throw_invalid_argument(function, "batch index is " + std::to_string(batch_index) +
                                         " but weights are " + shape + ": must lie in [0, " +
                                         std::to_string(view.batch) + ")");
  }
  if (!options.panel_titles.empty() &&
      static_cast<Index>(options.panel_titles.size()) != view.heads) {
    throw_invalid_argument(function, std::to_string(options.panel_titles.size()) +
                                         " panel_titles for weights " + shape + ": need 0 or " +
                                         std::to_string(view.heads));
  }
  Figure figure;
  for (Index h = 0; h < view.heads; ++h) {
    figure.panels.push_back(Matrix<double>(view.head(batch_index, h).template cast<double>()));
    figure.panel_titles.push_back(options.panel_titles.empty()
                                      ? "head " + std::to_string(h)
                                      : options.panel_titles[static_cast<std::size_t>(h)]);
  }
  figure.columns =
      options.columns > 0
          ? options.columns
          : static_cast<Index>(std::ceil(std::sqrt(static_cast<double>(view.heads)) - 1e-9));
  return render(figure, options);
}

}  // namespace detail::viz

/// SVG heatmap of one attention matrix: weights (Lq, Lk), any Eigen matrix or array of real
/// numbers; queries are rows (y axis), keys columns (x axis). Throws std::invalid_argument
/// for empty weights, label counts other than 0 or Lq / Lk, a `visible` of another shape
/// and options out of range.
template <class Derived>
std::string attention_heatmap_svg(const Eigen::DenseBase<Derived>& weights,
                                  const HeatmapOptions& options = {}) {
  return detail::viz::heatmap_svg("attention_heatmap_svg", weights, options);
}

/// SVG grid of heatmaps, one panel per head, of batch entry `batch_index` of weights
/// (B, H, Lq, Lk): a Tensor<T, 4>, TensorMap or HeadsView (MultiHeadAttentionOutput::weights).
/// One colour scale and one colour bar for all heads; `options.visible` (Lq, Lk) applies to
/// every head.
template <class Weights>
std::string attention_heads_svg(const Weights& weights, Index batch_index,
                                const HeatmapOptions& options = {}) {
  return detail::viz::heads_svg("attention_heads_svg", weights, batch_index, options);
}

/// attention_heatmap_svg written to `path`; throws std::runtime_error if it cannot be.
template <class Derived>
void write_attention_heatmap(const std::filesystem::path& path,
                             const Eigen::DenseBase<Derived>& weights,
                             const HeatmapOptions& options = {}) {
  constexpr const char* function = "write_attention_heatmap";
  detail::viz::write_file(function, path, detail::viz::heatmap_svg(function, weights, options));
}

/// attention_heads_svg written to `path`; throws std::runtime_error if it cannot be.
template <class Weights>
void write_attention_heads(const std::filesystem::path& path, const Weights& weights,
                           Index batch_index, const HeatmapOptions& options = {}) {
  constexpr const char* function = "write_attention_heads";
  detail::viz::write_file(function, path,
                          detail::viz::heads_svg(function, weights, batch_index, options));
}

}  // namespace attn
