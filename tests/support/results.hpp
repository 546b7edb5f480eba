// Test support: the out of a value-form result (attn::AttentionOutputs,
// attn::HeadAttentionOutputs), with its optional results moved into the caller's variables,
// for tests that check out, the weights and the log-sum-exp of one call.
#pragma once

#include <utility>

namespace attn_test {

/// r.out; r.weights moved into *weights and r.logsumexp into *logsumexp when not null.
template <class Result>
auto out_of(Result&& r, decltype(r.weights)* weights, decltype(r.logsumexp)* logsumexp) {
  if (weights != nullptr)
    *weights = std::move(r.weights);
  if (logsumexp != nullptr)
    *logsumexp = std::move(r.logsumexp);
  return std::move(r.out);
}

}  // namespace attn_test
