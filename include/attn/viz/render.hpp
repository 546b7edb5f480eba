// attn/viz/render.hpp: the emitters of the heatmaps (attn/viz.hpp): each writes one part of
// the SVG from the layout (attn/viz/layout.hpp), and render() puts them in order.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/tensor.hpp"
#include "attn/viz/heatmap_options.hpp"
#include "attn/viz/layout.hpp"
#include "attn/viz/svg_text.hpp"

namespace attn::detail::viz {

constexpr int levels = 64;  // colour levels of the merged-run encoding
constexpr const char* hidden_fill = "url(#attn-hidden)";
constexpr const char* nan_fill = "#e41a1c";
constexpr const char* dark_text = "#262626";

/// The XML prologue, the hatch pattern and colour-bar gradient, the background and title.
inline void append_prologue(std::string& svg, const Layout& l, const HeatmapOptions& o) {
  const auto num = [&](double v) { append_number(svg, v); };
  const auto text = [&](const std::string& s) { append_escaped(svg, s); };
  svg += "<?xml version='1.0' encoding='UTF-8'?>\n<svg xmlns='http://www.w3.org/2000/svg' ";
  svg += "width='";
  num(l.width);
  svg += "' height='";
  num(l.height);
  svg += "' viewBox='0 0 ";
  num(l.width);
  svg += ' ';
  num(l.height);
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
    num(l.grid ? margin + l.panels_w / 2 : margin + l.plot_x + l.plot_w / 2);
    svg += "' y='";
    num(margin + title_font);
    svg += "' font-size='";
    num(title_font);
    svg += "' text-anchor='middle'>";
    text(o.title);
    svg += "</text>\n";
  }
}

/// One <rect> per cell of `values` (Lq, Lk), and the values in them when annotated.
inline void append_cell_rects(std::string& svg, const Matrix<double>& values, const Layout& l,
                              const HeatmapOptions& o, const ColourScale& scaled) {
  const auto num = [&](double v) { append_number(svg, v); };
  svg += "<g class='cells'>\n";
  for (Index i = 0; i < l.q_length; ++i) {
    for (Index j = 0; j < l.k_length; ++j) {
      const double v = values(i, j);
      svg += "<rect class='cell";
      if (!cell_visible(o, i, j))
        svg += " hidden";
      else if (std::isnan(v))
        svg += " nan";
      svg += "' x='";
      num(l.plot_x + l.cs * static_cast<double>(j));
      svg += "' y='";
      num(l.plot_y + l.cs * static_cast<double>(i));
      svg += "' width='";
      num(l.cs);
      svg += "' height='";
      num(l.cs);
      svg += "' fill='";
      if (!cell_visible(o, i, j))
        svg += hidden_fill;
      else if (std::isnan(v))
        svg += nan_fill;
      else
        append_hex(svg, colormap_rgb(o.color_map, scaled(v)));
      svg += "'/>\n";
    }
  }
  svg += "</g>\n";
  if (l.annotate) {
    svg += "<g class='values' font-size='";
    num(l.value_font);
    svg += "' text-anchor='middle'>\n";
    for (Index i = 0; i < l.q_length; ++i) {
      for (Index j = 0; j < l.k_length; ++j) {
        if (!cell_visible(o, i, j))
          continue;
        const double v = values(i, j);
        const bool light = std::isnan(v) || luminance(colormap_rgb(o.color_map, scaled(v))) < 0.408;
        svg += "<text class='value' x='";
        num(l.plot_x + l.cs * (static_cast<double>(j) + 0.5));
        svg += "' y='";
        num(l.plot_y + l.cs * (static_cast<double>(i) + 0.5));
        svg += "' dy='0.35em' fill='";
        svg += light ? "#ffffff" : dark_text;
        svg += "'>";
        append_fixed(svg, v, o.decimals);
        svg += "</text>\n";
      }
    }
    svg += "</g>\n";
  }
}

/// The cells of `values` (Lq, Lk) as runs of equal colour level along each row, one stroked
/// path per level: "M x y" to the first run's start (y at the cell's middle), "h w" along it,
/// "m dx dy" from the end of one run to the start of the next. `runs` is scratch (one path
/// per level), kept by the caller across panels.
inline void append_cell_runs(std::string& svg, const Matrix<double>& values, const Layout& l,
                             const HeatmapOptions& o, const ColourScale& scaled,
                             std::vector<std::string>& runs) {
  const auto num = [&](double v) { append_number(svg, v); };
  constexpr int hidden_key = levels, nan_key = levels + 1;
  constexpr auto keys = static_cast<std::size_t>(levels) + 2;
  runs.assign(keys, std::string());
  std::vector<std::array<Index, 2>> pen(keys, std::array<Index, 2>{-1, -1});  // end of last run
  const auto key_of = [&](Index i, Index j) {
    if (!cell_visible(o, i, j))
      return hidden_key;
    const double v = values(i, j);
    if (std::isnan(v))
      return nan_key;
    const double t = std::clamp(scaled(v), 0.0, 1.0);
    return std::min(levels - 1, static_cast<int>(t * levels));
  };
  for (Index i = 0; i < l.q_length; ++i) {
    Index j = 0;
    while (j < l.k_length) {
      const int key = key_of(i, j);
      Index end = j + 1;
      while (end < l.k_length && key_of(i, end) == key)
        ++end;
      std::string& d = runs[static_cast<std::size_t>(key)];
      auto& at = pen[static_cast<std::size_t>(key)];  // in cells
      if (at[0] < 0) {
        d += 'M';
        append_number(d, l.plot_x + l.cs * static_cast<double>(j));
        d += ' ';
        append_number(d, l.plot_y + l.cs * (static_cast<double>(i) + 0.5));
      } else {
        d += 'm';
        append_int(d, (j - at[0]) * l.cell);
        d += ' ';
        append_int(d, (i - at[1]) * l.cell);
      }
      d += 'h';
      append_int(d, (end - j) * l.cell);
      at = {end, i};
      j = end;
    }
  }
  svg += "<g class='cells' fill='none' stroke-width='";
  num(l.cs);
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

/// A panel's frame, tick labels and axis names.
inline void append_frame_and_ticks(std::string& svg, const Layout& l, const HeatmapOptions& o) {
  const auto num = [&](double v) { append_number(svg, v); };
  const auto text = [&](const std::string& s) { append_escaped(svg, s); };
  svg += "<rect class='frame' x='";
  num(l.plot_x);
  svg += "' y='";
  num(l.plot_y);
  svg += "' width='";
  num(l.plot_w);
  svg += "' height='";
  num(l.plot_h);
  svg += "' fill='none' stroke='#9e9e9e' stroke-width='0.5'/>\n";

  // Tick labels.
  if (l.q_label_w > 0) {
    svg += "<g class='query-labels' font-size='";
    num(tick_font);
    svg += "' text-anchor='end'>\n";
    for (Index i = 0; i < l.q_length; i += l.q_step) {
      svg += "<text class='query-label' x='";
      num(l.plot_x - 4);
      svg += "' y='";
      num(l.plot_y + l.cs * (static_cast<double>(i) + 0.5));
      svg += "' dy='0.35em'>";
      text(l.q_labels[static_cast<std::size_t>(i)]);
      svg += "</text>\n";
    }
    svg += "</g>\n";
  }
  if (l.k_label_w > 0) {
    svg += "<g class='key-labels' font-size='";
    num(tick_font);
    svg += l.rotate_keys ? "' text-anchor='end'>\n" : "' text-anchor='middle'>\n";
    for (Index j = 0; j < l.k_length; j += l.k_step) {
      const double x = l.plot_x + l.cs * (static_cast<double>(j) + 0.5);
      const double y = l.plot_y + l.plot_h + 4;
      svg += "<text class='key-label' x='";
      num(x);
      svg += "' y='";
      num(l.rotate_keys ? y : y + tick_font);
      if (l.rotate_keys) {
        svg += "' dy='0.35em' transform='rotate(-90 ";
        num(x);
        svg += ' ';
        num(y);
        svg += ')';
      }
      svg += "'>";
      text(l.k_labels[static_cast<std::size_t>(j)]);
      svg += "</text>\n";
    }
    svg += "</g>\n";
  }
  if (!o.key_axis.empty()) {
    svg += "<text class='axis-label' x='";
    num(l.plot_x + l.plot_w / 2);
    svg += "' y='";
    num(l.plot_y + l.plot_h + l.k_ticks_h + axis_font + 2);
    svg += "' font-size='";
    num(axis_font);
    svg += "' text-anchor='middle'>";
    text(o.key_axis);
    svg += "</text>\n";
  }
  if (!o.query_axis.empty()) {
    const double x = axis_font;
    const double y = l.plot_y + l.plot_h / 2;
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
}

/// The colour bar: the gradient of the 9 anchors, ticks, and a legend for masked / NaN cells.
inline void append_colorbar(std::string& svg, const Layout& l, const ColourScale& scale) {
  const auto num = [&](double v) { append_number(svg, v); };
  const int bar_ticks = static_cast<int>(l.bar_labels.size());
  svg += "<g class='colorbar' font-size='";
  num(tick_font);
  svg += "'>\n<rect x='";
  num(l.bar_x);
  svg += "' y='";
  num(l.bar_y);
  svg += "' width='";
  num(bar_width);
  svg += "' height='";
  num(l.bar_h);
  svg += "' fill='url(#attn-colorbar)' stroke='#9e9e9e' stroke-width='0.5'/>\n";
  for (int t = 0; t < bar_ticks; ++t) {
    const double y = l.bar_y + l.bar_h - l.bar_h * t / (bar_ticks - 1);
    svg += "<text x='";
    num(l.bar_x + bar_width + 6);
    svg += "' y='";
    num(y);
    svg += "' dy='0.35em'>";
    svg += l.bar_labels[static_cast<std::size_t>(t)];
    svg += "</text>\n";
  }
  double legend_y = l.bar_y + l.bar_h + 12;
  const auto legend = [&](const char* fill, const char* label) {
    svg += "<rect x='";
    num(l.bar_x);
    svg += "' y='";
    num(legend_y);
    svg += "' width='14' height='14' fill='";
    svg += fill;
    svg += "' stroke='#9e9e9e' stroke-width='0.5'/><text x='";
    num(l.bar_x + 18);
    svg += "' y='";
    num(legend_y + 7);
    svg += "' dy='0.35em'>";
    svg += label;
    svg += "</text>\n";
    legend_y += 20;
  };
  if (scale.any_hidden)
    legend(hidden_fill, "masked");
  if (scale.any_nan)
    legend(nan_fill, "NaN");
  svg += "</g>\n</svg>\n";
}

/// Draws the figure (validated already).
inline std::string render(const Figure& figure, const HeatmapOptions& o) {
  const ColourScale scale = colour_scale(figure, o);
  const Layout l = layout_figure(figure, o, scale);
  std::string svg;
  svg.reserve(l.per_cell ? 4096 + static_cast<std::size_t>(l.q_length * l.k_length) *
                                      static_cast<std::size_t>(l.panel_count) * 100
                         : 1 << 20);
  const auto num = [&](double v) { append_number(svg, v); };
  const auto text = [&](const std::string& s) { append_escaped(svg, s); };
  append_prologue(svg, l, o);
  std::vector<std::string> runs;  // merged-run encoding: one path per colour level
  for (Index p = 0; p < l.panel_count; ++p) {
    const Matrix<double>& values = figure.panels[static_cast<std::size_t>(p)];
    const Index grid_row = p / l.columns, grid_column = p % l.columns;
    const double px = margin + static_cast<double>(grid_column) * (l.panel_w + panel_gap);
    const double py = margin + l.title_h + static_cast<double>(grid_row) * (l.panel_h + panel_gap);
    svg += "<g class='panel' transform='translate(";
    num(px);
    svg += ' ';
    num(py);
    svg += ")'>\n";
    if (l.grid) {
      svg += "<text class='panel-title' x='";
      num(l.plot_x + l.plot_w / 2);
      svg += "' y='";
      num(panel_title_font);
      svg += "' font-size='";
      num(panel_title_font);
      svg += "' text-anchor='middle'>";
      text(figure.panel_titles[static_cast<std::size_t>(p)]);
      svg += "</text>\n";
    }

    if (l.per_cell)
      append_cell_rects(svg, values, l, o, scale);
    else
      append_cell_runs(svg, values, l, o, scale, runs);
    append_frame_and_ticks(svg, l, o);
    svg += "</g>\n";
  }
  append_colorbar(svg, l, scale);
  return svg;
}

}  // namespace attn::detail::viz
