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
#include "attn/mask.hpp"
#include "attn/options.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The gradients scaled_dot_product_attention_backward returns.
template <class T>
struct AttentionGradients {
  using C = compute_scalar_t<T>;
  Tensor<T, 4> dq;        ///< (B, Hq, Lq, D)
  Tensor<T, 4> dk;        ///< (B, Hkv, Lk, D)
  Tensor<T, 4> dv;        ///< (B, Hkv, Lk, Dv)
  Tensor<C, 4> dbias;     ///< the bias's own dims, when requested; else empty
  std::vector<C> dsinks;  ///< (Hq) when options.sinks is given; else empty
};

namespace detail {

/// The checks every backward call makes on its (B, H, L, D) views, padded or packed: out,
/// dout and the gradients' shapes, the log-sum-exp, overlaps, and the gradients asked for
/// that the options cannot give.
template <class S>
void check_backward_arguments(const char* function,
                              const HeadsView<const S>& q,     // (B, Hq, Lq, D)
                              const HeadsView<const S>& k,     // (B, Hkv, Lk, D)
                              const HeadsView<const S>& v,     // (B, Hkv, Lk, Dv)
                              const HeadsView<const S>& out,   // (B, Hq, Lq, Dv)
                              const compute_scalar_t<S>* lse,  // (B, Hq, Lq)
                              const HeadsView<const S>& dout,  // (B, Hq, Lq, Dv)
                              const HeadsView<S>& dq,          // (B, Hq, Lq, D)
                              const HeadsView<S>& dk,          // (B, Hkv, Lk, D)
                              const HeadsView<S>& dv,          // (B, Hkv, Lk, Dv)
                              const AttentionOptions<compute_scalar_t<S>>& options,
                              const compute_scalar_t<S>* dbias, const compute_scalar_t<S>* dsinks) {
  check_attention_shapes(function, q, k, v);
  const std::array<Index, 4> out_shape{q.batch, q.heads, q.length, v.dim};
  check_shape(function, "out", out.shape(), out_shape, "(B, Hq, Lq, Dv)");
  check_shape(function, "dout", dout.shape(), out_shape, "(B, Hq, Lq, Dv)");
  check_shape(function, "dq", dq.shape(), q.shape(), "(B, Hq, Lq, D), q's shape");
  check_shape(function, "dk", dk.shape(), k.shape(), "(B, Hkv, Lk, D), k's shape");
  check_shape(function, "dv", dv.shape(), v.shape(), "(B, Hkv, Lk, Dv), v's shape");
  if (lse == nullptr && q.batch * q.heads * q.length > 0) {
    throw_invalid_argument(function,
                           q.row_offsets != nullptr
                               ? "logsumexp is null: pass the forward's logsumexp (Hq, Tq)"
                               : "logsumexp is null: pass the forward's logsumexp (B, Hq, Lq)");
  }
  // The gradients must not overlap any input or each other.
  const std::pair<const char*, HeadsView<S>> outputs[] = {{"dq", dq}, {"dk", dk}, {"dv", dv}};
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
  if (dbias != nullptr && options.bias.empty()) {
    throw_invalid_argument(function, "dbias was requested but options.bias is not given");
  }
  if (dsinks != nullptr && options.sinks.empty()) {
    throw_invalid_argument(function, "dsinks was requested but options.sinks is not given");
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
                  compute_scalar_t<S>* dbias,     // the bias's dims, or null
                  compute_scalar_t<S>* dsinks) {  // (Hq), or null
  using T = compute_scalar_t<S>;
  const HeadsView<const S>&q = views.q, &k = views.k;
  const T scale = resolve_scale(function, options.scale, q.dim);
  const KernelPlan plan = plan_backward<T>(
      {q.batch, q.heads, k.heads, q.length, k.length, q.dim, views.v.dim}, options, function);
  const Mask<T> mask(function, q.batch, q.heads, q.length, k.length, options, plan.isa);
  if (plan.algorithm == Algorithm::naive)
    run_naive_backward(plan, views, mask, options.softcap, scale);
  else
    run_flash_backward(plan, views, mask, options.softcap, scale);
  if (dbias != nullptr) {
    run_bias_gradient(plan, views, mask, scale, options.bias.dims(), dbias);
  }
  if (dsinks != nullptr)
    sink_gradients(views.out, views.dout, views.lse, mask, dsinks);
}

/// The implementation of scaled_dot_product_attention_backward_into (see there).
template <class S>
void attention_backward_into(const HeadsView<const S>& q,     // (B, Hq, Lq, D)
                             const HeadsView<const S>& k,     // (B, Hkv, Lk, D)
                             const HeadsView<const S>& v,     // (B, Hkv, Lk, Dv)
                             const HeadsView<const S>& out,   // (B, Hq, Lq, Dv)
                             const compute_scalar_t<S>* lse,  // (B, Hq, Lq), packed (Hq, Tq)
                             const HeadsView<const S>& dout,  // (B, Hq, Lq, Dv)
                             const HeadsView<S>& dq,          // (B, Hq, Lq, D)
                             const HeadsView<S>& dk,          // (B, Hkv, Lk, D)
                             const HeadsView<S>& dv,          // (B, Hkv, Lk, Dv)
                             const AttentionOptions<compute_scalar_t<S>>& options,
                             compute_scalar_t<S>* dbias,     // the bias's dims, or null
                             compute_scalar_t<S>* dsinks) {  // (Hq), or null
  using T = compute_scalar_t<S>;
  static_assert(is_storage_scalar_v<S>,
                "scaled_dot_product_attention_backward: scalars must be floating point, "
                "Eigen::half or Eigen::bfloat16");
  constexpr const char* function = "scaled_dot_product_attention_backward";
  // Packing first: views on other sequences also have other lengths, and that is the cause.
  const bool packed = check_packing(
      function,
      {packed_rows("q", q), packed_rows("out", out), packed_rows("dout", dout),
       packed_rows("dq", dq)},
      {packed_rows("k", k), packed_rows("v", v), packed_rows("dk", dk), packed_rows("dv", dv)});
  check_attention_shapes(function, q, k, v);
  if (packed)
    check_packed_options(function, options);
  check_backward_arguments(function, q, k, v, out, lse, dout, dq, dk, dv, options, dbias, dsinks);
  if (!packed) {
    run_backward(
        function,
        BackwardViews<S>{q, k, v, out, dout, padded_rows(lse, q.heads, q.length), dq, dk, dv},
        options, dbias, dsinks);
    return;
  }
  run_backward(function,
               BackwardViews<S>{q, k, v, out, dout,
                                RowValues<const T>{lse, 0, q.row_offsets[q.batch], q.row_offsets},
                                dq, dk, dv},
               per_sequence_options(options, q, k), dbias, dsinks);
}

}  // namespace detail

/// Gradients on (B, H, L, D) views (any strides, e.g. (B, L, H, D) memory), written into dq,
/// dk and dv, which must share no element with the inputs or each other. `logsumexp`
/// (B, Hq, Lq) contiguous, as the forward returned it for the same options. Packed sequences:
/// every view packed as in the forward (q, out, dout and dq with cu_seqlens_q; k, v, dk and
/// dv with cu_seqlens_k), `logsumexp` (Hq, Tq); every option of the packed forward, each
/// within its sequence (dropout, mask_mod and block_mask see the sequence's index as b);
/// dsinks summed over the sequences. `dbias`, if not
/// null, receives the bias's gradient in the bias's own dims (contiguous; options.bias must
/// be given); `dsinks` (Hq), if not null, the learned sinks' (options.sinks must be given).
template <class T>
void scaled_dot_product_attention_backward_into(
    const HeadsView<const T>& q,           // (B, Hq, Lq, D)
    const HeadsView<const T>& k,           // (B, Hkv, Lk, D)
    const HeadsView<const T>& v,           // (B, Hkv, Lk, Dv)
    const HeadsView<const T>& out,         // (B, Hq, Lq, Dv)
    const compute_scalar_t<T>* logsumexp,  // (B, Hq, Lq)
    const HeadsView<const T>& dout,        // (B, Hq, Lq, Dv)
    const HeadsView<T>& dq,                // (B, Hq, Lq, D)
    const HeadsView<T>& dk,                // (B, Hkv, Lk, D)
    const HeadsView<T>& dv,                // (B, Hkv, Lk, Dv)
    const AttentionOptions<compute_scalar_t<T>>& options = {},
    compute_scalar_t<T>* dbias = nullptr,   // the bias's dims, or null
    compute_scalar_t<T>* dsinks = nullptr)  // (Hq), or null
{
  detail::attention_backward_into<T>(q, k, v, out, logsumexp, dout, dq, dk, dv, options, dbias,
                                     dsinks);
}

/// Gradients of batched attention on rank-4 row-major tensors (B, H, L, D) of one scalar:
/// `out` and `logsumexp` as scaled_dot_product_attention returned them for the same inputs
/// and options. dsinks is filled when options.sinks is given; dbias when `bias_gradient`
/// (options.bias must then be given).
template <class T>
AttentionGradients<T> scaled_dot_product_attention_backward(
    const Tensor<T, 4>& q,                            // (B, Hq, Lq, D)
    const Tensor<T, 4>& k,                            // (B, Hkv, Lk, D)
    const Tensor<T, 4>& v,                            // (B, Hkv, Lk, Dv)
    const Tensor<T, 4>& out,                          // (B, Hq, Lq, Dv)
    const Tensor<compute_scalar_t<T>, 3>& logsumexp,  // (B, Hq, Lq)
    const Tensor<T, 4>& dout,                         // (B, Hq, Lq, Dv)
    const AttentionOptions<compute_scalar_t<T>>& options = {}, bool bias_gradient = false) {
  constexpr const char* function = "scaled_dot_product_attention_backward";
  const HeadsView<const T> qv = detail::as_heads_view(q), kv = detail::as_heads_view(k),
                           vv = detail::as_heads_view(v);
  detail::check_attention_shapes(function, qv, kv, vv);
  const std::array<Index, 3> lse_shape{qv.batch, qv.heads, qv.length};
  const std::array<Index, 3> given{logsumexp.dimension(0), logsumexp.dimension(1),
                                   logsumexp.dimension(2)};
  if (given != lse_shape) {
    detail::throw_invalid_argument(
        function,
        "logsumexp is " + detail::shape_string({given[0], given[1], given[2]}) + " but must be " +
            detail::shape_string({lse_shape[0], lse_shape[1], lse_shape[2]}) + " (B, Hq, Lq)");
  }
  AttentionGradients<T> g;
  g.dq.resize(q.dimensions());
  g.dk.resize(k.dimensions());
  g.dv.resize(v.dimensions());
  using C = compute_scalar_t<T>;
  C* dbias = nullptr;
  if (bias_gradient) {
    if (options.bias.empty()) {
      detail::throw_invalid_argument(function,
                                     "bias_gradient is true but options.bias is not given");
    }
    const auto& d = options.bias.dims();
    g.dbias.resize(d[0], d[1], d[2], d[3]);
    dbias = g.dbias.data();
  }
  if (!options.sinks.empty())
    g.dsinks.resize(options.sinks.size());
  detail::attention_backward_into<T>(qv, kv, vv, detail::as_heads_view(out), logsumexp.data(),
                                     detail::as_heads_view(dout), bhld_view(g.dq), bhld_view(g.dk),
                                     bhld_view(g.dv), options, dbias,
                                     g.dsinks.empty() ? nullptr : g.dsinks.data());
  return g;
}

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_BACKWARD_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
