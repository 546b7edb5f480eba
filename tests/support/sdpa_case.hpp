// Test support: one case of tests/reference/sdpa.json, loaded in a scalar type, with the
// AttentionOptions it describes.
#pragma once

#include <string>
#include <vector>

#include <attn/attention.hpp>

#include "support/fixtures.hpp"

namespace attn_test {

/// One sdpa.json case, loaded in scalar type T.
template <class T>
struct SdpaCase {
  std::string name;
  attn::Tensor<T, 4> q, k, v;  // (B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
  attn::Tensor<bool, 4> keep_mask;
  attn::Tensor<T, 4> bias;
  attn::AttentionOptions<T> options;
  std::vector<double> out, weights, lse;  // expected, float64

  explicit SdpaCase(const json& c) : name(c.at("name").get<std::string>()) {
    q = tensor<T, 4>(c.at("q"));
    k = tensor<T, 4>(c.at("k"));
    v = tensor<T, 4>(c.at("v"));
    if (!c.at("scale").is_null())
      options.scale = static_cast<T>(c.at("scale").get<double>());
    const std::string causal = c.at("causal").get<std::string>();
    options.causal = causal == "top_left"       ? attn::Causal::top_left
                     : causal == "bottom_right" ? attn::Causal::bottom_right
                                                : attn::Causal::none;
    const auto window = c.at("window").get<std::vector<Index>>();
    options.window = {window.at(0), window.at(1)};
    if (!c.at("key_lengths").is_null())
      options.key_lengths = c.at("key_lengths").get<std::vector<Index>>();
    if (!c.at("keep_mask").is_null()) {
      keep_mask = tensor<bool, 4>(c.at("keep_mask"));
      options.keep_mask = keep_mask;
    }
    if (!c.at("bias").is_null()) {
      bias = tensor<T, 4>(c.at("bias"));
      options.bias = bias;
    }
    if (c.contains("alibi_slopes") && !c.at("alibi_slopes").is_null()) {
      for (const double slope : c.at("alibi_slopes").get<std::vector<double>>())
        options.alibi_slopes.push_back(static_cast<T>(slope));
    }
    if (c.contains("softcap") && !c.at("softcap").is_null())
      options.softcap = static_cast<T>(c.at("softcap").get<double>());
    if (!c.at("query_lengths").is_null())
      options.query_lengths = c.at("query_lengths").get<std::vector<Index>>();
    options.sink_tokens = c.at("sink_tokens").get<Index>();
    if (!c.at("sinks").is_null()) {
      for (const double sink : c.at("sinks").get<std::vector<double>>())
        options.sinks.push_back(static_cast<T>(sink));
    }
    out = values<double>(c.at("out"));
    weights = values<double>(c.at("weights"));
    lse = values<double>(c.at("lse"));
  }
  // Options point into this object's tensors: neither copy nor move it.
  SdpaCase(const SdpaCase&) = delete;
  SdpaCase& operator=(const SdpaCase&) = delete;
};

}  // namespace attn_test
