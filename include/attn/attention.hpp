// attn/attention.hpp: scaled dot-product attention.
//
//   out = softmax(scale * q k^T + bias, over visible keys) v
//
//   q    (B, Hq,  Lq, D)   or one head (Lq, D)
//   k    (B, Hkv, Lk, D)   or (Lk, D)
//   v    (B, Hkv, Lk, Dv)  or (Lk, Dv)
//   out  (B, Hq,  Lq, Dv)  or (Lq, Dv)
//
// Grouped-query attention: Hq must be a multiple of Hkv; query head h reads key/value head
// h / (Hq / Hkv). Hkv == 1 is multi-query attention.
// Semantics (tested against PyTorch fixtures, see README):
//   - scale defaults to 1/sqrt(D);
//   - masks are described by attn/mask.hpp; boolean masks use PyTorch SDPA's polarity
//     (true = may attend);
//   - masks are per sequence: key_lengths and query_lengths move each sequence's diagonal
//     (docs/masks.md); packed sequences (views from packed_view(), docs/packed.md) follow
//     the same rules with the lengths of their offsets;
//   - a query row that sees no key (or only -inf scores) outputs zeros, zero weights and
//     log-sum-exp -inf (the head's sink logit with learned sinks), where PyTorch's math
//     path returns NaN;
//   - NaN in q, k or v propagates to the rows it reaches.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/checks.hpp"
#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/chunked.hpp"
#include "attn/kernels/decode.hpp"
#include "attn/kernels/flash.hpp"
#include "attn/kernels/naive.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {

/// Runs the kernel the plan names.
template <class TQ, class TKV, class TO>
void run_attention(const KernelPlan& plan,
                   const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                   const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                   const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                   const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
                   const AttentionProblem<compute_scalar_t<TQ>>& problem,
                   compute_scalar_t<TQ> scale,
                   const HeadsView<compute_scalar_t<TQ>>* weights,  // (B, Hq, Lq, Lk) or null
                   const RowValues<compute_scalar_t<TQ>>& logsumexp) {
  switch (plan.algorithm) {
    case Algorithm::naive:
      return run_naive(plan, q, k, v, out, problem, scale, weights, logsumexp);
    case Algorithm::chunked:
      return run_chunked(plan, q, k, v, out, problem, scale, logsumexp);
    case Algorithm::flash:
      return run_flash(plan, q, k, v, out, problem, scale, logsumexp);
    case Algorithm::decode:
      return run_decode(plan, q, k, v, out, problem, scale, logsumexp);
    case Algorithm::automatic:
      break;
  }
  ATTN_ASSERT(false);
}

/// Throws unless the optional outputs have their shapes, are packed like q when q is, and
/// share no element with the inputs, `out` or each other.
template <class TQ, class TK, class TV, class TO>
void check_optional_outputs(const char* function,
                            const HeadsView<const TQ>& q,  // (B, Hq, Lq, D)
                            const HeadsView<const TK>& k,  // (B, Hkv, Lk, D)
                            const HeadsView<const TV>& v,  // (B, Hkv, Lk, Dv)
                            const AttentionOutputViews<TO>& outputs) {
  using C = compute_scalar_t<TQ>;
  std::optional<HeadsView<const C>> lse, weights;
  if (outputs.logsumexp) {
    lse = rows_as_heads(*outputs.logsumexp);
    check_rows_shape(function, "logsumexp", *outputs.logsumexp, q);
  }
  if (outputs.weights) {
    weights = *outputs.weights;
    if (q.row_offsets != nullptr) {
      throw_invalid_argument(function,
                             "weights are not available for packed views: pad the sequences");
    }
    check_shape(function, "weights", weights->shape(), {q.batch, q.heads, q.length, k.length},
                "(B, Hq, Lq, Lk)");
  }
  const auto refuse_overlap = [&](const char* name, const auto& view) {
    const char* other = byte_ranges_overlap(view, q)                                  ? "q"
                        : byte_ranges_overlap(view, k)                                ? "k"
                        : byte_ranges_overlap(view, v)                                ? "v"
                        : byte_ranges_overlap(view, HeadsView<const TO>(outputs.out)) ? "out"
                                                                                      : nullptr;
    if (other != nullptr) {
      throw_invalid_argument(function, std::string(name) + " overlaps " + other +
                                           ": the outputs must share no element with the "
                                           "inputs or each other");
    }
  };
  if (lse)
    refuse_overlap("logsumexp", *lse);
  if (weights)
    refuse_overlap("weights", *weights);
  if (lse && weights && byte_ranges_overlap(*lse, *weights)) {
    throw_invalid_argument(function,
                           "logsumexp overlaps weights: the outputs must share no element with "
                           "the inputs or each other");
  }
}

/// Whether the call runs on packed views: check_packing of q, out and logsumexp (the query
/// side) and k, v (the key side).
template <class TQ, class TK, class TV, class TO>
bool check_attention_packing(const char* function,
                             const HeadsView<const TQ>& q,  // (B, Hq, Lq, D)
                             const HeadsView<const TK>& k,  // (B, Hkv, Lk, D)
                             const HeadsView<const TV>& v,  // (B, Hkv, Lk, Dv)
                             const AttentionOutputViews<TO>& outputs) {
  const PackedRows unpacked_lse{"logsumexp", q.row_offsets, q.batch, q.length};
  return check_packing(
      function,
      {packed_rows("q", q), packed_rows("out", outputs.out),
       outputs.logsumexp ? packed_rows("logsumexp", rows_as_heads(*outputs.logsumexp))
                         : unpacked_lse},
      {packed_rows("k", k), packed_rows("v", v)});
}

/// The implementation of scaled_dot_product_attention_into for q stored as TQ, k and v as
/// TKV and out as TO; the arithmetic runs in T = compute_scalar_t<TQ>. 16-bit operands are
/// widened as the kernels read them (flash: tile by tile; naive and chunked: once per head).
/// Padded or packed views (packed_view()): the same kernels, packed sequences with each
/// sequence's lengths as key_lengths and query_lengths. `function` names the entry point in
/// every message (scaled_dot_product_attention, KVCache::attend).
template <class TQ, class TKV, class TO>
void attention_into(const char* function,
                    const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                    const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                    const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                    const AttentionOutputViews<TO>& outputs,
                    const AttentionOptions<compute_scalar_t<TQ>>& options) {
  using T = compute_scalar_t<TQ>;
  static_assert(is_storage_scalar_v<TQ> && is_storage_scalar_v<TKV> && is_storage_scalar_v<TO>,
                "scaled_dot_product_attention: scalars must be floating point, Eigen::half or "
                "Eigen::bfloat16");
  static_assert(std::is_same_v<T, compute_scalar_t<TKV>> && std::is_same_v<T, compute_scalar_t<TO>>,
                "scaled_dot_product_attention: q, k, v and out must share one compute scalar "
                "(float with half or bfloat16; double only with double)");
  const HeadsView<TO>& out = outputs.out;
  // Packing first: views on other sequences also have other lengths, and that is the cause.
  const bool packed = check_attention_packing(function, q, k, v, outputs);
  check_attention_shapes(function, q, k, v);
  check_output_shape(function, q, v.dim, out);
  check_output_aliasing(function, q, k, v, out);
  check_optional_outputs(function, q, k, v, outputs);
  if (packed)
    check_packed_options(function, options);
  const T scale = resolve_scale(function, options.scale, q.dim);
  AttentionShape shape{q.batch,  q.heads, k.heads, q.length,
                       k.length, q.dim,   v.dim,   Index(sizeof(TKV))};
  shape.bf16_readable_kv = bf16_readable_v<TKV>;
  const KernelPlan plan = plan_attention<T>(shape, options, outputs.weights.has_value(), function);
  const HeadsView<T>* weights = outputs.weights ? &*outputs.weights : nullptr;
  const RowValues<T> logsumexp =
      outputs.logsumexp ? row_values(*outputs.logsumexp) : RowValues<T>{};
  if (!packed) {
    const AttentionProblem<T> problem(function, q.batch, q.heads, q.length, k.length, options,
                                      plan.isa);
    run_attention(plan, q, k, v, out, problem, scale, weights, logsumexp);
    return;
  }
  const auto per_sequence = per_sequence_options<ProblemOptions<T>>(options, q, k);
  const AttentionProblem<T> problem(function, q.batch, q.heads, q.length, k.length, per_sequence,
                                    plan.isa);
  run_attention(plan, q, k, v, out, problem, scale, weights, logsumexp);
}

/// The value forms' body: allocates out and the results `returns` names, then runs
/// attention_into on their views.
template <class SO, class SQ, class SKV>
AttentionOutputs<SO> attention_outputs(const char* function, const HeadsView<const SQ>& q,
                                       const HeadsView<const SKV>& k, const HeadsView<const SKV>& v,
                                       const AttentionOptions<compute_scalar_t<SQ>>& options,
                                       Return returns) {
  check_forward_returns(function, returns);
  check_attention_shapes(function, q, k, v);
  if (q.row_offsets != nullptr || k.row_offsets != nullptr || v.row_offsets != nullptr) {
    throw_invalid_argument(function,
                           "packed views need a packed output: call "
                           "scaled_dot_product_attention_into with packed_view() of the output "
                           "tokens");
  }
  AttentionOutputs<SO> result;
  result.out.resize(q.batch, q.heads, q.length, v.dim);
  AttentionOutputViews<SO> views(bhld_view(result.out));
  if (detail::wants(returns, Return::logsumexp)) {
    result.logsumexp.resize(q.batch, q.heads, q.length);
    views.logsumexp = bhl_view(result.logsumexp);
  }
  if (detail::wants(returns, Return::weights)) {
    result.weights.resize(q.batch, q.heads, q.length, k.length);
    views.weights = bhld_view(result.weights);
  }
  attention_into<SQ, SKV, SO>(function, q, k, v, views, options);
  return result;
}

}  // namespace detail

/// Attention on (B, H, L, D) views, written into `outputs.out` (B, Hq, Lq, Dv), which may be
/// any strided view (e.g. (B, Lq, Hq, Dv) memory, so that heads are already merged); a plain
/// HeadsView is an AttentionOutputViews without optional results. Optional results, in the
/// compute scalar (float for 16-bit data), when their views are given: `logsumexp`
/// (B, Hq, Lq) and `weights` (B, Hq, Lq, Lk), strided; neither may overlap an input, out or
/// the other.
///
/// Packed sequences (FlashAttention's varlen calls): q and out from packed_view() of the
/// query tokens with cu_seqlens_q, k and v with cu_seqlens_k. Every option applies per
/// sequence (causal bottom-right at n_k(b) - n_q(b), window, sink tokens, ALiBi, softcap,
/// learned sinks, mods, every algorithm); keep_mask, bias, key_lengths, query_lengths and
/// weights must be empty; `logsumexp` is packed_view() of (Hq, Tq) with cu_seqlens_q. Work
/// items never cross a sequence: the result is bitwise that of calling each sequence on its
/// own with the same algorithm and tiles (docs/packed.md).
///
/// Storage: q as TQ, k and v as TKV, out as TO, all with TQ's compute scalar (double mixes with
/// nothing). TQ is deduced from a view of const data or named (`<float>` for views of
/// mutable data); TKV and TO default to TQ and are named for mixed storage, e.g.
/// `scaled_dot_product_attention_into<float, Eigen::half>(q, k, v, out)` for float q and out
/// against a half KV cache.
template <class TQ, class TKV = TQ, class TO = TQ>
void scaled_dot_product_attention_into(
    const HeadsView<const TQ>& q,                                 // (B, Hq, Lq, D)
    const detail::identity_t<HeadsView<const TKV>>& k,            // (B, Hkv, Lk, D)
    const detail::identity_t<HeadsView<const TKV>>& v,            // (B, Hkv, Lk, Dv)
    const detail::identity_t<AttentionOutputViews<TO>>& outputs,  // out (B, Hq, Lq, Dv), ...
    const AttentionOptions<compute_scalar_t<TQ>>& options = {}) {
  detail::attention_into<TQ, TKV, TO>("scaled_dot_product_attention", q, k, v, outputs, options);
}

/// Batched attention on rank-4 row-major tensors or tensor maps (B, H, L, D).
/// Returns out (B, Hq, Lq, Dv) stored as `Out` (default: q's scalar; e.g.
/// `scaled_dot_product_attention<float>(q, k, v)` for float output from half inputs).
/// k and v share one scalar; q may differ (float queries against a half cache).
template <class Out = void, class TQ, class TK, class TV,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV>>>
auto scaled_dot_product_attention(
    const TQ& q,  // (B, Hq, Lq, D)
    const TK& k,  // (B, Hkv, Lk, D)
    const TV& v,  // (B, Hkv, Lk, Dv)
    const AttentionOptions<compute_scalar_t<detail::rank4_scalar_t<TQ>>>& options = {}) {
  return std::move(scaled_dot_product_attention<Out>(q, k, v, options, Return::nothing_else).out);
}

/// The same, with the optional results `returns` names (Return::logsumexp (B, Hq, Lq),
/// Return::weights (B, Hq, Lq, Lk), in the compute scalar): returns AttentionOutputs,
/// e.g. `auto [out, lse, weights] = scaled_dot_product_attention(q, k, v, {}, Return::logsumexp)`.
template <class Out = void, class TQ, class TK, class TV,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV>>>
auto scaled_dot_product_attention(
    const TQ& q,  // (B, Hq, Lq, D)
    const TK& k,  // (B, Hkv, Lk, D)
    const TV& v,  // (B, Hkv, Lk, Dv)
    const AttentionOptions<compute_scalar_t<detail::rank4_scalar_t<TQ>>>& options, Return returns) {
  using SQ = detail::rank4_scalar_t<TQ>;
  using SKV = detail::rank4_scalar_t<TK>;
  using SO = std::conditional_t<std::is_void_v<Out>, SQ, Out>;
  static_assert(std::is_same_v<SKV, detail::rank4_scalar_t<TV>>,
                "scaled_dot_product_attention: k and v must have the same scalar type");
  return detail::attention_outputs<SO, SQ, SKV>("scaled_dot_product_attention",
                                                detail::as_heads_view(q), detail::as_heads_view(k),
                                                detail::as_heads_view(v), options, returns);
}

/// One head: q (Lq, D), k (Lk, D), v (Lk, Dv) -> out (Lq, Dv). Any Eigen matrix expression
/// (column-major inputs are copied to row-major first). Masks broadcast as (1, 1, Lq, Lk);
/// key_lengths, if given, has one entry. With a `Return` set, returns HeadAttentionOutputs:
/// out and the weights (Lq, Lk) and log-sum-exp (Lq) it names.
template <class DQ, class DK, class DV>
HeadAttentionOutputs<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& q,  // (Lq, D)
    const Eigen::MatrixBase<DK>& k,  // (Lk, D)
    const Eigen::MatrixBase<DV>& v,  // (Lk, Dv)
    const AttentionOptions<compute_scalar_t<typename DQ::Scalar>>& options, Return returns) {
  using T = typename DQ::Scalar;
  static_assert(std::is_same_v<T, typename DK::Scalar> && std::is_same_v<T, typename DV::Scalar>,
                "scaled_dot_product_attention: q, k and v must have the same scalar type");
  constexpr const char* function = "scaled_dot_product_attention";
  detail::check_forward_returns(function, returns);
  using RowMajorRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
  const RowMajorRef qr(q), kr(k), vr(v);
  const auto view = [](const RowMajorRef& m) {
    return HeadsView<const T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride()};
  };
  const HeadsView<const T> qv = view(qr), kv = view(kr), vv = view(vr);
  detail::check_attention_shapes(function, qv, kv, vv);
  HeadAttentionOutputs<T> result;
  result.out.resize(qr.rows(), vr.cols());
  AttentionOutputViews<T> views(
      HeadsView<T>{result.out.data(), 1, 1, qr.rows(), vr.cols(), 0, 0, vr.cols()});
  if (detail::wants(returns, Return::weights)) {
    result.weights.resize(qr.rows(), kr.rows());
    views.weights = HeadsView<compute_scalar_t<T>>{
        result.weights.data(), 1, 1, qr.rows(), kr.rows(), 0, 0, kr.rows()};
  }
  if (detail::wants(returns, Return::logsumexp)) {
    result.logsumexp.resize(qr.rows());
    views.logsumexp = bhl_view(result.logsumexp.data(), 1, 1, qr.rows());
  }
  scaled_dot_product_attention_into<T>(qv, kv, vv, views, options);
  return result;
}

/// One head, returning out (Lq, Dv).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& q,  // (Lq, D)
    const Eigen::MatrixBase<DK>& k,  // (Lk, D)
    const Eigen::MatrixBase<DV>& v,  // (Lk, Dv)
    const AttentionOptions<compute_scalar_t<typename DQ::Scalar>>& options = {}) {
  return std::move(scaled_dot_product_attention(q, k, v, options, Return::nothing_else).out);
}

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_ATTENTION_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
