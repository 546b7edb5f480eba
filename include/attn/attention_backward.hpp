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
// Packed sequences (the backward of scaled_dot_product_attention_varlen_into): views of all
// tokens (1, H, T, D), logsumexp (Hq, Tq), the forward's cu_seqlens_q and cu_seqlens_k; the
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

template <class T>
std::string view_shape(const HeadsView<T>& x) {
  return shape_string({x.batch, x.heads, x.length, x.dim});
}

/// The checks every backward call makes once its inputs are (B, H, L, D) views (padded) or
/// views of all tokens (packed, B = 1): out, dout and the gradients' shapes, the log-sum-exp,
/// overlaps, and the gradients asked for that the options cannot give.
template <class S>
void check_backward_arguments(const char* function, bool packed,
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
  const auto expect = [&](const char* name, const std::array<Index, 4>& actual,
                          const std::array<Index, 4>& wanted, const char* legend) {
    if (actual != wanted) {
      throw_invalid_argument(
          function, std::string(name) + " is " +
                        shape_string({actual[0], actual[1], actual[2], actual[3]}) +
                        " but must be " +
                        shape_string({wanted[0], wanted[1], wanted[2], wanted[3]}) + " " + legend);
    }
  };
  expect("out", out.shape(), out_shape, packed ? "(1, Hq, Tq, Dv)" : "(B, Hq, Lq, Dv)");
  expect("dout", dout.shape(), out_shape, packed ? "(1, Hq, Tq, Dv)" : "(B, Hq, Lq, Dv)");
  expect("dq", dq.shape(), q.shape(),
         packed ? "(1, Hq, Tq, D), q's shape" : "(B, Hq, Lq, D), q's shape");
  expect("dk", dk.shape(), k.shape(),
         packed ? "(1, Hkv, Tk, D), k's shape" : "(B, Hkv, Lk, D), k's shape");
  expect("dv", dv.shape(), v.shape(),
         packed ? "(1, Hkv, Tk, Dv), v's shape" : "(B, Hkv, Lk, Dv), v's shape");
  if (lse == nullptr && q.batch * q.heads * q.length > 0) {
    throw_invalid_argument(function,
                           packed ? "logsumexp is null: pass the forward's logsumexp (Hq, Tq)"
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
                             const compute_scalar_t<S>* lse,  // (B, Hq, Lq)
                             const HeadsView<const S>& dout,  // (B, Hq, Lq, Dv)
                             const HeadsView<S>& dq,          // (B, Hq, Lq, D)
                             const HeadsView<S>& dk,          // (B, Hkv, Lk, D)
                             const HeadsView<S>& dv,          // (B, Hkv, Lk, Dv)
                             const AttentionOptions<compute_scalar_t<S>>& options,
                             compute_scalar_t<S>* dbias,     // the bias's dims, or null
                             compute_scalar_t<S>* dsinks) {  // (Hq), or null
  static_assert(is_storage_scalar_v<S>,
                "scaled_dot_product_attention_backward: scalars must be floating point, "
                "Eigen::half or Eigen::bfloat16");
  constexpr const char* function = "scaled_dot_product_attention_backward";
  for (const HeadsView<const S>* x : {&q, &k, &v, &out, &dout}) {
    if (x->row_offsets != nullptr) {
      throw_invalid_argument(function,
                             "packed views (varlen) go to "
                             "scaled_dot_product_attention_varlen_backward_into, with the "
                             "sequences' offsets");
    }
  }
  check_backward_arguments(function, false, q, k, v, out, lse, dout, dq, dk, dv, options, dbias,
                           dsinks);
  run_backward(
      function,
      BackwardViews<S>{q, k, v, out, dout, padded_rows(lse, q.heads, q.length), dq, dk, dv},
      options, dbias, dsinks);
}

/// The implementation of scaled_dot_product_attention_varlen_backward_into (see there).
template <class S>
void varlen_attention_backward_into(const HeadsView<const S>& q,             // (1, Hq, Tq, D)
                                    const HeadsView<const S>& k,             // (1, Hkv, Tk, D)
                                    const HeadsView<const S>& v,             // (1, Hkv, Tk, Dv)
                                    const HeadsView<const S>& out,           // (1, Hq, Tq, Dv)
                                    const compute_scalar_t<S>* lse,          // (Hq, Tq)
                                    const HeadsView<const S>& dout,          // (1, Hq, Tq, Dv)
                                    const HeadsView<S>& dq,                  // (1, Hq, Tq, D)
                                    const HeadsView<S>& dk,                  // (1, Hkv, Tk, D)
                                    const HeadsView<S>& dv,                  // (1, Hkv, Tk, Dv)
                                    const std::vector<Index>& cu_seqlens_q,  // (B + 1)
                                    const std::vector<Index>& cu_seqlens_k,  // (B + 1)
                                    const AttentionOptions<compute_scalar_t<S>>& options,
                                    compute_scalar_t<S>* dsinks) {  // (Hq), or null
  using T = compute_scalar_t<S>;
  static_assert(is_storage_scalar_v<S>,
                "scaled_dot_product_attention_varlen_backward: scalars must be floating point, "
                "Eigen::half or Eigen::bfloat16");
  constexpr const char* function = "scaled_dot_product_attention_varlen_backward";
  const std::pair<const char*, HeadsView<const S>> views[] = {
      {"q", q},       {"k", k},   {"v", v},   {"out", out},
      {"dout", dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}};
  for (const auto& [name, x] : views) {
    if (x.batch != 1 || x.row_offsets != nullptr) {
      throw_invalid_argument(function, std::string(name) + " is " + view_shape(x) +
                                           ": every tensor must be a view of all tokens, "
                                           "(1, H, T, D) (e.g. blhd_view(data, 1, T, H, D))");
    }
  }
  check_backward_arguments(function, true, q, k, v, out, lse, dout, dq, dk, dv, options,
                           static_cast<const T*>(nullptr), dsinks);
  check_packed_sequences(function, cu_seqlens_q, cu_seqlens_k, q.length, k.length, options);
  AttentionOptions<T> per_sequence = options;
  static_cast<MaskOptions<T>&>(per_sequence) =
      per_sequence_options(options, cu_seqlens_q, cu_seqlens_k);
  run_backward(function,
               BackwardViews<S>{packed_view(q, cu_seqlens_q), packed_view(k, cu_seqlens_k),
                                packed_view(v, cu_seqlens_k), packed_view(out, cu_seqlens_q),
                                packed_view(dout, cu_seqlens_q),
                                RowValues<const T>{lse, 0, q.length, cu_seqlens_q.data()},
                                packed_view(dq, cu_seqlens_q), packed_view(dk, cu_seqlens_k),
                                packed_view(dv, cu_seqlens_k)},
               per_sequence, nullptr, dsinks);
}

}  // namespace detail

/// Gradients on (B, H, L, D) views (any strides, e.g. (B, L, H, D) memory), written into dq,
/// dk and dv, which must share no element with the inputs or each other. `logsumexp`
/// (B, Hq, Lq) contiguous, as the forward returned it for the same options. `dbias`, if not
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

/// The gradients scaled_dot_product_attention_varlen_backward returns, in the tokens' layout.
template <class T>
struct VarlenGradients {
  using C = compute_scalar_t<T>;
  Tensor<T, 3> dq;        ///< (Tq, Hq, D)
  Tensor<T, 3> dk;        ///< (Tk, Hkv, D)
  Tensor<T, 3> dv;        ///< (Tk, Hkv, Dv)
  std::vector<C> dsinks;  ///< (Hq) when options.sinks is given; else empty
};

/// Gradients of packed variable-length attention (scaled_dot_product_attention_varlen_into's
/// backward): views of all tokens (1, H, T, D), e.g. blhd_view(data, 1, T, H, D) of (T, H, D)
/// memory; `out` and `logsumexp` (Hq, Tq) as the packed forward returned them for the same
/// sequences and options. Every option of the packed forward, each within its sequence
/// (dropout, mask_mod and block_mask see the sequence's index as b); dsinks (Hq) summed over
/// the sequences. Work items are (sequence, kv head): the same bits for any thread count.
template <class T>
void scaled_dot_product_attention_varlen_backward_into(
    const HeadsView<const T>& q,             // (1, Hq, Tq, D)
    const HeadsView<const T>& k,             // (1, Hkv, Tk, D)
    const HeadsView<const T>& v,             // (1, Hkv, Tk, Dv)
    const HeadsView<const T>& out,           // (1, Hq, Tq, Dv)
    const compute_scalar_t<T>* logsumexp,    // (Hq, Tq)
    const HeadsView<const T>& dout,          // (1, Hq, Tq, Dv)
    const HeadsView<T>& dq,                  // (1, Hq, Tq, D)
    const HeadsView<T>& dk,                  // (1, Hkv, Tk, D)
    const HeadsView<T>& dv,                  // (1, Hkv, Tk, Dv)
    const std::vector<Index>& cu_seqlens_q,  // (B + 1)
    const std::vector<Index>& cu_seqlens_k,  // (B + 1)
    const AttentionOptions<compute_scalar_t<T>>& options = {},
    compute_scalar_t<T>* dsinks = nullptr)  // (Hq), or null
{
  detail::varlen_attention_backward_into<T>(q, k, v, out, logsumexp, dout, dq, dk, dv, cu_seqlens_q,
                                            cu_seqlens_k, options, dsinks);
}

/// Gradients of packed variable-length attention on (T, H, D) tensors: q (Tq, Hq, D),
/// k (Tk, Hkv, D), v (Tk, Hkv, Dv), out and dout (Tq, Hq, Dv), logsumexp (Hq, Tq) as
/// scaled_dot_product_attention_varlen returned it. dsinks is filled when options.sinks is
/// given.
template <class T>
VarlenGradients<T> scaled_dot_product_attention_varlen_backward(
    const Tensor<T, 3>& q,                            // (Tq, Hq, D)
    const Tensor<T, 3>& k,                            // (Tk, Hkv, D)
    const Tensor<T, 3>& v,                            // (Tk, Hkv, Dv)
    const Tensor<T, 3>& out,                          // (Tq, Hq, Dv)
    const Tensor<compute_scalar_t<T>, 2>& logsumexp,  // (Hq, Tq)
    const Tensor<T, 3>& dout,                         // (Tq, Hq, Dv)
    const std::vector<Index>& cu_seqlens_q, const std::vector<Index>& cu_seqlens_k,
    const AttentionOptions<compute_scalar_t<T>>& options = {}) {
  constexpr const char* function = "scaled_dot_product_attention_varlen_backward";
  const auto tokens = [](auto& x) {  // const tensors give views of const T
    return blhd_view(x.data(), 1, x.dimension(0), x.dimension(1), x.dimension(2));
  };
  if (logsumexp.dimension(0) != q.dimension(1) || logsumexp.dimension(1) != q.dimension(0)) {
    detail::throw_invalid_argument(
        function,
        "logsumexp is " + detail::shape_string({logsumexp.dimension(0), logsumexp.dimension(1)}) +
            " but must be " + detail::shape_string({q.dimension(1), q.dimension(0)}) + " (Hq, Tq)");
  }
  VarlenGradients<T> g;
  g.dq.resize(q.dimensions());
  g.dk.resize(k.dimensions());
  g.dv.resize(v.dimensions());
  if (!options.sinks.empty())
    g.dsinks.resize(options.sinks.size());
  detail::varlen_attention_backward_into<T>(tokens(q), tokens(k), tokens(v), tokens(out),
                                            logsumexp.data(), tokens(dout), tokens(g.dq),
                                            tokens(g.dk), tokens(g.dv), cu_seqlens_q, cu_seqlens_k,
                                            options, g.dsinks.empty() ? nullptr : g.dsinks.data());
  return g;
}

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_BACKWARD_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
