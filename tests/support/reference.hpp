// Test support: attention by plain loops, written from the rules of docs/masks.md alone.
//
// It includes no attn header. Nothing here is shared with attn's Mask, its tile classifier,
// its softmax or its kernels, so a bug in any of those cannot cancel out of a comparison:
//   - attention<long double>(...) is the truth the kernels are compared with;
//   - attention<float>(...) (or double) is "a plain implementation in the same precision",
//     the baseline of the error bounds (a kernel's error may be about twice its error);
//   - Rounding emulates a kernel that keeps its scores, probabilities or output in a narrow
//     type (16-bit storage, a half accumulator).
//
// Shapes: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), contiguous row-major;
// out (B, Hq, Lq, Dv), lse (B, Hq, Lq), weights (B, Hq, Lq, Lk). Query head h reads
// key/value head h / (Hq / Hkv).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

namespace attn_test::reference {

using Index = std::ptrdiff_t;

enum class Causal { none, top_left, bottom_right };

/// A tensor broadcastable to (B, H, Lq, Lk): each dim is 1 or the full size; row-major.
template <class V>
struct Broadcast4 {
  std::vector<V> data;
  std::array<Index, 4> dims{0, 0, 0, 0};

  bool empty() const { return data.empty(); }
  V at(Index b, Index h, Index i, Index j) const {
    const std::array<Index, 4> x{b, h, i, j};
    Index flat = 0;
    for (std::size_t d = 0; d < 4; ++d)
      flat = flat * dims[d] + (dims[d] == 1 ? 0 : x[d]);
    return data[static_cast<std::size_t>(flat)];
  }
};

/// One attention problem: its sizes and every mask and score option.
struct Problem {
  Index batch = 1, q_heads = 1, kv_heads = 1, q_length = 0, k_length = 0, dim = 1, value_dim = 1;
  std::optional<long double> scale;  ///< default 1 / sqrt(D)
  Causal causal = Causal::none;
  Index window_left = -1, window_right = -1;  ///< -1 = unbounded
  std::vector<Index> key_lengths;             ///< (B), or empty
  std::vector<Index> query_lengths;           ///< (B), or empty
  Index sink_tokens = 0;                      ///< first keys visible beside the window
  Broadcast4<bool> keep;                      ///< true = may attend, or empty
  Broadcast4<long double> bias;               ///< added to the scores, or empty
  std::vector<long double> alibi_slopes;      ///< (Hq), or empty
  std::optional<long double> softcap;
  std::vector<long double> sinks;  ///< (Hq) learned sink logits, or empty
  long double dropout_p = 0;       ///< docs/training.md's dropout rule; 0 = none
  std::uint64_t dropout_seed = 0;
  /// FlexAttention's mask_mod (b, h, q_idx, kv_idx) -> visible, or empty (docs/mods.md)
  std::function<bool(Index, Index, Index, Index)> mask_mod;
  /// FlexAttention's score_mod (score, b, h, q_idx, kv_idx) -> score, in long double, applied
  /// to the scaled score before softcap, ALiBi and the bias; or empty
  std::function<long double(long double, Index, Index, Index, Index)> score_mod;

  Index keys_of(Index b) const {
    return key_lengths.empty() ? k_length : key_lengths[static_cast<std::size_t>(b)];
  }
  Index queries_of(Index b) const {
    return query_lengths.empty() ? q_length : query_lengths[static_cast<std::size_t>(b)];
  }

  /// The diagonal of query i of sequence b: i, or i + n_k(b) - n_q(b) unless the causal
  /// mask is top-left (each sequence aligned by its own lengths).
  Index diagonal(Index b, Index i) const {
    return causal == Causal::top_left ? i : i + keys_of(b) - queries_of(b);
  }

  /// docs/masks.md: query i of batch b, head h may see key j.
  bool visible(Index b, Index h, Index i, Index j) const {
    if (i >= queries_of(b) || j >= keys_of(b))
      return false;
    const Index c = diagonal(b, i);
    if (causal != Causal::none && j > c)
      return false;
    const bool sink_token = j < sink_tokens;  // exempt from the window only
    if (!sink_token && window_left >= 0 && j < c - window_left)
      return false;
    if (!sink_token && window_right >= 0 && j > c + window_right)
      return false;
    return (keep.empty() || keep.at(b, h, i, j)) && (!mask_mod || mask_mod(b, h, i, j));
  }

  /// The dropout factor of weight (b, h, i, j), from docs/training.md's rule: 0 when the
  /// counter-based hash of (seed, b, h, i, j) falls under p * 2^32, else 1 / (1 - p).
  long double dropout_factor(Index b, Index h, Index i, Index j) const {
    if (dropout_p == 0)
      return 1;
    const auto splitmix = [](std::uint64_t z) {
      z += 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      return z ^ (z >> 31);
    };
    std::uint64_t key = splitmix(dropout_seed);
    for (const Index n : {b, h, i})
      key = splitmix(key ^ static_cast<std::uint64_t>(n));
    std::uint32_t x =
        static_cast<std::uint32_t>(key >> 32) + static_cast<std::uint32_t>(j) * 0x9E3779B9u;
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    const long double threshold = std::round(dropout_p * 4294967296.0L);
    return static_cast<long double>(x) >= threshold ? 1 / (1 - dropout_p) : 0;
  }

  long double scale_or_default() const {
    return scale ? *scale : 1.0L / std::sqrt(static_cast<long double>(dim));
  }
};

/// Rounding applied to the raw scores (scale * q.k), to the normalised probabilities and
/// to the output: identity when empty.
template <class R>
struct Rounding {
  std::function<R(R)> scores, probabilities, out;
};

template <class R>
struct Result {
  std::vector<R> out;      ///< (B, Hq, Lq, Dv)
  std::vector<R> lse;      ///< (B, Hq, Lq); -inf for a row that sees no key
  std::vector<R> weights;  ///< (B, Hq, Lq, Lk); 0 for hidden keys; after dropout
};

/// Attention with every operation in R (long double, double or float), on inputs given
/// exactly as long double.
///   s_j  = softcap * tanh(x_j / softcap) - slope_h |c(i) - j| + bias   (visible j)
///   x_j  = score_mod(scale q.k_j, b, h, i, j)   (scale q.k_j without a score_mod)
///   out  = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),  m = max_j s_j
///   lse  = m + log sum_j exp(s_j - m)
/// With a sink logit z_h (gpt-oss), z_h joins the softmax and its column is dropped:
/// m = max(max_j s_j, z_h), the denominator gains exp(z_h - m) and lse includes it.
/// A row that sees no key (or only scores of -inf) outputs zeros and lse -inf (z_h with a
/// sink); a NaN score
/// makes the row NaN, and so does a +inf one. Compiled once, optimised, in reference.cpp: the
/// tests call it on problems of millions of multiply-adds.
template <class R>
Result<R> attention(const Problem& p,
                    const std::vector<long double>& q,  // (B, Hq, Lq, D)
                    const std::vector<long double>& k,  // (B, Hkv, Lk, D)
                    const std::vector<long double>& v,  // (B, Hkv, Lk, Dv)
                    const Rounding<R>& rounding = {});

extern template Result<long double> attention<long double>(const Problem&,
                                                           const std::vector<long double>&,
                                                           const std::vector<long double>&,
                                                           const std::vector<long double>&,
                                                           const Rounding<long double>&);
extern template Result<double> attention<double>(const Problem&, const std::vector<long double>&,
                                                 const std::vector<long double>&,
                                                 const std::vector<long double>&,
                                                 const Rounding<double>&);
extern template Result<float> attention<float>(const Problem&, const std::vector<long double>&,
                                               const std::vector<long double>&,
                                               const std::vector<long double>&,
                                               const Rounding<float>&);

/// The gradients of L = sum(out * dout) (dout (B, Hq, Lq, Dv)), in R, from the forward's
/// probabilities p, dropout factors f (1 without dropout), weights w = p f and out:
///   delta_i = dout_i . out_i;  ds_ij = p_ij (f_ij dout_i . v_j - delta_i)    (visible j)
///   dq_i = scale sum_j ds_ij g_ij k_j,  dk_j = scale sum_i ds_ij g_ij q_i,  dv_j = sum_i w_ij
///   dout_i
/// with g_ij = 1 - tanh^2(scale q_i . k_j / cap) under softcap (else 1); dbias (B, Hq, Lq, Lk)
/// = ds (the caller sums it over a bias's broadcast dimensions); dsinks_h = -sum over b, i of
/// exp(z_h - lse_i) delta_i. dk and dv sum over the query heads of a kv head.
/// Rounding applied to the weights w = p f before dv = sum w dout, and to the score
/// gradients scale ds g before dq and dk (a kernel whose backward products read them in a
/// narrower type): identity when empty.
template <class R>
struct GradientRounding {
  std::function<R(R)> weights, score_gradients;
};

template <class R>
struct Gradients {
  std::vector<R> dq, dk, dv;  ///< q's, k's and v's shapes
  std::vector<R> dbias;       ///< (B, Hq, Lq, Lk)
  std::vector<R> dsinks;      ///< (Hq), or empty
};

template <class R>
Gradients<R> gradients(const Problem& p,
                       const std::vector<long double>& q,     // (B, Hq, Lq, D)
                       const std::vector<long double>& k,     // (B, Hkv, Lk, D)
                       const std::vector<long double>& v,     // (B, Hkv, Lk, Dv)
                       const std::vector<long double>& dout,  // (B, Hq, Lq, Dv)
                       const GradientRounding<R>& rounding = {});

extern template Gradients<long double> gradients<long double>(const Problem&,
                                                              const std::vector<long double>&,
                                                              const std::vector<long double>&,
                                                              const std::vector<long double>&,
                                                              const std::vector<long double>&,
                                                              const GradientRounding<long double>&);
extern template Gradients<double> gradients<double>(const Problem&, const std::vector<long double>&,
                                                    const std::vector<long double>&,
                                                    const std::vector<long double>&,
                                                    const std::vector<long double>&,
                                                    const GradientRounding<double>&);
extern template Gradients<float> gradients<float>(const Problem&, const std::vector<long double>&,
                                                  const std::vector<long double>&,
                                                  const std::vector<long double>&,
                                                  const std::vector<long double>&,
                                                  const GradientRounding<float>&);

}  // namespace attn_test::reference
