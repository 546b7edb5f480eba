// attn/viz/heatmap_options.hpp: how a heatmap is drawn (attn/viz.hpp): HeatmapOptions, the
// colour maps and colormap_rgb.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attn/config.hpp"
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

}  // namespace attn
