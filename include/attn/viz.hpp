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
//
// The parts: viz/heatmap_options.hpp (the options and colour maps), viz/svg_text.hpp
// (numbers and text as SVG), viz/layout.hpp (the colour scale and where everything goes),
// viz/render.hpp (the emitters, one per part of the figure); this header checks the
// arguments and calls render().
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/mask.hpp"
#include "attn/tensor.hpp"
#include "attn/viz/heatmap_options.hpp"
#include "attn/viz/render.hpp"
#include "attn/viz/svg_text.hpp"

namespace attn {

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
  const Mask mask(function, 1, 1, q_length, k_length, causal, window, key_lengths);
  Matrix<bool> visible(q_length, k_length);
  for (Index i = 0; i < q_length; ++i) {
    for (Index j = 0; j < k_length; ++j)
      visible(i, j) = mask.visible(0, 0, i, j);
  }
  return visible;
}

namespace detail::viz {

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
