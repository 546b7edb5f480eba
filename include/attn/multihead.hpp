// attn/multihead.hpp: multi-head attention, numerically equal to torch.nn.MultiheadAttention
// (batch_first=True, eval mode) for the same weights, plus grouped-query attention.
//
// Shape legend:
//   B batch   L query length   S key/value length   S' = S + add_bias_kv + add_zero_attn
//   E embed_dim   H num_heads   Hkv num_kv_heads   D = E / H   Ekv = Hkv * D
//   kdim / vdim   input widths of key and value (default E)
//
// Data flow of one call (no transposes, no copies between the GEMMs):
//   pass 1  projections into (B, L, H, D) / (B, S', Hkv, D) buffers. Self-attention with
//           kdim = vdim = E is ONE GEMM (B*L, E) x (E, E + 2*Ekv) into a (B, L, E + 2*Ekv)
//           buffer; q, k and v are column blocks of it (the buffers' layout, which the
//           backward shares: detail::ProjectionLayout, attn/multihead/layout.hpp).
//   pass 2  scaled_dot_product_attention_into reads q, k, v through strided (B, H, L, D)
//           head views and writes (B, L, H, D) = (B, L, E) directly (heads merged for free).
//   pass 3  output projection: one GEMM (B*L, E) x (E, E).
//
// !!! MASK POLARITY !!!  MultiHeadAttention keeps PyTorch *MultiheadAttention*'s polarity:
//   key_padding_mask  (B, S)             bool, TRUE = IGNORE this key (padding)
//   attn_mask         (L, S) or (B*H, L, S)  bool, TRUE = NOT ALLOWED to attend
// That is the OPPOSITE of scaled_dot_product_attention's AttentionOptions::keep_mask
// (true = may attend, PyTorch SDPA's polarity). Ported code passes its masks unchanged.
//   float_attn_mask   (L, S) or (B*H, L, S)  float, ADDED to the scores (-inf hides a key)
//   is_causal         top-left causal: query i sees keys j <= i (keys appended by
//                     add_bias_kv / add_zero_attn stay visible, as torch pads its mask)
// A (B*H, L, S) mask is indexed [b * H + h] as in PyTorch.
// options.attention (AttentionOptions, SDPA's conventions) adds the attention's own options
// on top: window, ALiBi, softcap, sinks, mods, scale, kernel, dropout (see arguments.hpp).
// A query row that sees no key outputs zeros (the library's rule; torch returns NaN).
//
// Weight layouts (PyTorch state_dict names, (out x in) as in torch):
//   in_proj_weight (E + 2*Ekv, E), in_proj_bias (E + 2*Ekv)    when kdim = vdim = E
//   q_proj_weight (E, E), k_proj_weight (Ekv, kdim), v_proj_weight (Ekv, vdim)   otherwise
//   bias_k, bias_v (1, 1, Ekv)   with add_bias_kv
//   out_proj.weight (E, E), out_proj.bias (E)
// With Hkv = H (the default) Ekv = E and these are exactly torch's shapes.
//
// Rotary position embeddings (config.rotary, off by default; attn/rope.hpp): q and k are
// rotated after the input projection, before the attention, which torch's module does not
// do (Llama-style models do). forward: query token i at position i, key j at position j;
// forward_packed: positions restart at 0 in every sequence; forward_incremental: the new
// keys are rotated once at lengths[b] + t (a paged cache: at each sequence's length + t) as
// they enter the cache, the queries at the same positions. Not combinable with add_bias_kv
// or add_zero_attn (those rows have no position).
//
// Training: forward_train returns the output and a MultiHeadAttentionContext (the inputs,
// the projections, the attention output before out_proj, its log-sum-exp, the masks);
// backward(context, doutput) returns the input gradients and every parameter's gradient
// keyed as state_dict() (docs/training.md#multi-head-attention).
//
// The class in parts, one concern a header (this header includes them all; include it):
//   attn/multihead/arguments.hpp  the configuration, options, outputs, context, gradients
//   attn/multihead/layout.hpp     the projection-buffer layout of every call path
//   attn/multihead/module.hpp     the class: construction, accessors, forward, forward_into
//   attn/multihead/sequences.hpp  forward_incremental on a KVCache or a PagedKVCache,
//                                 forward_packed
//   attn/multihead/torch.hpp      PyTorch compatibility: state dicts, MHA-polarity masks,
//                                 the rows of add_bias_kv and add_zero_attn
//   attn/multihead/training.hpp   forward_train, backward, backward_into
#pragma once

#include "attn/heads.hpp"  // split_heads, merge_heads, kv_head_for, as before the split
#include "attn/multihead/arguments.hpp"
#include "attn/multihead/layout.hpp"
#include "attn/multihead/module.hpp"
#include "attn/multihead/sequences.hpp"
#include "attn/multihead/torch.hpp"
#include "attn/multihead/training.hpp"

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_MULTIHEAD_CLASSES(ATTN_EXTERN_CLASS)
#endif
