// Test support: random attention problems under every mask kind, described once and handed
// both to the independent reference (support/reference.hpp) and, as AttentionOptions<T>, to
// attn; and the error measure and bound the kernel tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>

#include "support/heads.hpp"
#include "support/isa_cases.hpp"
#include "support/reference.hpp"

namespace attn_test {

using attn::Index;

/// The mask kinds the kernel, decode and precision tests sweep.
inline const char* const mask_kind_names[] = {
    "none",
    "causal top-left",
    "causal bottom-right",
    "window (3, 2)",
    "window (-1, 0) + key lengths with an empty sequence",
    "window (0, 4)",
    "keep-mask (B, H, Lq, Lk)",
    "bias (1, H, Lq, Lk) with -inf",
    "causal bottom-right + window left 5 + key lengths + keep-mask (B, 1, 1, Lk) + bias",
    "causal top-left + window (4, -1) + bias (1, 1, Lq, Lk)",
    "causal bottom-right + ALiBi + softcap 3",
    "softcap 3 + key lengths",
    "causal bottom-right + window (6, -1) + keep-mask (B, 1, 1, Lk) + bias + ALiBi + softcap 3",
    "causal bottom-right + ragged query and key lengths",
    "causal top-left + window (2, -1) + ragged query lengths with an empty sequence",
    "causal bottom-right + window (4, -1) + 3 sink tokens",
    "learned sinks + causal bottom-right + key lengths with an empty sequence",
    "learned sinks + 2 sink tokens + window (3, 1) + ragged lengths + ALiBi + softcap 3",
};
inline constexpr int mask_kinds = sizeof(mask_kind_names) / sizeof(mask_kind_names[0]);

/// A problem of the given sizes with no mask.
inline reference::Problem sized_problem(Index batch, Index q_heads, Index kv_heads, Index q_length,
                                        Index k_length, Index dim, Index value_dim) {
  reference::Problem p;
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.q_length = q_length;
  p.k_length = k_length;
  p.dim = dim;
  p.value_dim = value_dim;
  return p;
}

/// A problem of the given sizes under mask kind `kind`; masks and biases drawn from `rng`.
inline reference::Problem masked_problem(Index batch, Index q_heads, Index kv_heads, Index q_length,
                                         Index k_length, Index dim, Index value_dim, int kind,
                                         std::mt19937& rng) {
  reference::Problem p =
      sized_problem(batch, q_heads, kv_heads, q_length, k_length, dim, value_dim);
  std::bernoulli_distribution keep(0.7), hide(0.1);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto lengths = [&](bool with_empty) {
    std::vector<Index> l;
    for (Index b = 0; b < batch; ++b) {
      const Index pattern[3] = {k_length, with_empty ? 0 : k_length / 2,
                                with_empty ? k_length / 2 : 0};
      l.push_back(pattern[b % 3]);
    }
    return l;
  };
  // Every sequence its own lengths: queries n_q(b) in (0, Lq], keys n_k(b) around it.
  const auto ragged = [&](bool with_empty) {
    for (Index b = 0; b < batch; ++b) {
      const Index nq = with_empty && b % 3 == 1 ? 0 : 1 + (q_length - 1) * (b % 3 + 1) / 3;
      p.query_lengths.push_back(std::min(nq, q_length));
      p.key_lengths.push_back(std::max(Index(0), k_length - (b % 2) * (k_length / 3)));
    }
  };
  const auto learned_sinks = [&] {
    for (Index h = 0; h < q_heads; ++h)
      p.sinks.push_back(static_cast<long double>(normal(rng)) + 1.0L);
  };
  const auto keep_mask = [&](std::array<Index, 4> dims) {
    p.keep.dims = dims;
    p.keep.data.resize(static_cast<std::size_t>(dims[0] * dims[1] * dims[2] * dims[3]));
    for (std::size_t n = 0; n < p.keep.data.size(); ++n)
      p.keep.data[n] = keep(rng);
  };
  const auto bias = [&](std::array<Index, 4> dims, bool with_minus_inf) {
    p.bias.dims = dims;
    p.bias.data.resize(static_cast<std::size_t>(dims[0] * dims[1] * dims[2] * dims[3]));
    for (long double& x : p.bias.data) {
      x = with_minus_inf && hide(rng) ? -std::numeric_limits<long double>::infinity()
                                      : static_cast<long double>(normal(rng));
    }
  };
  const auto alibi = [&] {
    // The ALiBi authors' schedule for a power of two heads, 2^(-8 h / H), for any H here.
    for (Index h = 0; h < q_heads; ++h)
      p.alibi_slopes.push_back(std::pow(
          2.0L, -8.0L * static_cast<long double>(h + 1) / static_cast<long double>(q_heads)));
  };
  using reference::Causal;
  switch (kind) {
    case 1:
      p.causal = Causal::top_left;
      break;
    case 2:
      p.causal = Causal::bottom_right;
      break;
    case 3:
      p.window_left = 3;
      p.window_right = 2;
      break;
    case 4:
      p.window_right = 0;
      p.key_lengths = lengths(true);
      break;
    case 5:
      p.window_left = 0;
      p.window_right = 4;
      break;
    case 6:
      keep_mask({batch, q_heads, q_length, k_length});
      break;
    case 7:
      bias({1, q_heads, q_length, k_length}, true);
      break;
    case 8:
      p.causal = Causal::bottom_right;
      p.window_left = 5;
      p.key_lengths = lengths(false);
      keep_mask({batch, 1, 1, k_length});
      bias({1, q_heads, q_length, k_length}, false);
      break;
    case 9:
      p.causal = Causal::top_left;
      p.window_left = 4;
      bias({1, 1, q_length, k_length}, false);
      break;
    case 10:
      p.causal = Causal::bottom_right;
      alibi();
      p.softcap = 3;
      break;
    case 11:
      p.softcap = 3;
      p.key_lengths = lengths(false);
      break;
    case 12:
      p.causal = Causal::bottom_right;
      p.window_left = 6;
      keep_mask({batch, 1, 1, k_length});
      bias({1, q_heads, q_length, k_length}, false);
      alibi();
      p.softcap = 3;
      break;
    case 13:
      p.causal = Causal::bottom_right;
      ragged(false);
      break;
    case 14:
      p.causal = Causal::top_left;
      p.window_left = 2;
      ragged(true);
      p.key_lengths.clear();
      break;
    case 15:
      p.causal = Causal::bottom_right;
      p.window_left = 4;
      p.sink_tokens = 3;
      break;
    case 16:
      learned_sinks();
      p.causal = Causal::bottom_right;
      p.key_lengths = lengths(true);
      break;
    case 17:
      learned_sinks();
      p.sink_tokens = 2;
      p.window_left = 3;
      p.window_right = 1;
      ragged(false);
      alibi();
      p.softcap = 3;
      break;
    default:
      break;
  }
  return p;
}

/// Rounds the problem's own numbers (bias, ALiBi slopes, softcap, scale) to T, so that the
/// reference computes from exactly what a kernel in T is given.
template <class T>
void round_numbers_to(reference::Problem& p) {
  const auto round = [](long double x) { return static_cast<long double>(static_cast<T>(x)); };
  for (long double& x : p.bias.data)
    x = round(x);
  for (long double& x : p.alibi_slopes)
    x = round(x);
  for (long double& x : p.sinks)
    x = round(x);
  if (p.softcap)
    p.softcap = round(*p.softcap);
  // attn's default, 1 / sqrt(D) in T, made explicit so that both sides scale alike
  p.scale =
      p.scale ? round(*p.scale) : static_cast<long double>(T(1) / std::sqrt(static_cast<T>(p.dim)));
}

inline std::string describe(const reference::Problem& p, int kind) {
  return "B " + std::to_string(p.batch) + ", Hq " + std::to_string(p.q_heads) + ", Hkv " +
         std::to_string(p.kv_heads) + ", Lq " + std::to_string(p.q_length) + ", Lk " +
         std::to_string(p.k_length) + ", D " + std::to_string(p.dim) + ", Dv " +
         std::to_string(p.value_dim) + ", mask: " + mask_kind_names[kind];
}

/// The same problem as attn's AttentionOptions<T>, with the tensors its views point into.
/// Neither copyable nor movable: `options` points into this object.
template <class T>
struct AttnOptions {
  attn::Tensor<bool, 4> keep;
  attn::Tensor<T, 4> bias;
  attn::AttentionOptions<T> options;

  explicit AttnOptions(const reference::Problem& p) {
    using reference::Causal;
    options.causal = p.causal == Causal::top_left       ? attn::Causal::top_left
                     : p.causal == Causal::bottom_right ? attn::Causal::bottom_right
                                                        : attn::Causal::none;
    options.window = {p.window_left, p.window_right};
    options.key_lengths = p.key_lengths;
    options.query_lengths = p.query_lengths;
    options.sink_tokens = p.sink_tokens;
    for (const long double sink : p.sinks)
      options.sinks.push_back(static_cast<T>(sink));
    if (p.scale)
      options.scale = static_cast<T>(*p.scale);
    if (!p.keep.empty()) {
      keep.resize(p.keep.dims[0], p.keep.dims[1], p.keep.dims[2], p.keep.dims[3]);
      std::copy(p.keep.data.begin(), p.keep.data.end(), keep.data());
      options.keep_mask = keep;
    }
    if (!p.bias.empty()) {
      bias.resize(p.bias.dims[0], p.bias.dims[1], p.bias.dims[2], p.bias.dims[3]);
      std::transform(p.bias.data.begin(), p.bias.data.end(), bias.data(),
                     [](long double x) { return static_cast<T>(x); });
      options.bias = bias;
    }
    for (const long double slope : p.alibi_slopes)
      options.alibi_slopes.push_back(static_cast<T>(slope));
    if (p.softcap)
      options.softcap = static_cast<T>(*p.softcap);
    options.dropout_p = static_cast<T>(p.dropout_p);
    options.dropout_seed = p.dropout_seed;
  }
  AttnOptions(const AttnOptions&) = delete;
  AttnOptions& operator=(const AttnOptions&) = delete;
};

/// x as long double, exactly (16-bit values go through float).
template <class T>
long double exact_value(T x) {
  if constexpr (attn::is_16bit_scalar_v<T>)
    return static_cast<long double>(static_cast<float>(x));
  else
    return static_cast<long double>(x);
}

/// Where the reference's inputs come from: the values a kernel sees, as long double.
template <class T>
std::vector<long double> exact(const Heads<T>& x) {
  std::vector<long double> r(x.data.size());
  std::transform(x.data.begin(), x.data.end(), r.begin(), [](T e) { return exact_value(e); });
  return r;
}

/// max |actual - expected| over the elements; a mismatch in non-finite values (NaN where
/// the reference has a number, or the reverse, or infinities that differ) is infinite.
template <class A, class E>
double max_error(const std::vector<A>& actual, const std::vector<E>& expected) {
  if (actual.size() != expected.size())
    return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (std::size_t n = 0; n < expected.size(); ++n) {
    const long double a = exact_value(actual[n]), e = exact_value(expected[n]);
    if (!std::isfinite(e) || !std::isfinite(a)) {
      if (!(a == e || (std::isnan(a) && std::isnan(e))))
        return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, static_cast<double>(std::abs(a - e)));
  }
  return worst;
}

/// The error bound of every kernel (FlashAttention's rule): at most twice the error of a
/// plain implementation in the same precision, plus a floor of 32 eps for outputs that
/// plain rounding happens to get exactly.
template <class T>
double error_bound(double plain_error) {
  return 2 * plain_error + 32 * static_cast<double>(std::numeric_limits<T>::epsilon());
}

// Compiled once, in tests/support/helpers.cpp (see heads.hpp).
#define ATTN_TEST_ERROR_INSTANCES(X, T)                              \
  X template std::vector<long double> exact<T>(const Heads<T>&);     \
  X template double max_error<T, long double>(const std::vector<T>&, \
                                              const std::vector<long double>&);

ATTN_TEST_ERROR_INSTANCES(extern, float)
ATTN_TEST_ERROR_INSTANCES(extern, double)
ATTN_TEST_ERROR_INSTANCES(extern, Eigen::half)
ATTN_TEST_ERROR_INSTANCES(extern, Eigen::bfloat16)

}  // namespace attn_test
