// Test support: one call of scaled_dot_product_attention_into on Heads storage, with out and
// the log-sum-exp in float (the precision tests compare both with the reference).
#pragma once

#include <attn/attention.hpp>

#include "support/heads.hpp"

namespace attn_test {

/// out (B, Hq, Lq, Dv) and the log-sum-exp (B, Hq, Lq, 1) of one call, in float.
struct OutAndLse {
  Heads<float> out, lse;
};

/// scaled_dot_product_attention_into over q, k and v stored as S, with `options`.
template <class S>
OutAndLse out_and_lse(const Heads<S>& q,  // (B, Hq, Lq, D)
                      const Heads<S>& k,  // (B, Hkv, Lk, D)
                      const Heads<S>& v,  // (B, Hkv, Lk, Dv)
                      const attn::AttentionOptions<float>& options) {
  OutAndLse r{Heads<float>(q.b, q.h, q.l, v.d), Heads<float>(q.b, q.h, q.l, 1)};
  attn::AttentionOutputViews<float> outputs(r.out.view());
  outputs.logsumexp =
      attn::RowsView<float>{r.lse.data.data(), q.b, q.h, q.l, q.h * q.l, q.l, nullptr};
  attn::scaled_dot_product_attention_into<S, S, float>(q.cview(), k.cview(), v.cview(), outputs,
                                                       options);
  return r;
}

}  // namespace attn_test
