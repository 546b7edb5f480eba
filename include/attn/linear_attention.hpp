// attn/linear_attention.hpp: linear attention (Katharopoulos et al. 2020, "Transformers are
// RNNs"), its causal form by chunked prefix sums, a recurrent state for token-by-token
// decoding, and FAVOR+ positive random features (Choromanski et al. 2021, "Performer").
//
//   out_i = phi(q_i) S / (phi(q_i) . z + eps),   S = sum_j phi(k_j) v_j^T   (M, Dv)
//                                                z = sum_j phi(k_j)         (M)
//
// the sums running over the keys j that query i may see: every key below key_lengths[b]
// (non-causal), and also j <= i + offset (causal; offset per sequence as in mask.hpp: 0 for
// top_left, key_lengths[b] - Lq for bottom_right, Lk - Lq without key_lengths). That is
// softmax attention with exp(q . k) replaced by the kernel phi(q) . phi(k): the weights
// phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j') are a proper
// average over the keys as long as phi is positive.
//
//   q    (B, Hq,  Lq, D)   or one head (Lq, D)
//   k    (B, Hkv, Lk, D)   or (Lk, D)
//   v    (B, Hkv, Lk, Dv)  or (Lk, Dv)
//   out  (B, Hq,  Lq, Dv)  or (Lq, Dv)
//   M    features of phi: D for elu_plus_one, relu and identity; m for FAVOR+; your choice
//        for a custom map.
//
// Grouped-query attention as in attention.hpp (query head h reads kv head h / (Hq / Hkv)).
//
// Cost per kv head: non-causal O((Lq * group + Lk) * M * Dv), causal the same plus
// O(L * C * (M + Dv)) for the intra-chunk products (C = chunk rows, default 16); no (Lq, Lk)
// matrix is ever formed, and the causal form has no per-token loop: each chunk is a handful
// of GEMMs against the running state.
// Extra memory per thread (the one statement of it; docs/linear-attention.md links here), the
// forward: the state (M, Dv) + (M), and chunk buffers of C * (2 M + 1) scalars, plus C^2
// causal: 6480 scalars (25 KiB for float) at D = Dv = M = 64, C = 16, causal, whatever L is.
// The backward: the states S, z, R, r, 2 (M * Dv + M); chunk buffers C * (4 M + 2 Dv + 1),
// plus C * (Dv + 1) non-causal or 2 C^2 causal; and, causal only, u and c of every query row
// of a (batch, kv head) item, group * Lq * (Dv + 1), group = Hq / Hkv: 1 MiB of float at
// Lq = 4096, Dv = 64, group 1. The recurrent state: linear/state.hpp.
//
// Not supported (rejected with std::invalid_argument, never ignored): keep_mask and bias,
// which act on individual (query, key) scores that linear attention never forms.
//
// The self-attention tutorial (section 12) normalises by 1 / sum(q_i) with no feature map: the keys
//
// The parts: linear/feature_map.hpp (phi, FAVOR+), linear/forward.hpp (options and the
// forward), linear/backward.hpp (the gradients), linear/state.hpp (the recurrent state).
#pragma once

#include "attn/linear/backward.hpp"
#include "attn/linear/feature_map.hpp"
#include "attn/linear/forward.hpp"
#include "attn/linear/state.hpp"

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_LINEAR_ATTENTION_INSTANCES(ATTN_EXTERN_INSTANCE)
ATTN_LINEAR_ATTENTION_CLASSES(ATTN_EXTERN_CLASS)
#endif
