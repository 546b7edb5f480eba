// attn/attention_backward.hpp: the gradients of scaled dot-product attention.
//
//   q, dq      (B, Hq,  Lq, D)     given dout = dL/dout, the forward's out and log-sum-exp,
//   k, dk      (B, Hkv, Lk, D)     returns dq, dk, dv (and on request the bias's gradient,
//   v, dv      (B, Hkv, Lk, Dv)    and the learned sinks' when there are sinks)
//   out, dout  (B, Hq,  Lq, Dv)
//   logsumexp  (B, Hq,  Lq)        the forward's (scaled_dot_product_attention's `logsumexp`)
//
// Every option of the forward: causal (both alignments), window, key and query lengths, sink
// tokens, keep-mask, bias (dbias summed over its broadcast dimensions, as torch's autograd
// does), ALiBi, softcap (through tanh), learned sinks (dsinks), scale, D != Dv, grouped-query
// heads (dk and dv summed over the query heads that share a kv head), 16-bit storage (the
// arithmetic in float). A query row that sees no key has zero gradients, and so have keys no
// query sees. docs/training.md has the formulas and the differences from PyTorch.
//
// Algorithm::naive materialises the probabilities of a head (the reference); every other
// value (automatic, flash, chunked, decode) runs the flash backward (kernels/flash_backward.hpp),
// whose memory does not grow with Lq or Lk. Both are deterministic: bitwise the same result
// for any thread count.
//
// Packed sequences: packed views (packed_view()) as in the forward, logsumexp (Hq, Tq); the
// same kernels, with (sequence, kv head) work items.
#pragma once

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/attention.hpp"
#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/backward_views.hpp"
#include "attn/kernels/flash_backward.hpp"
#include "attn/kernels/naive_backward.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {

/// The checks every backward call makes on its (B, H, L, D) views, padded or packed: out,
/// dout and the gradients' shapes, the log-sum-exp, overlaps, and the gradients asked for
/// that the options cannot give.
template <class S>
void check_backward_arguments(const char* function,
                              const HeadsView<const S>& q,                     // (B, Hq, Lq, D)
                              const HeadsView<const S>& k,                     // (B, Hkv, Lk, D)
                              const HeadsView<const S>& v,                     // (B, Hkv, Lk, Dv)
                              const HeadsView<const S>& out,                   // (B, Hq, Lq, Dv)
                              const RowsView<const compute_scalar_t<S>>& lse,  // (B, Hq, Lq)
                              const HeadsView<const S>& dout,                  // (B, Hq, Lq, Dv)
                              const AttentionGradientViews<S>& g,
                              const AttentionOptions<compute_scalar_t<S>>& options) {
  using C = compute_scalar_t<S>;
  check_attention_shapes(function, q, k, v);
  const std::array<Index, 4> out_shape{q.batch, q.heads, q.length, v.dim};
  check_shape(function, "out", out.shape(), out_shape, "(B, Hq, Lq, Dv)");
  check_shape(function, "dout", dout.shape(), out_shape, "(B, Hq, Lq, Dv)");
  check_shape(function, "dq", g.dq.shape(), q.shape(), "(B, Hq, Lq, D), q's shape");
  check_shape(function, "dk", g.dk.shape(), k.shape(), "(B, Hkv, Lk, D), k's shape");
  check_shape(function, "dv", g.dv.shape(), v.shape(), "(B, Hkv, Lk, Dv), v's shape");
  check_rows_shape(function, "logsumexp", lse, q);
  if (g.dbias) {
    if (options.bias.empty())
      throw_invalid_argument(function, "dbias was requested but options.bias is not given");
    check_shape(function, "dbias", g.dbias->shape(), options.bias.dims(), "(options.bias's dims)");
  }
  if (g.dsinks) {
    if (options.sinks.empty())
      throw_invalid_argument(function, "dsinks was requested but options.sinks is not given");
    if (g.dsinks->size() != q.heads) {
      throw_invalid_argument(function,
                             "dsinks has " + std::to_string(g.dsinks->size()) +
                                 " entries but must have Hq = " + std::to_string(q.heads));
    }
  }
  // The gradients must not overlap any input or each other.
  const std::pair<const char*, HeadsView<S>> outputs[] = {{"dq", g.dq}, {"dk", g.dk}, {"dv", g.dv}};
  const std::pair<const char*, HeadsView<const S>> inputs[] = {
      {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}};
  for (std::size_t a = 0; a < 3; ++a) {
    for (const auto& [name, input] : inputs) {
      if (views_may_overlap(HeadsView<const S>(outputs[a].second), input)) {
        throw_invalid_argument(function, std::string(outputs[a].first) + " overlaps " + name +
                                             ": the gradients must share no element with "
                                             "the inputs");
      }
    }
    for (std::size_t b = a + 1; b < 3; ++b) {
      if (views_may_overlap(HeadsView<const S>(outputs[a].second),
                            HeadsView<const S>(outputs[b].second))) {
        throw_invalid_argument(function, std::string(outputs[a].first) + " overlaps " +
                                             outputs[b].first + ": the gradients must not overlap");
      }
    }
  }
  // dbias and dsinks (compute scalar) against everything else, by bytes.
  const auto overlaps_any = [&](const HeadsView<const C>& x) {
    const auto hits = [&](const auto& named) { return byte_ranges_overlap<C, S>(x, named.second); };
    return byte_ranges_overlap(x, rows_as_heads(lse)) ||
           std::any_of(std::begin(inputs), std::end(inputs), hits) ||
           std::any_of(std::begin(outputs), std::end(outputs), hits);
  };
  std::optional<HeadsView<const C>> dbias, dsinks;
  if (g.dbias)
    dbias = *g.dbias;
  if (g.dsinks)
    dsinks =
        HeadsView<const C>{g.dsinks->data(), 1, 1, 1, g.dsinks->size(), 0, 0, g.dsinks->size()};
  if (dbias && (overlaps_any(*dbias) || (dsinks && byte_ranges_overlap(*dbias, *dsinks)))) {
    throw_invalid_argument(function,
                           "dbias overlaps another argument: the gradients must share no element "
                           "with the inputs or each other");
  }
  if (dsinks && overlaps_any(*dsinks)) {
    throw_invalid_argument(function,
                           "dsinks overlaps another argument: the gradients must share no element "
                           "with the inputs or each other");
  }
  if (options.score_mod) {
    throw_invalid_argument(function,
                           "options.score_mod is forward only: a score_mod has no derivative "
                           "here (mask_mod and block_mask are supported)");
  }
}

/// Runs a validated backward: views padded or packed (then `options` are per_sequence_options).
template <class S>
void run_backward(const char* function, const BackwardViews<S>& views,
                  const AttentionOptions<compute_scalar_t<S>>& options,
                  const AttentionGradientViews<S>& g) {
  using T = compute_scalar_t<S>;
  const HeadsView<const S>&q = views.q, &k = views.k;
  const T scale = resolve_scale(function, options.scale, q.dim);
  AttentionShape shape{q.batch, q.heads, k.heads, q.length, k.length, q.dim, views.v.dim};
  shape.bf16_readable_kv = bf16_readable_v<S>;  // (q and dout are stored as S too)
  const KernelPlan plan = plan_backward<T>(shape, options, function);
  const AttentionProblem<T> problem(function, q.batch, q.heads, q.length, k.length, options,
                                    plan.isa);
  if (plan.algorithm == Algorithm::naive)
    run_naive_backward(plan, views, problem, options.softcap, scale);
  else
    run_flash_backward(plan, views, problem, options.softcap, scale);
  if (g.dbias)
    run_bias_gradient(plan, views, problem, scale, *g.dbias);
  if (g.dsinks)
    sink_gradients(views.out, views.dout, views.lse, problem, *g.dsinks);
}

/// The implementation of scaled_dot_product_attention_backward_into (see there).
template <class S>
void attention_backward_into(const HeadsView<const S>& q,                     // (B, Hq, Lq, D)
                             const HeadsView<const S>& k,                     // (B, Hkv, Lk, D)
                             const HeadsView<const S>& v,                     // (B, Hkv, Lk, Dv)
                             const HeadsView<const S>& out,                   // (B, Hq, Lq, Dv)
                             const RowsView<const compute_scalar_t<S>>& lse,  // (B, Hq, Lq)
                             const HeadsView<const S>& dout,                  // (B, Hq, Lq, Dv)
                             const AttentionGradientViews<S>& g,
                             const AttentionOptions<compute_scalar_t<S>>& options) {
  static_assert(is_storage_scalar_v<S>,
                "scaled_dot_product_attention_backward: scalars must be floating point, "
                "Eigen::half or Eigen::bfloat16");
  constexpr const char* function = "scaled_dot_product_attention_backward";
  // Packing first: views on other sequences also have other lengths, and that is the cause.
  const bool packed = check_packing(
      function,
      {packed_rows("q", q), packed_rows("out", out), packed_rows("logsumexp", rows_as_heads(lse)),
       packed_rows("dout", dout), packed_rows("dq", g.dq)},
      {packed_rows("k", k), packed_rows("v", v), packed_rows("dk", g.dk), packed_rows("dv", g.dv)});
  check_attention_shapes(function, q, k, v);
  if (packed)
    check_packed_options(function, options);
  check_backward_arguments(function, q, k, v, out, lse, dout, g, options);
  const BackwardViews<S> views{q, k, v, out, dout, row_values(lse), g.dq, g.dk, g.dv};
  run_backward(function, views, packed ? per_sequence_options(options, q, k) : options, g);
}

}  // namespace detail

/// Gradients on (B, H, L, D) views (any strides, e.g. (B, L, H, D) memory), written into
/// grads.dq, dk and dv, which must share no element with the inputs or each other.
/// `logsumexp` (B, Hq, Lq) as the forward returned it for the same options. Optional, when
/// their views are given: grads.dbias, the bias's gradient in the bias's own dims
/// (options.bias must be given), and grads.dsinks (Hq), the learned sinks' (options.sinks
/// must be given); both in the compute scalar. Packed sequences: every view packed as in the
/// forward (q, out, dout and dq with cu_seqlens_q; k, v, dk and dv with cu_seqlens_k),
/// `logsumexp` packed_view() of (Hq, Tq); every option of the packed forward, each within
/// its sequence (dropout, mask_mod and block_mask see the sequence's index as b); dsinks
/// summed over the sequences.
template <class T>
void scaled_dot_product_attention_backward_into(
    const HeadsView<const T>& q,                                 // (B, Hq, Lq, D)
    const HeadsView<const T>& k,                                 // (B, Hkv, Lk, D)
    const HeadsView<const T>& v,                                 // (B, Hkv, Lk, Dv)
    const HeadsView<const T>& out,                               // (B, Hq, Lq, Dv)
    const RowsView<const compute_scalar_t<T>>& logsumexp,        // (B, Hq, Lq)
    const HeadsView<const T>& dout,                              // (B, Hq, Lq, Dv)
    const AttentionGradientViews<detail::identity_t<T>>& grads,  // dq, dk, dv, ...
    const AttentionOptions<compute_scalar_t<T>>& options = {}) {
  detail::attention_backward_into<T>(q, k, v, out, logsumexp, dout, grads, options);
}

/// Gradients of batched attention on rank-4 row-major tensors or tensor maps (B, H, L, D) of
/// one scalar: `out` and `logsumexp` as scaled_dot_product_attention returned them for the
/// same inputs and options. Returns dq, dk and dv, and the gradients `returns` names:
/// Return::dbias (options.bias must be given) and Return::dsinks (options.sinks must be
/// given).
template <class TQ, class TK, class TV, class TO, class TD,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV> && detail::is_rank4_tensor_v<TO> &&
                                   detail::is_rank4_tensor_v<TD>>>
AttentionGradients<detail::rank4_scalar_t<TQ>> scaled_dot_product_attention_backward(
    const TQ& q,                                                               // (B, Hq, Lq, D)
    const TK& k,                                                               // (B, Hkv, Lk, D)
    const TV& v,                                                               // (B, Hkv, Lk, Dv)
    const TO& out,                                                             // (B, Hq, Lq, Dv)
    const Tensor<compute_scalar_t<detail::rank4_scalar_t<TQ>>, 3>& logsumexp,  // (B, Hq, Lq)
    const TD& dout,                                                            // (B, Hq, Lq, Dv)
    const AttentionOptions<compute_scalar_t<detail::rank4_scalar_t<TQ>>>& options = {},
    Return returns = Return::nothing_else) {
  using T = detail::rank4_scalar_t<TQ>;
  static_assert(std::is_same_v<T, detail::rank4_scalar_t<TK>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TV>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TO>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TD>>,
                "scaled_dot_product_attention_backward: q, k, v, out and dout must share one "
                "scalar type");
  constexpr const char* function = "scaled_dot_product_attention_backward";
  detail::check_backward_returns(function, returns);
  const HeadsView<const T> qv = detail::as_heads_view(q), kv = detail::as_heads_view(k),
                           vv = detail::as_heads_view(v);
  detail::check_attention_shapes(function, qv, kv, vv);
  if (detail::wants(returns, Return::dbias) && options.bias.empty())
    detail::throw_invalid_argument(function, "Return::dbias but options.bias is not given");
  if (detail::wants(returns, Return::dsinks) && options.sinks.empty())
    detail::throw_invalid_argument(function, "Return::dsinks but options.sinks is not given");
  AttentionGradients<T> g;
  g.dq.resize(qv.batch, qv.heads, qv.length, qv.dim);
  g.dk.resize(kv.batch, kv.heads, kv.length, kv.dim);
  g.dv.resize(vv.batch, vv.heads, vv.length, vv.dim);
  AttentionGradientViews<T> views{bhld_view(g.dq), bhld_view(g.dk), bhld_view(g.dv)};
  if (detail::wants(returns, Return::dbias)) {
    const auto& d = options.bias.dims();
    g.dbias.resize(d[0], d[1], d[2], d[3]);
    views.dbias = bhld_view(g.dbias);
  }
  if (detail::wants(returns, Return::dsinks)) {
    g.dsinks.resize(options.sinks.size());
    views.dsinks.emplace(g.dsinks.data(), static_cast<Index>(g.dsinks.size()));
  }
  detail::attention_backward_into<T>(qv, kv, vv, detail::as_heads_view(out), bhl_view(logsumexp),
                                     detail::as_heads_view(dout), views, options);
  return g;
}

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_BACKWARD_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
