// attn/viz/layout.hpp: the layout step of the heatmaps (attn/viz.hpp): the figure to draw,
// its colour scale, and where every part goes, in SVG pixels, before any SVG is written.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/tensor.hpp"
#include "attn/viz/heatmap_options.hpp"
#include "attn/viz/svg_text.hpp"

namespace attn::detail::viz {

constexpr double tick_font = 11;
constexpr double axis_font = 12;
constexpr double panel_title_font = 13;
constexpr double title_font = 16;
constexpr double margin = 12;
constexpr double panel_gap = 20;
constexpr double bar_width = 14;

/// Everything a figure is drawn from: panels of (Lq, Lk) values in double.
struct Figure {
  std::vector<Matrix<double>> panels;  // each (Lq, Lk)
  std::vector<std::string> panel_titles;
  Index columns = 1;
};

/// Whether query i may see key j (HeatmapOptions::visible; empty = every cell).
inline bool cell_visible(const HeatmapOptions& o, Index i, Index j) {
  return o.visible.size() == 0 || o.visible(i, j);
}

/// The colour scale, [vmin, vmax] mapped to [0, 1], and whether the figure has hidden or NaN
/// cells (each gets a legend entry).
struct ColourScale {
  double vmin = 0, vmax = 1;
  bool any_hidden = false, any_nan = false;
  double operator()(double v) const { return (v - vmin) / (vmax - vmin); }
};

/// The range of the visible finite values, unless the options fix an end.
inline ColourScale colour_scale(const Figure& figure, const HeatmapOptions& o) {
  const Index q_length = figure.panels.front().rows(), k_length = figure.panels.front().cols();
  ColourScale scale;

  // Colour range over visible finite values; hidden / NaN present?
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const Matrix<double>& panel : figure.panels) {
    for (Index i = 0; i < q_length; ++i) {
      for (Index j = 0; j < k_length; ++j) {
        if (!cell_visible(o, i, j)) {
          scale.any_hidden = true;
          continue;
        }
        const double v = panel(i, j);
        scale.any_nan = scale.any_nan || std::isnan(v);
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
  scale.vmin = o.vmin.value_or(lo);
  scale.vmax = o.vmax.value_or(hi);
  if (!(scale.vmin < scale.vmax)) {  // one end given, the data on the wrong side of it
    if (o.vmin)
      scale.vmax = scale.vmin + 1;
    else
      scale.vmin = scale.vmax - 1;
  }
  return scale;
}

/// Where everything goes: one panel's plot, tick labels and axis names, the grid of panels,
/// the colour bar and its legend, and the size of the whole figure.
struct Layout {
  Index q_length = 0, k_length = 0;
  Index panel_count = 0, columns = 1;
  Index cell = 1;  ///< side of a cell in pixels (cs as a double)
  double cs = 1;
  double plot_x = 0, plot_y = 0, plot_w = 0, plot_h = 0;  ///< the plot within a panel
  double panel_w = 0, panel_h = 0, panels_w = 0, title_h = 0;
  bool per_cell = false;  ///< one <rect> per cell, else merged runs
  bool annotate = false;  ///< values printed in the cells, at value_font
  double value_font = 0;
  bool grid = false;  ///< panels with titles (the heads grid)
  std::vector<std::string> q_labels, k_labels;
  Index q_step = 1, k_step = 1;  ///< every step-th label is drawn
  double q_label_w = 0, k_label_w = 0, k_ticks_h = 0;
  bool rotate_keys = false;  ///< key labels vertical
  double bar_x = 0, bar_y = 0, bar_h = 0;
  std::vector<std::string> bar_labels;  ///< the colour bar's ticks, bottom to top
  double width = 0, height = 0;
};

/// Lays out `figure` (validated already) with the colour bar of `scale`.
inline Layout layout_figure(const Figure& figure, const HeatmapOptions& o,
                            const ColourScale& scale) {
  Layout l;
  const Matrix<double>& first = figure.panels.front();
  l.q_length = first.rows();
  l.k_length = first.cols();
  const double vmin = scale.vmin, vmax = scale.vmax;

  // Geometry of one panel.
  const Index longest = std::max(l.q_length, l.k_length);
  l.cell = std::min(o.cell_size, std::max(Index(1), o.max_plot_size / longest));
  l.cs = static_cast<double>(l.cell);
  l.plot_w = l.cs * static_cast<double>(l.k_length);
  l.plot_h = l.cs * static_cast<double>(l.q_length);
  l.panel_count = static_cast<Index>(figure.panels.size());
  // One <rect> per cell only while a panel is small and all panels together have at most
  // cell_limit^2 cells (12 heads of 128 x 128 would be 17 MB).
  l.per_cell = longest <= o.cell_limit &&
               l.panel_count * l.q_length * l.k_length <= o.cell_limit * o.cell_limit;
  l.q_labels = labels_or_indices(o.query_labels, l.q_length);
  l.k_labels = labels_or_indices(o.key_labels, l.k_length);

  // Values: the widest text decides the font; skip them when they would not be readable.
  l.annotate = l.per_cell && longest <= o.annotate_limit;
  if (l.annotate) {
    double widest = 0;
    std::string text;
    for (const Matrix<double>& panel : figure.panels) {
      for (Index i = 0; i < l.q_length; ++i) {
        for (Index j = 0; j < l.k_length; ++j) {
          text.clear();
          append_fixed(text, panel(i, j), o.decimals);
          widest = std::max(widest, text_width(text, 1.0));
        }
      }
    }
    l.value_font = std::min(12.0, 0.85 * l.cs / std::max(widest, 0.6));
    l.annotate = l.value_font >= 5.0;
  }

  // Ticks: every step-th token, at most max_ticks, at least a line apart.
  const auto min_pitch = static_cast<Index>(std::ceil(tick_font * 1.2 / l.cs));
  const auto tick_step = [&](Index n) {
    return o.max_ticks == 0 ? n + 1 : std::max({Index(1), ceil_div(n, o.max_ticks), min_pitch});
  };
  l.q_step = tick_step(l.q_length);
  l.k_step = tick_step(l.k_length);
  for (Index i = 0; i < l.q_length; i += l.q_step)
    l.q_label_w =
        std::max(l.q_label_w, text_width(l.q_labels[static_cast<std::size_t>(i)], tick_font));
  for (Index j = 0; j < l.k_length; j += l.k_step)
    l.k_label_w =
        std::max(l.k_label_w, text_width(l.k_labels[static_cast<std::size_t>(j)], tick_font));
  l.rotate_keys = l.k_label_w + 4 > l.cs * static_cast<double>(l.k_step);

  l.grid = figure.panels.size() > 1 || !figure.panel_titles.empty();
  const double panel_title_h = l.grid ? panel_title_font + 10 : 0;
  const double y_axis_w = o.query_axis.empty() ? 0 : axis_font + 8;
  l.plot_x = y_axis_w + (l.q_label_w > 0 ? l.q_label_w + 6 : 0);
  l.plot_y = panel_title_h;
  l.k_ticks_h = l.k_label_w > 0 ? (l.rotate_keys ? l.k_label_w + 6 : tick_font + 6) : 0;
  const double x_axis_h = o.key_axis.empty() ? 0 : axis_font + 8;
  l.panel_w = l.plot_x + l.plot_w + 4;
  l.panel_h = l.plot_y + l.plot_h + l.k_ticks_h + x_axis_h;

  l.columns = std::min(figure.columns, l.panel_count);
  const Index rows = ceil_div(l.panel_count, l.columns);
  l.title_h = o.title.empty() ? 0 : title_font + 14;
  l.panels_w =
      static_cast<double>(l.columns) * l.panel_w + static_cast<double>(l.columns - 1) * panel_gap;
  const double panels_h =
      static_cast<double>(rows) * l.panel_h + static_cast<double>(rows - 1) * panel_gap;

  // Colour bar right of the first row's plot, 5 ticks (3 when short).
  l.bar_x = margin + l.panels_w + 16;
  l.bar_y = margin + l.title_h + l.plot_y;
  l.bar_h = std::max(l.plot_h, 100.0);
  const int bar_ticks = l.bar_h >= 150 ? 5 : 3;
  double bar_label_w = 0;
  for (int t = 0; t < bar_ticks; ++t) {
    std::string text;
    append_fixed(text, vmin + (vmax - vmin) * t / (bar_ticks - 1), o.decimals);
    bar_label_w = std::max(bar_label_w, text_width(text, tick_font));
    l.bar_labels.push_back(std::move(text));
  }
  double legend_h = 0;
  double legend_w = 0;
  if (scale.any_hidden) {
    legend_h += 20;
    legend_w = std::max(legend_w, 18 + text_width("masked", tick_font));
  }
  if (scale.any_nan) {
    legend_h += 20;
    legend_w = std::max(legend_w, 18 + text_width("NaN", tick_font));
  }
  l.width = std::ceil(l.bar_x + std::max(bar_width + 6 + bar_label_w, legend_w) + margin);
  l.height = std::ceil(std::max(margin + l.title_h + panels_h,
                                l.bar_y + l.bar_h + (legend_h > 0 ? 12 + legend_h : 0)) +
                       margin);

  return l;
}

}  // namespace attn::detail::viz
