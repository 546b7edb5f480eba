// Tests for attn/viz.hpp: every SVG is parsed by a real XML parser (tinyxml2), then its
// cells, values, labels, colours, hidden and NaN cells, head panels and the size of large
// maps are checked; every error path by its exact message.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <tinyxml2.h>

#include <attn/viz.hpp>

using attn::Index;

namespace {

/// A parsed SVG; fails the test if the text is not well-formed XML with an <svg> root.
struct Svg {
  tinyxml2::XMLDocument doc;
  explicit Svg(const std::string& text) {
    const tinyxml2::XMLError status = doc.Parse(text.c_str(), text.size());
    INFO(doc.ErrorStr());
    REQUIRE(status == tinyxml2::XML_SUCCESS);
    REQUIRE(doc.RootElement() != nullptr);
    REQUIRE(std::string(doc.RootElement()->Name()) == "svg");
    REQUIRE(std::string(doc.RootElement()->Attribute("xmlns")) == "http://www.w3.org/2000/svg");
  }
  const tinyxml2::XMLElement* root() const { return doc.RootElement(); }
};

bool has_class(const tinyxml2::XMLElement* e, const std::string& name) {
  const char* value = e->Attribute("class");
  if (value == nullptr)
    return false;
  std::istringstream words(value);
  std::string word;
  while (words >> word) {
    if (word == name)
      return true;
  }
  return false;
}

/// Every element under `e` (depth first, document order) that has class `name`.
void collect(const tinyxml2::XMLElement* e, const std::string& name,
             std::vector<const tinyxml2::XMLElement*>& out) {
  for (const tinyxml2::XMLElement* c = e->FirstChildElement(); c != nullptr;
       c = c->NextSiblingElement()) {
    if (has_class(c, name))
      out.push_back(c);
    collect(c, name, out);
  }
}
std::vector<const tinyxml2::XMLElement*> by_class(const tinyxml2::XMLElement* e,
                                                  const std::string& name) {
  std::vector<const tinyxml2::XMLElement*> out;
  collect(e, name, out);
  return out;
}

std::vector<std::string> texts(const std::vector<const tinyxml2::XMLElement*>& elements) {
  std::vector<std::string> out;
  out.reserve(elements.size());
  for (const tinyxml2::XMLElement* e : elements)
    out.emplace_back(e->GetText() != nullptr ? e->GetText() : "");
  return out;
}

double number(const tinyxml2::XMLElement* e, const char* attribute) {
  const char* value = e->Attribute(attribute);
  REQUIRE(value != nullptr);
  return std::stod(value);
}

std::array<int, 3> rgb_of(const std::string& hex) {
  REQUIRE(hex.size() == 7);
  REQUIRE(hex[0] == '#');
  return {std::stoi(hex.substr(1, 2), nullptr, 16), std::stoi(hex.substr(3, 2), nullptr, 16),
          std::stoi(hex.substr(5, 2), nullptr, 16)};
}

/// WCAG relative luminance of "#rrggbb".
double luminance(const std::string& hex) {
  const std::array<int, 3> rgb = rgb_of(hex);
  std::array<double, 3> linear{};
  for (std::size_t c = 0; c < 3; ++c) {
    const double v = rgb[c] / 255.0;
    linear[c] = v <= 0.04045 ? v / 12.92 : std::pow((v + 0.055) / 1.055, 2.4);
  }
  return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2];
}

attn::Matrix<double> tutorial_like_weights() {
  attn::Matrix<double> w(3, 3);  // (Lq, Lk)
  w << 0.2, 0.5, 0.3, 0.1, 0.8, 0.1, 0.33, 0.33, 0.34;
  return w;
}

std::vector<std::string> tokens(Index n) {
  std::vector<std::string> out;
  for (Index i = 0; i < n; ++i)
    out.push_back("Token" + std::to_string(i + 1));
  return out;
}

/// Cells covered by the merged-run paths of one panel: counts[i * Lk + j] is how many runs
/// cover cell (i, j). Parses the path grammar the header writes: M x y, m dx dy, h w.
std::vector<int> run_coverage(const tinyxml2::XMLElement* panel, Index q_length, Index k_length,
                              std::vector<int>* hidden = nullptr) {
  const auto frames = by_class(panel, "frame");
  REQUIRE(frames.size() == 1);
  const double x0 = number(frames[0], "x"), y0 = number(frames[0], "y");
  const double cs = number(frames[0], "width") / static_cast<double>(k_length);
  REQUIRE(number(frames[0], "height") == Approx(cs * static_cast<double>(q_length)));
  std::vector<int> counts(static_cast<std::size_t>(q_length * k_length), 0);
  for (const tinyxml2::XMLElement* path : by_class(panel, "cells")) {
    if (std::string(path->Name()) != "path")
      continue;
    const bool is_hidden = has_class(path, "hidden");
    std::istringstream d(path->Attribute("d"));
    double x = 0, y = 0;
    char command = 0;
    while (d >> command) {
      double a = 0, b = 0;
      if (command == 'M') {
        d >> x >> y;
      } else if (command == 'm') {
        d >> a >> b;
        x += a;
        y += b;
      } else {
        REQUIRE(command == 'h');
        d >> a;
        const auto row = static_cast<Index>(std::lround((y - y0) / cs - 0.5));
        const auto first = static_cast<Index>(std::lround((x - x0) / cs));
        const auto width = static_cast<Index>(std::lround(a / cs));
        REQUIRE(width >= 1);
        for (Index j = first; j < first + width; ++j) {
          REQUIRE(row >= 0);
          REQUIRE(row < q_length);
          REQUIRE(j >= 0);
          REQUIRE(j < k_length);
          ++counts[static_cast<std::size_t>(row * k_length + j)];
          if (hidden != nullptr && is_hidden)
            ++(*hidden)[static_cast<std::size_t>(row * k_length + j)];
        }
        x += a;
      }
    }
  }
  return counts;
}

}  // namespace

TEST_CASE("heatmap of the tutorial's 3 tokens: cells, values, labels, axes, title", "[viz]") {
  attn::HeatmapOptions options;
  options.query_labels = tokens(3);
  options.key_labels = tokens(3);
  options.title = "Attention weights";
  const std::string text = attn::attention_heatmap_svg(tutorial_like_weights(), options);
  const Svg svg(text);

  const auto cells = by_class(svg.root(), "cell");
  REQUIRE(cells.size() == 9);
  // Row-major, queries down (y), keys across (x), equal square cells.
  const double cs = number(cells[0], "width");
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 3; ++j) {
      const auto* cell = cells[static_cast<std::size_t>(i * 3 + j)];
      CHECK(std::string(cell->Name()) == "rect");
      CHECK(number(cell, "x") == Approx(number(cells[0], "x") + cs * static_cast<double>(j)));
      CHECK(number(cell, "y") == Approx(number(cells[0], "y") + cs * static_cast<double>(i)));
      CHECK(number(cell, "height") == cs);
    }
  }
  CHECK(texts(by_class(svg.root(), "value")) == std::vector<std::string>{"0.20", "0.50", "0.30",
                                                                         "0.10", "0.80", "0.10",
                                                                         "0.33", "0.33", "0.34"});
  CHECK(texts(by_class(svg.root(), "query-label")) == tokens(3));
  CHECK(texts(by_class(svg.root(), "key-label")) == tokens(3));
  CHECK(texts(by_class(svg.root(), "axis-label")) == std::vector<std::string>{"Key", "Query"});
  CHECK(texts(by_class(svg.root(), "title")) == std::vector<std::string>{"Attention weights"});
  CHECK(by_class(svg.root(), "colorbar").size() == 1);
  CHECK(by_class(svg.root(), "hidden").empty());
  // The darkest cell (0.80) carries white text, a light one dark text.
  const auto values = by_class(svg.root(), "value");
  CHECK(std::string(values[4]->Attribute("fill")) == "#ffffff");
  CHECK(std::string(values[0]->Attribute("fill")) != "#ffffff");
  // The default range is the data's: the smallest value takes the first anchor colour, the
  // largest the last.
  CHECK(std::string(cells[3]->Attribute("fill")) == "#ffffd9");
  CHECK(std::string(cells[4]->Attribute("fill")) == "#081d58");
  // Deterministic.
  CHECK(attn::attention_heatmap_svg(tutorial_like_weights(), options) == text);
}

TEST_CASE("default labels are indices, and decimals are honoured", "[viz]") {
  attn::HeatmapOptions options;
  options.decimals = 3;
  options.query_axis.clear();
  options.title.clear();
  const Svg svg(attn::attention_heatmap_svg(attn::Matrix<float>::Constant(2, 4, 0.25f), options));
  CHECK(texts(by_class(svg.root(), "query-label")) == std::vector<std::string>{"0", "1"});
  CHECK(texts(by_class(svg.root(), "key-label")) == std::vector<std::string>{"0", "1", "2", "3"});
  CHECK(texts(by_class(svg.root(), "axis-label")) == std::vector<std::string>{"Key"});
  CHECK(by_class(svg.root(), "title").empty());
  for (const std::string& v : texts(by_class(svg.root(), "value")))
    CHECK(v == "0.250");
}

TEMPLATE_TEST_CASE("a cell's colour darkens monotonically with its value", "[viz]", float, double) {
  const Index n = 101;
  attn::Matrix<TestType> w(1, n);  // (1, n): values 0, 0.01, ..., 1
  for (Index j = 0; j < n; ++j)
    w(0, j) = static_cast<TestType>(static_cast<double>(j) / static_cast<double>(n - 1));
  for (const attn::ColorMap map : {attn::ColorMap::ylgnbu, attn::ColorMap::greys}) {
    attn::HeatmapOptions options;
    options.color_map = map;
    const Svg svg(attn::attention_heatmap_svg(w, options));
    const auto cells = by_class(svg.root(), "cell");
    REQUIRE(cells.size() == static_cast<std::size_t>(n));
    CHECK(by_class(svg.root(), "value").empty());  // 101 > annotate_limit
    for (Index j = 1; j < n; ++j) {
      INFO("cell " << j);
      CHECK(luminance(cells[static_cast<std::size_t>(j)]->Attribute("fill")) <
            luminance(cells[static_cast<std::size_t>(j - 1)]->Attribute("fill")));
    }
    if (map == attn::ColorMap::ylgnbu) {
      CHECK(std::string(cells.front()->Attribute("fill")) == "#ffffd9");
      CHECK(std::string(cells[50]->Attribute("fill")) == "#41b6c4");  // the middle anchor
      CHECK(std::string(cells.back()->Attribute("fill")) == "#081d58");
    }
  }
}

TEST_CASE("colormap_rgb passes through the 9 YlGnBu anchors and clamps", "[viz]") {
  const std::array<std::uint32_t, 9> anchors{0xffffd9, 0xedf8b1, 0xc7e9b4, 0x7fcdbb, 0x41b6c4,
                                             0x1d91c0, 0x225ea8, 0x253494, 0x081d58};
  for (std::size_t k = 0; k < anchors.size(); ++k) {
    const auto rgb = attn::colormap_rgb(attn::ColorMap::ylgnbu, static_cast<double>(k) / 8.0);
    CHECK(static_cast<std::uint32_t>(rgb[0]) == ((anchors[k] >> 16U) & 0xffU));
    CHECK(static_cast<std::uint32_t>(rgb[1]) == ((anchors[k] >> 8U) & 0xffU));
    CHECK(static_cast<std::uint32_t>(rgb[2]) == (anchors[k] & 0xffU));
  }
  CHECK(attn::colormap_rgb(attn::ColorMap::ylgnbu, -3.0) ==
        attn::colormap_rgb(attn::ColorMap::ylgnbu, 0.0));
  CHECK(attn::colormap_rgb(attn::ColorMap::ylgnbu, 7.0) ==
        attn::colormap_rgb(attn::ColorMap::ylgnbu, 1.0));
}

TEST_CASE("an explicit colour range clamps values outside it", "[viz]") {
  attn::Matrix<double> w(1, 3);
  w << -1.0, 0.5, 2.0;
  attn::HeatmapOptions options;
  options.vmin = 0.0;
  options.vmax = 1.0;
  const Svg svg(attn::attention_heatmap_svg(w, options));
  const auto cells = by_class(svg.root(), "cell");
  CHECK(std::string(cells[0]->Attribute("fill")) == "#ffffd9");
  CHECK(std::string(cells[1]->Attribute("fill")) == "#41b6c4");
  CHECK(std::string(cells[2]->Attribute("fill")) == "#081d58");
  CHECK(texts(by_class(svg.root(), "value")) == std::vector<std::string>{"-1.00", "0.50", "2.00"});
}

TEST_CASE("hidden cells are drawn empty (hatched, no value), not as 0.00", "[viz]") {
  // Causal (top-left) 4 x 4: 6 hidden cells. A visible zero still shows "0.00".
  attn::Matrix<double> w = attn::Matrix<double>::Zero(4, 4);  // (Lq, Lk)
  w(1, 0) = 0.25;
  w(1, 1) = 0.75;
  w(2, 0) = 1.0;
  w(3, 3) = 0.5;
  w(0, 0) = 1.0;
  attn::HeatmapOptions options;
  options.visible = attn::visibility_matrix(4, 4, attn::Causal::top_left);
  const Svg svg(attn::attention_heatmap_svg(w, options));
  const auto cells = by_class(svg.root(), "cell");
  REQUIRE(cells.size() == 16);
  const auto values = by_class(svg.root(), "value");
  REQUIRE(values.size() == 10);
  std::size_t v = 0;
  for (Index i = 0; i < 4; ++i) {
    for (Index j = 0; j < 4; ++j) {
      const auto* cell = cells[static_cast<std::size_t>(i * 4 + j)];
      INFO("cell " << i << ", " << j);
      CHECK(has_class(cell, "hidden") == (j > i));
      if (j > i) {
        CHECK(std::string(cell->Attribute("fill")) == "url(#attn-hidden)");
      } else {
        // The value text sits in this cell's centre.
        CHECK(std::string(cell->Attribute("fill")).rfind('#', 0) == 0);
        CHECK(number(values[v], "x") ==
              Approx(number(cell, "x") + number(cell, "width") / 2).margin(0.01));
        CHECK(number(values[v], "y") ==
              Approx(number(cell, "y") + number(cell, "height") / 2).margin(0.01));
        ++v;
      }
    }
  }
  CHECK(texts(values)[2] == "0.75");
  CHECK(texts(values)[5] == "0.00");  // (2, 1): visible zero
  // A pattern that the hidden cells use, and a legend entry for it.
  bool pattern = false;
  for (const auto* e = svg.root()->FirstChildElement("defs")->FirstChildElement(); e != nullptr;
       e = e->NextSiblingElement())
    pattern = pattern || (std::string(e->Name()) == "pattern" &&
                          std::string(e->Attribute("id")) == "attn-hidden");
  CHECK(pattern);
  const auto bar = by_class(svg.root(), "colorbar");
  REQUIRE(bar.size() == 1);
  bool legend = false;
  for (const auto* e = bar[0]->FirstChildElement("text"); e != nullptr;
       e = e->NextSiblingElement("text"))
    legend = legend || std::string(e->GetText()) == "masked";
  CHECK(legend);
  // Hidden cells are left out of the automatic range: the hidden 0s of row 0 do not count,
  // but the visible 0 of row 2 does, so the range is [0, 1].
  CHECK(std::string(cells[0]->Attribute("fill")) == "#081d58");
}

TEST_CASE("hidden cells do not set the colour range", "[viz]") {
  attn::Matrix<double> w(2, 2);
  w << 0.5, 100.0, 0.25, 0.75;
  attn::HeatmapOptions options;
  options.visible.resize(2, 2);
  options.visible << true, false, true, true;
  const Svg svg(attn::attention_heatmap_svg(w, options));
  const auto cells = by_class(svg.root(), "cell");
  CHECK(std::string(cells[2]->Attribute("fill")) == "#ffffd9");  // 0.25, the smallest
  CHECK(std::string(cells[3]->Attribute("fill")) == "#081d58");  // 0.75, the largest
}

TEST_CASE("NaN is shown as NaN, never hidden or coloured as a number", "[viz]") {
  attn::Matrix<double> w(2, 2);
  w << 0.5, std::numeric_limits<double>::quiet_NaN(), 0.25, 0.75;
  const Svg svg(attn::attention_heatmap_svg(w));
  const auto cells = by_class(svg.root(), "cell");
  REQUIRE(cells.size() == 4);
  CHECK(has_class(cells[1], "nan"));
  CHECK_FALSE(has_class(cells[1], "hidden"));
  CHECK(texts(by_class(svg.root(), "value")) ==
        std::vector<std::string>{"0.50", "NaN", "0.25", "0.75"});
  CHECK(std::string(cells[2]->Attribute("fill")) == "#ffffd9");  // range from finite values
}

TEST_CASE("labels and title are XML-escaped", "[viz]") {
  attn::HeatmapOptions options;
  options.title = "q <&> k \"quoted\" 'single'";
  options.query_labels = {"<s>", "a&b"};
  options.key_labels = {"\"x\"", "it's", std::string("bell\x07")};
  options.query_axis = "Query <i>";
  const std::string text =
      attn::attention_heatmap_svg(attn::Matrix<double>::Constant(2, 3, 1.0 / 3), options);
  const Svg svg(text);
  CHECK(texts(by_class(svg.root(), "title")) == std::vector<std::string>{options.title});
  CHECK(texts(by_class(svg.root(), "query-label")) == options.query_labels);
  CHECK(texts(by_class(svg.root(), "key-label")) ==
        std::vector<std::string>{"\"x\"", "it's", "bell?"});  // control character replaced
  CHECK(texts(by_class(svg.root(), "axis-label"))[1] == "Query <i>");
  CHECK(std::string(svg.root()->FirstChildElement("title")->GetText()) == options.title);
}

TEST_CASE("heads grid: one panel per head of the chosen batch entry, one colour bar", "[viz]") {
  const Index batch = 2, heads = 3, lq = 5, lk = 4;
  attn::Tensor<float, 4> w(batch, heads, lq, lk);  // (B, H, Lq, Lk)
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h)
      for (Index i = 0; i < lq; ++i)
        for (Index j = 0; j < lk; ++j)
          w(b, h, i, j) = static_cast<float>(b * 1000 + h * 100 + i * 10 + j) / 1000.0f;
  attn::HeatmapOptions options;
  options.decimals = 3;
  options.query_labels = tokens(lq);
  const Svg svg(attn::attention_heads_svg(w, 1, options));
  const auto panels = by_class(svg.root(), "panel");
  REQUIRE(panels.size() == static_cast<std::size_t>(heads));
  CHECK(by_class(svg.root(), "colorbar").size() == 1);
  for (Index h = 0; h < heads; ++h) {
    const auto* panel = panels[static_cast<std::size_t>(h)];
    CHECK(texts(by_class(panel, "panel-title")) ==
          std::vector<std::string>{"head " + std::to_string(h)});
    CHECK(by_class(panel, "cell").size() == static_cast<std::size_t>(lq * lk));
    CHECK(texts(by_class(panel, "query-label")) == tokens(lq));
    const auto values = texts(by_class(panel, "value"));
    REQUIRE(values.size() == static_cast<std::size_t>(lq * lk));
    char expected[16];
    std::snprintf(expected, sizeof expected, "%.3f", static_cast<double>(w(1, h, 2, 3)));
    CHECK(values[2 * lk + 3] == expected);
  }
  // Panels sit on a grid: ceil(sqrt(3)) = 2 columns by default.
  CHECK(std::string(panels[0]->Attribute("transform")) !=
        std::string(panels[1]->Attribute("transform")));
  // The same through a TensorMap and a HeadsView; custom titles and one row.
  options.panel_titles = {"a", "b", "c"};
  options.columns = 3;
  const attn::TensorMap<const float, 4> map(w.data(), batch, heads, lq, lk);
  const std::string from_map = attn::attention_heads_svg(map, 1, options);
  CHECK(from_map == attn::attention_heads_svg(attn::bhld_view(w), 1, options));
  const Svg titled(from_map);
  std::vector<std::string> titles;
  for (const auto* panel : by_class(titled.root(), "panel"))
    titles.push_back(texts(by_class(panel, "panel-title")).at(0));
  CHECK(titles == std::vector<std::string>{"a", "b", "c"});
}

TEST_CASE("heads grid with a causal mask hides the same cells in every head", "[viz]") {
  attn::Tensor<double, 4> w(1, 4, 6, 6);
  w.setConstant(1.0 / 6);
  attn::HeatmapOptions options;
  options.visible = attn::visibility_matrix(6, 6, attn::Causal::top_left);
  const Svg svg(attn::attention_heads_svg(w, 0, options));
  for (const auto* panel : by_class(svg.root(), "panel")) {
    CHECK(by_class(panel, "hidden").size() == 15);
    CHECK(by_class(panel, "value").size() == 21);
  }
}

TEST_CASE("thresholds: values up to annotate_limit, one rect per cell up to cell_limit", "[viz]") {
  for (const Index n : {Index(32), Index(33), Index(128), Index(129)}) {
    INFO("L = " << n);
    const attn::Matrix<double> w =
        attn::Matrix<double>::Constant(n, n, 1.0 / static_cast<double>(n));
    const Svg svg(attn::attention_heatmap_svg(w));
    const std::size_t cells = by_class(svg.root(), "cell").size();
    const std::size_t values = by_class(svg.root(), "value").size();
    CHECK(values == (n <= 32 ? static_cast<std::size_t>(n * n) : 0));
    CHECK(cells == (n <= 128 ? static_cast<std::size_t>(n * n) : 0));
    // Tick labels thinned to at most max_ticks per axis.
    CHECK(by_class(svg.root(), "key-label").size() <= 32);
    CHECK(by_class(svg.root(), "query-label").size() <= 32);
    CHECK(texts(by_class(svg.root(), "key-label")).at(0) == "0");
  }
}

TEST_CASE("heads grid: cell_limit counts the cells of all panels together", "[viz]") {
  attn::Tensor<float, 4> w(1, 2, 100, 100);  // 2 x 100 x 100 = 20000 > 128^2 cells
  w.setConstant(0.01f);
  const Svg svg(attn::attention_heads_svg(w, 0));
  CHECK(by_class(svg.root(), "cell").empty());
  const auto panels = by_class(svg.root(), "panel");
  REQUIRE(panels.size() == 2);
  for (const auto* panel : panels) {
    const std::vector<int> counts = run_coverage(panel, 100, 100);
    CHECK(std::count(counts.begin(), counts.end(), 1) == 10000);
  }
  // One head of the same size stays one rect per cell.
  const attn::Matrix<float> one = attn::Matrix<float>::Constant(100, 100, 0.01f);
  CHECK(by_class(Svg(attn::attention_heatmap_svg(one)).root(), "cell").size() == 10000);
}

TEST_CASE("any Eigen dense expression: arrays, maps, blocks", "[viz]") {
  const attn::Matrix<double> w = tutorial_like_weights();
  const std::string expected = attn::attention_heatmap_svg(w);
  const Eigen::ArrayXXd array = w.array();  // column-major array
  CHECK(attn::attention_heatmap_svg(array) == expected);
  const Eigen::Map<const attn::Matrix<double>> map(w.data(), 3, 3);
  CHECK(attn::attention_heatmap_svg(map) == expected);
  attn::Matrix<double> bigger = attn::Matrix<double>::Zero(5, 5);
  bigger.block(1, 1, 3, 3) = w;
  CHECK(attn::attention_heatmap_svg(bigger.block(1, 1, 3, 3)) == expected);
}

TEST_CASE("L = 512: merged runs cover every cell once, no per-cell text, size bounded", "[viz]") {
  const Index n = 512;
  // Worst case for the run encoding: independent uniform values, so neighbours rarely share
  // a colour level; and a realistic case: causal softmax rows.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  attn::Matrix<double> noise(n, n);  // (Lq, Lk)
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n; ++j)
      noise(i, j) = uniform(rng);
  attn::Matrix<double> causal = attn::Matrix<double>::Zero(n, n);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (Index i = 0; i < n; ++i) {
    double sum = 0;
    for (Index j = 0; j <= i; ++j)
      sum += causal(i, j) = std::exp(normal(rng));
    causal.row(i).head(i + 1) /= sum;
  }
  attn::HeatmapOptions causal_options;
  causal_options.visible = attn::visibility_matrix(n, n, attn::Causal::top_left);

  const std::string noise_svg = attn::attention_heatmap_svg(noise);
  const std::string causal_svg = attn::attention_heatmap_svg(causal, causal_options);
  // Sizes when this test was written: 1,885,459 bytes (noise), 74,608 bytes (causal).
  INFO("L = 512 SVG sizes: uniform noise " << noise_svg.size() << " bytes, causal softmax "
                                           << causal_svg.size() << " bytes");
  CHECK(noise_svg.size() < std::size_t{3} * 1024 * 1024);
  CHECK(causal_svg.size() < std::size_t{256} * 1024);

  for (const std::string* text : {&noise_svg, &causal_svg}) {
    const Svg svg(*text);
    CHECK(by_class(svg.root(), "cell").empty());
    CHECK(by_class(svg.root(), "value").empty());
    CHECK(by_class(svg.root(), "key-label").size() <= 32);
    CHECK(by_class(svg.root(), "query-label").size() <= 32);
    const auto panels = by_class(svg.root(), "panel");
    REQUIRE(panels.size() == 1);
    std::vector<int> hidden(static_cast<std::size_t>(n * n), 0);
    const std::vector<int> counts = run_coverage(panels[0], n, n, &hidden);
    bool once = true, hidden_right = true;
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) {
        const auto k = static_cast<std::size_t>(i * n + j);
        once = once && counts[k] == 1;
        if (text == &causal_svg)
          hidden_right = hidden_right && (hidden[k] == 1) == (j > i);
        else
          hidden_right = hidden_right && hidden[k] == 0;
      }
    }
    CHECK(once);
    CHECK(hidden_right);
  }
}

TEST_CASE("visibility_matrix follows the library's mask rules", "[viz]") {
  const attn::Matrix<bool> tl = attn::visibility_matrix(3, 5, attn::Causal::top_left);
  const attn::Matrix<bool> br = attn::visibility_matrix(3, 5, attn::Causal::bottom_right);
  const attn::Matrix<bool> padded = attn::visibility_matrix(2, 4, attn::Causal::none, {}, 3);
  const attn::Matrix<bool> window = attn::visibility_matrix(4, 4, attn::Causal::top_left, {1, 0});
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 5; ++j) {
      CHECK(tl(i, j) == (j <= i));
      CHECK(br(i, j) == (j <= i + 2));
    }
  }
  for (Index i = 0; i < 2; ++i)
    for (Index j = 0; j < 4; ++j)
      CHECK(padded(i, j) == (j < 3));
  for (Index i = 0; i < 4; ++i)
    for (Index j = 0; j < 4; ++j)
      CHECK(window(i, j) == (j <= i && j >= i - 1));
}

TEST_CASE("write_attention_heatmap and write_attention_heads write the SVG to a file", "[viz]") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path();
  const std::filesystem::path one = dir / "attn_test_viz_heatmap.svg";
  const std::filesystem::path grid = dir / "attn_test_viz_heads.svg";
  const auto read = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  attn::write_attention_heatmap(one, tutorial_like_weights());
  CHECK(read(one) == attn::attention_heatmap_svg(tutorial_like_weights()));
  attn::Tensor<float, 4> w(1, 2, 3, 3);
  w.setConstant(0.5f);
  attn::write_attention_heads(grid, w, 0);
  CHECK(read(grid) == attn::attention_heads_svg(w, 0));
  std::filesystem::remove(one);
  std::filesystem::remove(grid);
  CHECK_THROWS_WITH(
      attn::write_attention_heatmap("/nonexistent-attn-dir/x.svg", tutorial_like_weights()),
      "write_attention_heatmap: cannot write '/nonexistent-attn-dir/x.svg'");
}

TEST_CASE("heatmap errors name the function, the shapes and the rule", "[viz]") {
  const attn::Matrix<double> w = tutorial_like_weights();  // (3, 3)
  CHECK_THROWS_MATCHES(
      attn::attention_heatmap_svg(attn::Matrix<double>(0, 3)), std::invalid_argument,
      Catch::Matchers::Message(
          "attention_heatmap_svg: weights are [0, 3]: need at least one query and one key"));
  attn::HeatmapOptions o;
  o.query_labels = {"a", "b"};
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: 2 query_labels for weights [3, 3]: need 0 or 3");
  o = {};
  o.key_labels = tokens(4);
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: 4 key_labels for weights [3, 3]: need 0 or 3");
  o = {};
  o.visible = attn::Matrix<bool>::Constant(2, 3, true);
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: visible is [2, 3] but weights are [3, 3]: need (Lq, "
                    "Lk) = [3, 3] (or empty)");
  o = {};
  o.decimals = 7;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: decimals is 7: must lie in [0, 6]");
  o = {};
  o.cell_size = 0;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: cell_size is 0: must be >= 1");
  o = {};
  o.max_plot_size = -5;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: max_plot_size is -5: must be >= 1");
  o = {};
  o.annotate_limit = -1;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: annotate_limit is -1: must be >= 0");
  o = {};
  o.cell_limit = -1;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: cell_limit is -1: must be >= 0");
  o = {};
  o.max_ticks = -2;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: max_ticks is -2: must be >= 0");
  o = {};
  o.columns = -1;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: columns is -1: must be >= 0");
  o = {};
  o.vmin = 1.0;
  o.vmax = 0.5;
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: vmin is 1 and vmax is 0.5: each must be finite or "
                    "unset, and vmin < vmax");
  o = {};
  o.vmax = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(attn::attention_heatmap_svg(w, o),
                    "attention_heatmap_svg: vmin is unset and vmax is nan: each must be finite "
                    "or unset, and vmin < vmax");
  o = {};
  o.decimals = -1;
  CHECK_THROWS_WITH(attn::write_attention_heatmap("unused.svg", w, o),
                    "write_attention_heatmap: decimals is -1: must lie in [0, 6]");
  CHECK_FALSE(std::filesystem::exists("unused.svg"));
}

TEST_CASE("heads grid errors name the function, the shapes and the rule", "[viz]") {
  attn::Tensor<float, 4> w(2, 3, 5, 4);
  w.setConstant(0.25f);
  CHECK_THROWS_WITH(attn::attention_heads_svg(w, 2),
                    "attention_heads_svg: batch index is 2 but weights are [2, 3, 5, 4]: must lie "
                    "in [0, 2)");
  CHECK_THROWS_WITH(attn::attention_heads_svg(w, -1),
                    "attention_heads_svg: batch index is -1 but weights are [2, 3, 5, 4]: must "
                    "lie in [0, 2)");
  attn::HeatmapOptions o;
  o.panel_titles = {"x", "y"};
  CHECK_THROWS_WITH(attn::attention_heads_svg(w, 0, o),
                    "attention_heads_svg: 2 panel_titles for weights [2, 3, 5, 4]: need 0 or 3");
  o = {};
  o.visible = attn::Matrix<bool>::Constant(4, 5, true);
  CHECK_THROWS_WITH(attn::attention_heads_svg(w, 0, o),
                    "attention_heads_svg: visible is [4, 5] but weights are [2, 3, 5, 4]: need "
                    "(Lq, Lk) = [5, 4] (or empty)");
  o = {};
  o.key_labels = {"only one"};
  CHECK_THROWS_WITH(attn::write_attention_heads("unused.svg", w, 0, o),
                    "write_attention_heads: 1 key_labels for weights [2, 3, 5, 4]: need 0 or 4");
  const attn::Tensor<float, 4> no_heads(2, 0, 5, 4);
  CHECK_THROWS_WITH(attn::attention_heads_svg(no_heads, 0),
                    "attention_heads_svg: weights are [2, 0, 5, 4]: need at least one batch "
                    "entry and one head");
  const attn::Tensor<float, 4> no_keys(2, 3, 5, 0);
  CHECK_THROWS_WITH(attn::attention_heads_svg(no_keys, 0),
                    "attention_heads_svg: weights are [2, 3, 5, 0]: need at least one query and "
                    "one key");
}

TEST_CASE("visibility_matrix errors", "[viz]") {
  CHECK_THROWS_WITH(attn::visibility_matrix(-1, 3, attn::Causal::none),
                    "visibility_matrix: shape is [-1, 3]: lengths must be >= 0");
  CHECK_THROWS_WITH(attn::visibility_matrix(3, 3, attn::Causal::none, {}, 4),
                    "visibility_matrix: key_length is 4: must be -1 (no padding) or lie in [0, "
                    "Lk] with Lk = 3");
  CHECK_THROWS_WITH(attn::visibility_matrix(3, 3, attn::Causal::none, {-2, 0}),
                    "visibility_matrix: window is (-2, 0): each side must be >= -1 (-1 = "
                    "unbounded)");
}
