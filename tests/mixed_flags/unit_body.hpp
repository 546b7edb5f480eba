// The body of every unit of tests/mixed_flags, compiled once per unit with that unit's flags:
// everything here has internal linkage, so each unit keeps its own copy.
#pragma once

#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>

#include "unit.hpp"

namespace {

mixed_flags::Results compute_in_this_unit(const mixed_flags::Inputs& inputs) {
  using attn::Index;
  constexpr Index heads = mixed_flags::Inputs::heads, length = mixed_flags::Inputs::length,
                  dim = mixed_flags::Inputs::dim;
  const attn::TensorMap<const float, 4> q(inputs.q.data(), 1, heads, length, dim),
      k(inputs.k.data(), 1, heads, length, dim), v(inputs.v.data(), 1, heads, length, dim);
  const auto flat = [](const attn::Tensor<float, 4>& t) {
    return std::vector<float>(t.data(), t.data() + t.size());
  };
  mixed_flags::Results results;
  results.isa = attn::isa_name(attn::active_isa());
  attn::AttentionOptions<float> options;
  const attn::AttentionShape shape{1, heads, heads, length, length, dim, dim};
  for (const attn::Algorithm algorithm :
       {attn::Algorithm::automatic, attn::Algorithm::flash, attn::Algorithm::decode}) {
    options.algorithm = algorithm;
    results.plans.push_back(attn::plan_attention<float>(shape, options).describe());
    results.plans.push_back(
        attn::plan_attention<float>({1, heads, 1, 4, 4096, dim, dim}, options).describe());
  }
  options.algorithm = attn::Algorithm::flash;
  results.flash = flat(attn::scaled_dot_product_attention(q, k, v, options));
  options.causal = attn::Causal::top_left;
  results.flash_causal = flat(attn::scaled_dot_product_attention(q, k, v, options));
  options.algorithm = attn::Algorithm::decode;
  results.decode = flat(attn::scaled_dot_product_attention(q, k, v, options));
  options.algorithm = attn::Algorithm::naive;
  results.naive = flat(attn::scaled_dot_product_attention(q, k, v, options));
  options.algorithm = attn::Algorithm::flash;
  const attn::Tensor<Eigen::half, 4> k_half = k.cast<Eigen::half>(), v_half = v.cast<Eigen::half>();
  results.flash_half_kv =
      flat(attn::scaled_dot_product_attention<float>(q, k_half, v_half, options));
  return results;
}

}  // namespace
