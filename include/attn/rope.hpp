// attn/rope.hpp: rotary position embeddings (RoPE), applied in place to q and k.
//
//   x          (B, H, L, D)   any HeadsView (PyTorch's layout, (B, L, H, D), the column
//                             blocks of a fused QKV buffer, packed sequences), S = float,
//                             double, Eigen::half or Eigen::bfloat16; rotated in place
//   positions  token t of sequence b sits at offsets[b] + t (apply, offsets (B)), or at
//              positions[t] (positions (L)) or one entry per row of x (apply_at)
//   table      (max_positions, R) cos and sin of every position and frequency, in T
//
// R = rotary_dim (default D) features are rotated; features [R, D) are untouched (partial
// rotation, e.g. GPT-NeoX's rotary_pct). Pair i (i < R/2) turns by the angle p * f_i of its
// frequency f_i = base^(-2i/R), after the scaling below:
//   (a, b) -> (a cos(p f_i) - b sin(p f_i), b cos(p f_i) + a sin(p f_i))
// The pairing says which two features form pair i:
//   half_split    (x[i], x[i + R/2])    GPT-NeoX, Llama, Mistral, Qwen; HF's rotate_half
//   interleaved   (x[2i], x[2i + 1])    GPT-J, the RoFormer paper, Meta's original Llama
// The two are the same rotation of differently ordered features: a model trained with one
// gives wrong results with the other.
//
// Scalings (the semantics of HF transformers' rope_type; formulas in docs/rope.md):
//   none       f_i = base^(-2i/R)
//   linear     f_i / factor (positions divided by factor: "position interpolation")
//   ntk_aware  base' = base * factor^(R / (R - 2)), f_i = base'^(-2i/R)
//   yarn       per frequency, a blend of f_i and f_i / factor by a ramp between the
//              correction dims of beta_fast and beta_slow rotations over
//              original_max_positions; cos and sin times the attention factor (mscale),
//              0.1 ln(factor) + 1 unless given
//   llama3     f_i kept above the high-frequency wavelength, f_i / factor below the low one,
//              a smooth blend between (Llama 3.1)
// The table is computed in long double (angles reduced modulo 2 pi) and rounded once to T;
// 16-bit x are widened to float, rotated and rounded once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/plan.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Which two features of a head rotate together (see the top of this file).
enum class RopePairing : std::uint8_t {
  half_split,   ///< (x[i], x[i + R/2]): GPT-NeoX, Llama, HF's rotate_half
  interleaved,  ///< (x[2i], x[2i + 1]): GPT-J
};

/// Frequency scaling for contexts longer than the pre-training one (HF's rope_type).
enum class RopeScaling : std::uint8_t { none, linear, ntk_aware, yarn, llama3 };

inline const char* rope_scaling_name(RopeScaling scaling) {
  switch (scaling) {
    case RopeScaling::none:
      return "none";
    case RopeScaling::linear:
      return "linear";
    case RopeScaling::ntk_aware:
      return "ntk_aware";
    case RopeScaling::yarn:
      return "yarn";
    case RopeScaling::llama3:
      return "llama3";
  }
  return "unknown";
}

/// Everything a rotary table depends on. Fields a scaling does not use are ignored.
struct RopeConfig {
  Index dim = 0;          ///< D, the head dim of the views it is applied to
  Index rotary_dim = 0;   ///< R: the first R features rotate (even, <= D); 0 means D
  double base = 10000.0;  ///< theta (HF rope_theta)
  RopePairing pairing = RopePairing::half_split;
  Index max_positions = 4096;  ///< the table holds positions [0, max_positions)
  RopeScaling scaling = RopeScaling::none;
  double factor = 1.0;               ///< linear, ntk_aware, yarn, llama3 (1 for none)
  Index original_max_positions = 0;  ///< yarn, llama3: the pre-training context length
  double beta_fast = 32.0;           ///< yarn: rotations where extrapolation starts
  double beta_slow = 1.0;            ///< yarn: rotations where interpolation is complete
  double attention_factor = 0.0;     ///< yarn: cos and sin scale; 0 means from mscale below
  double mscale = 0.0;               ///< yarn (DeepSeek): with mscale_all_dim, the ratio
  double mscale_all_dim = 0.0;       ///<   m(factor, mscale) / m(factor, mscale_all_dim)
  bool truncate = true;              ///< yarn: correction range rounded to whole dims
  double low_freq_factor = 1.0;      ///< llama3
  double high_freq_factor = 4.0;     ///< llama3
};

namespace detail {

inline std::string number_string(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

/// YaRN's m(scale, mscale) = 0.1 mscale ln(scale) + 1 (1 for scale <= 1).
inline long double yarn_mscale(long double scale, long double mscale) {
  return scale <= 1 ? 1.0L : 0.1L * mscale * std::log(scale) + 1.0L;
}

}  // namespace detail

/// A precomputed cos/sin table and its application to (B, H, L, D) views. T is the table's
/// scalar: float (for float, half and bfloat16 data) or double (for double data).
template <class T>
class RotaryEmbedding {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "RotaryEmbedding: T must be float or double (16-bit data use float)");

 public:
  using scalar_type = T;

  RotaryEmbedding() = default;

  /// Validates `config` and computes the table: max_positions * rotary_dim scalars.
  explicit RotaryEmbedding(const RopeConfig& config) : config_(config) {
    validate();
    compute();
  }

  const RopeConfig& config() const { return config_; }
  Index dim() const { return config_.dim; }
  Index rotary_dim() const { return config_.rotary_dim; }
  Index max_positions() const { return config_.max_positions; }
  RopePairing pairing() const { return config_.pairing; }
  /// The scale of cos and sin (YaRN's attention factor; 1 for the other scalings): q and k
  /// are both scaled, so the logits are scaled by its square, as in HF transformers.
  double attention_factor() const { return static_cast<double>(attention_factor_); }
  /// (R / 2) the frequencies f_i after scaling, radians per position.
  const std::vector<long double>& frequencies() const { return frequencies_; }
  /// attention_factor * cos(position * f_i), from the table.
  T cos(Index position, Index i) const {
    return table_[static_cast<std::size_t>(table_index(position, i))];
  }
  /// attention_factor * sin(position * f_i), from the table.
  T sin(Index position, Index i) const {
    return table_[static_cast<std::size_t>(table_index(position, i) + config_.rotary_dim / 2)];
  }

  /// Rotates x (B, H, L, D) in place, token t of sequence b at position offsets[b] + t
  /// (offsets (B); empty means 0 for every sequence, e.g. a prompt; a KV-cache decode step
  /// passes each sequence's cached length). Packed views (packed_view())
  /// work too: sequence b has its own x.rows(b) tokens.
  template <class S>
  void apply(const HeadsView<S>& x,  // (B, H, L, D)
             const std::vector<Index>& offsets = {}) const {
    constexpr const char* function = "RotaryEmbedding::apply";
    check_view(function, x);
    if (!offsets.empty() && static_cast<Index>(offsets.size()) != x.batch) {
      detail::throw_invalid_argument(function, "offsets has " + std::to_string(offsets.size()) +
                                                   " entries but x is " + shape(x) +
                                                   ": it must have B entries or none");
    }
    for (Index b = 0; b < x.batch; ++b) {
      const Index first = offsets.empty() ? 0 : offsets[static_cast<std::size_t>(b)];
      const Index rows = x.rows(b);
      if (first < 0 || (rows > 0 && first > config_.max_positions - rows)) {
        detail::throw_invalid_argument(
            function, "offsets[" + std::to_string(b) + "] is " + std::to_string(first) + ": the " +
                          std::to_string(rows) + " tokens of sequence " + std::to_string(b) +
                          " of x " + shape(x) + " need positions [" + std::to_string(first) + ", " +
                          std::to_string(first + rows) + ") but the table holds [0, " +
                          std::to_string(config_.max_positions) + ")");
      }
    }
    run(x, [&](Index b, Index t) {
      return (offsets.empty() ? 0 : offsets[static_cast<std::size_t>(b)]) + t;
    });
  }

  /// Rotates x (B, H, L, D) in place at explicit positions: positions (L), shared by every
  /// sequence (token t at positions[t]), or one per row of x (token t of sequence b at
  /// positions[b * L + t], or at positions[row_offsets[b] + t] in a packed view). Packed
  /// sequences in (T, H, D) memory: blhd_view(data, 1, T, H, D) and each token's position
  /// within its own sequence.
  template <class S>
  void apply_at(const HeadsView<S>& x,  // (B, H, L, D)
                const std::vector<Index>& positions) const {
    constexpr const char* function = "RotaryEmbedding::apply_at";
    check_view(function, x);
    const auto count = static_cast<Index>(positions.size());
    const Index all_rows = x.row_offsets == nullptr ? x.batch * x.length : x.row_offsets[x.batch];
    if (count != x.length && count != all_rows) {
      detail::throw_invalid_argument(
          function, "positions has " + std::to_string(count) + " entries but x is " + shape(x) +
                        ": it must have L = " + std::to_string(x.length) + " or one per row (" +
                        std::to_string(all_rows) + ")");
    }
    for (Index n = 0; n < count; ++n) {
      const Index p = positions[static_cast<std::size_t>(n)];
      if (p < 0 || p >= config_.max_positions) {
        detail::throw_invalid_argument(function, "positions[" + std::to_string(n) + "] is " +
                                                     std::to_string(p) +
                                                     ": the table holds positions [0, " +
                                                     std::to_string(config_.max_positions) + ")");
      }
    }
    // When L is also the row count (B = 1), both readings index positions the same way.
    const bool shared = count == x.length;
    run(x, [&](Index b, Index t) {
      const Index row = x.row_offsets == nullptr ? b * x.length + t : x.row_offsets[b] + t;
      return positions[static_cast<std::size_t>(shared ? t : row)];
    });
  }

  /// The transpose of apply() (its vector-Jacobian product, for a backward pass): turns
  /// every pair by -p f_i and scales by the attention factor, in place, at the positions
  /// apply() would use for the same offsets. For a gradient dy of y = apply(x), the result
  /// is dx. Without YaRN's attention factor (1) it is also apply()'s inverse. Runs apply()'s
  /// kernel between two exact sign flips of each pair's second feature, since
  /// flip * rotation(theta) * flip = rotation(-theta).
  template <class S>
  void apply_backward(const HeadsView<S>& x,  // (B, H, L, D)
                      const std::vector<Index>& offsets = {}) const {
    check_view("RotaryEmbedding::apply_backward", x);
    flip_second_features(x);
    try {
      apply(x, offsets);
    } catch (const std::invalid_argument& error) {
      flip_second_features(x);  // leave x as it was
      const std::string what = error.what();
      const std::string from = "RotaryEmbedding::apply";
      detail::throw_invalid_argument(
          "RotaryEmbedding::apply_backward",
          what.rfind(from + ": ", 0) == 0 ? what.substr(from.size() + 2) : what);
    }
    flip_second_features(x);
  }
  /// apply_backward() on a rank-4 tensor x (B, H, L, D).
  template <class S>
  void apply_backward(Tensor<S, 4>& x,  // (B, H, L, D)
                      const std::vector<Index>& offsets = {}) const {
    apply_backward(bhld_view(x), offsets);
  }

  /// apply() on a rank-4 tensor x (B, H, L, D).
  template <class S>
  void apply(Tensor<S, 4>& x,  // (B, H, L, D)
             const std::vector<Index>& offsets = {}) const {
    apply(bhld_view(x), offsets);
  }
  /// apply_at() on a rank-4 tensor x (B, H, L, D).
  template <class S>
  void apply_at(Tensor<S, 4>& x,  // (B, H, L, D)
                const std::vector<Index>& positions) const {
    apply_at(bhld_view(x), positions);
  }

 private:
  template <class S>
  static std::string shape(const HeadsView<S>& x) {
    return detail::shape_string({x.batch, x.heads, x.length, x.dim});
  }

  /// Negates the second feature of every rotated pair (exact, also in 16 bits).
  template <class S>
  void flip_second_features(const HeadsView<S>& x) const {
    const Index half = config_.rotary_dim / 2;
    const bool interleaved = config_.pairing == RopePairing::interleaved;
    for (Index b = 0; b < x.batch; ++b) {
      for (Index h = 0; h < x.heads; ++h) {
        HeadMatrix<S> head = x.head(b, h);  // (rows(b), D)
        for (Index t = 0; t < head.rows(); ++t) {
          S* row = head.data() + t * head.outerStride();
          for (Index i = 0; i < half; ++i) {
            S& second = row[interleaved ? 2 * i + 1 : half + i];
            second = -second;
          }
        }
      }
    }
  }

  Index table_index(Index position, Index i) const {
    if (position < 0 || position >= config_.max_positions || i < 0 || i >= config_.rotary_dim / 2) {
      detail::throw_invalid_argument("RotaryEmbedding::cos/sin",
                                     "position " + std::to_string(position) + " and pair " +
                                         std::to_string(i) + " must be in [0, " +
                                         std::to_string(config_.max_positions) + ") and [0, " +
                                         std::to_string(config_.rotary_dim / 2) + ")");
    }
    return position * config_.rotary_dim + i;
  }

  template <class S>
  void check_view(const char* function, const HeadsView<S>& x) const {
    using U = std::remove_const_t<S>;
    static_assert(!std::is_const_v<S>, "RotaryEmbedding: x is rotated in place: HeadsView<S>");
    static_assert(std::is_same_v<U, T> ||
                      (std::is_same_v<T, float> &&
                       (std::is_same_v<U, Eigen::half> || std::is_same_v<U, Eigen::bfloat16>)),
                  "RotaryEmbedding<T>: x must be stored as T, or as half or bfloat16 when T is "
                  "float");
    if (table_.empty())
      detail::throw_invalid_argument(function, "the embedding is empty (default-constructed)");
    if (x.batch < 0 || x.heads < 0 || x.length < 0 || x.dim < 0)
      detail::throw_invalid_argument(function, "x is " + shape(x) + ": sizes must be >= 0");
    if (x.dim != config_.dim) {
      detail::throw_invalid_argument(
          function,
          "x is " + shape(x) + " but the table's head dim is " + std::to_string(config_.dim));
    }
    if (x.row_offsets != nullptr) {
      for (Index b = 0; b < x.batch; ++b) {
        if (x.row_offsets[0] < 0 || x.rows(b) < 0 || x.rows(b) > x.length) {
          detail::throw_invalid_argument(
              function,
              "x is a packed view whose row_offsets are not non-decreasing from 0 or "
              "exceed its length (sequence " +
                  std::to_string(b) + ")");
        }
      }
    }
    if (x.data == nullptr && x.batch * x.heads * x.length > 0)
      detail::throw_invalid_argument(function, "x is " + shape(x) + " but its data is null");
  }

  /// Every (b, h) head, in parallel for large views; position(b, t) gives token t's position.
  template <class S, class Position>
  void run(const HeadsView<S>& x, const Position& position) const {
    const Index items = x.batch * x.heads;
    if (items == 0 || x.length == 0)
      return;
    const LoopPlan plan = plan_rope<T>(items, x.length, config_.rotary_dim);
    detail::for_each_item(
        items, plan.parallel,
        [&] { return std::vector<Index>(static_cast<std::size_t>(x.length)); },
        [&](Index item, std::vector<Index>& positions) {
          const Index b = item / x.heads, h = item % x.heads;
          HeadMatrix<S> head = x.head(b, h);  // (rows(b), D)
          for (Index t = 0; t < head.rows(); ++t)
            positions[static_cast<std::size_t>(t)] = position(b, t);
          detail::rope_rows(plan.isa, head.data(), head.rows(), head.outerStride(), table_.data(),
                            config_.rotary_dim, positions.data(),
                            config_.pairing == RopePairing::interleaved);
        });
  }

  void validate() {
    constexpr const char* function = "RotaryEmbedding";
    RopeConfig& c = config_;
    const auto fail = [&](const std::string& message) {
      detail::throw_invalid_argument(function, message);
    };
    const auto positive = [](double x) { return std::isfinite(x) && x > 0; };
    if (c.dim < 1)
      fail("dim " + std::to_string(c.dim) + " must be positive");
    if (c.rotary_dim == 0)
      c.rotary_dim = c.dim;
    if (c.rotary_dim < 2 || c.rotary_dim > c.dim || c.rotary_dim % 2 != 0) {
      fail("rotary_dim " + std::to_string(c.rotary_dim) + " must be even and in [2, dim] (dim " +
           std::to_string(c.dim) + ")");
    }
    if (!std::isfinite(c.base) || !(c.base > 1))
      fail("base " + detail::number_string(c.base) + " must be finite and > 1");
    if (c.max_positions < 1)
      fail("max_positions " + std::to_string(c.max_positions) + " must be positive");
    const std::string scaling = std::string(" (scaling ") + rope_scaling_name(c.scaling) + ")";
    if (c.scaling == RopeScaling::none) {
      if (c.factor != 1.0)
        fail("factor is " + detail::number_string(c.factor) + " but scaling is none");
      return;
    }
    if (!positive(c.factor))
      fail("factor " + detail::number_string(c.factor) + " must be finite and > 0" + scaling);
    if (c.scaling == RopeScaling::ntk_aware && c.rotary_dim < 4) {
      fail("rotary_dim " + std::to_string(c.rotary_dim) +
           " must be at least 4: base is scaled by factor^(R / (R - 2))" + scaling);
    }
    if (c.scaling == RopeScaling::yarn || c.scaling == RopeScaling::llama3) {
      if (c.original_max_positions < 1) {
        fail("original_max_positions " + std::to_string(c.original_max_positions) +
             " must be positive" + scaling);
      }
    }
    if (c.scaling == RopeScaling::yarn) {
      if (!positive(c.beta_fast) || !positive(c.beta_slow) || c.beta_fast < c.beta_slow) {
        fail("beta_fast " + detail::number_string(c.beta_fast) + " and beta_slow " +
             detail::number_string(c.beta_slow) +
             " must be finite, > 0 and beta_fast >= beta_slow" + scaling);
      }
      for (const double x : {c.attention_factor, c.mscale, c.mscale_all_dim}) {
        if (!std::isfinite(x) || x < 0) {
          fail("attention_factor " + detail::number_string(c.attention_factor) + ", mscale " +
               detail::number_string(c.mscale) + " and mscale_all_dim " +
               detail::number_string(c.mscale_all_dim) + " must be finite and >= 0 (0: unset)" +
               scaling);
        }
      }
    }
    if (c.scaling == RopeScaling::llama3) {
      if (!positive(c.low_freq_factor) || !std::isfinite(c.high_freq_factor) ||
          !(c.high_freq_factor > c.low_freq_factor)) {
        fail("low_freq_factor " + detail::number_string(c.low_freq_factor) +
             " and high_freq_factor " + detail::number_string(c.high_freq_factor) +
             " must be finite with 0 < low_freq_factor < high_freq_factor" + scaling);
      }
    }
  }

  /// The frequencies per scaling (docs/rope.md gives the formulas), then the table.
  void compute() {
    using L = long double;
    const RopeConfig& c = config_;
    const Index half = c.rotary_dim / 2;
    const auto r = static_cast<L>(c.rotary_dim);
    const L factor = c.factor, pi = 3.141592653589793238462643383279502884L;
    L base = c.base;
    if (c.scaling == RopeScaling::ntk_aware)
      base *= std::pow(factor, r / (r - 2));
    frequencies_.resize(static_cast<std::size_t>(half));
    for (Index i = 0; i < half; ++i)
      frequencies_[static_cast<std::size_t>(i)] = std::pow(base, -static_cast<L>(2 * i) / r);
    attention_factor_ = 1;
    if (c.scaling == RopeScaling::linear) {
      for (L& f : frequencies_)
        f /= factor;
    } else if (c.scaling == RopeScaling::yarn) {
      const auto original = static_cast<L>(c.original_max_positions);
      // the dim whose frequency makes `rotations` turns over the original context
      const auto correction_dim = [&](L rotations) {
        return r * std::log(original / (rotations * 2 * pi)) / (2 * std::log(base));
      };
      L low = correction_dim(c.beta_fast), high = correction_dim(c.beta_slow);
      if (c.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, L(0));
      high = std::min(high, r - 1);
      if (low == high)
        high += 0.001L;  // HF's guard against a zero-width ramp
      for (Index i = 0; i < half; ++i) {
        const L ramp = std::clamp((static_cast<L>(i) - low) / (high - low), L(0), L(1));
        L& f = frequencies_[static_cast<std::size_t>(i)];
        f = f / factor * ramp + f * (1 - ramp);  // ramp 0: extrapolate (keep), 1: interpolate
      }
      attention_factor_ = c.attention_factor > 0 ? static_cast<L>(c.attention_factor)
                          : (c.mscale > 0 && c.mscale_all_dim > 0)
                              ? detail::yarn_mscale(factor, c.mscale) /
                                    detail::yarn_mscale(factor, c.mscale_all_dim)
                              : detail::yarn_mscale(factor, 1);
    } else if (c.scaling == RopeScaling::llama3) {
      const auto original = static_cast<L>(c.original_max_positions);
      const L low_wavelength = original / c.low_freq_factor;
      const L high_wavelength = original / c.high_freq_factor;
      for (L& f : frequencies_) {
        const L wavelength = 2 * pi / f;
        if (wavelength > low_wavelength) {
          f /= factor;
        } else if (!(wavelength < high_wavelength)) {
          const L smooth = (original / wavelength - c.low_freq_factor) /
                           (c.high_freq_factor - c.low_freq_factor);
          f = (1 - smooth) * f / factor + smooth * f;
        }
      }
    }
    table_.resize(static_cast<std::size_t>(c.max_positions * c.rotary_dim));
    for (Index p = 0; p < c.max_positions; ++p) {
      T* row = table_.data() + p * c.rotary_dim;
      for (Index i = 0; i < half; ++i) {
        // reduced modulo 2 pi in long double before cos and sin
        const L angle =
            std::remainder(static_cast<L>(p) * frequencies_[static_cast<std::size_t>(i)], 2 * pi);
        row[i] = static_cast<T>(attention_factor_ * std::cos(angle));
        row[half + i] = static_cast<T>(attention_factor_ * std::sin(angle));
      }
    }
  }

  RopeConfig config_;
  std::vector<long double> frequencies_;  // (R / 2)
  long double attention_factor_ = 1;
  std::vector<T> table_;  // (max_positions, R): cos[0:R/2), sin[0:R/2) per position
};

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_ROPE_CLASSES(ATTN_EXTERN_CLASS)
#endif
