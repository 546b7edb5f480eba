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
#include "attn/mask.hpp"
#include "attn/options.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
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
                   const Mask<compute_scalar_t<TQ>>& mask, compute_scalar_t<TQ> scale,
                   compute_scalar_t<TQ>* weights,  // (B, Hq, Lq, Lk) or null
                   const RowValues<compute_scalar_t<TQ>>& logsumexp) {
  switch (plan.algorithm) {
    case Algorithm::naive:
      return run_naive(plan, q, k, v, out, mask, scale, weights, logsumexp);
    case Algorithm::chunked:
      return run_chunked(plan, q, k, v, out, mask, scale, logsumexp);
    case Algorithm::flash:
      return run_flash(plan, q, k, v, out, mask, scale, logsumexp);
    case Algorithm::decode:
      return run_decode(plan, q, k, v, out, mask, scale, logsumexp);
    case Algorithm::automatic:
      break;
  }
  ATTN_ASSERT(false);
}

/// The implementation of scaled_dot_product_attention_into for q stored as TQ, k and v as
/// TKV and out as TO; the arithmetic runs in T = compute_scalar_t<TQ>. 16-bit operands are
/// widened as the kernels read them (flash: tile by tile; naive and chunked: once per head).
/// Padded or packed views (packed_view()): the same kernels, packed sequences with each
/// sequence's lengths as key_lengths and query_lengths.
template <class TQ, class TKV, class TO>
void attention_into(const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                    const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                    const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                    const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
                    const AttentionOptions<compute_scalar_t<TQ>>& options,
                    compute_scalar_t<TQ>* weights,      // (B, Hq, Lq, Lk) or null
                    compute_scalar_t<TQ>* logsumexp) {  // (B, Hq, Lq), packed (Hq, Tq), or null
  using T = compute_scalar_t<TQ>;
  static_assert(is_storage_scalar_v<TQ> && is_storage_scalar_v<TKV> && is_storage_scalar_v<TO>,
                "scaled_dot_product_attention: scalars must be floating point, Eigen::half or "
                "Eigen::bfloat16");
  static_assert(std::is_same_v<T, compute_scalar_t<TKV>> && std::is_same_v<T, compute_scalar_t<TO>>,
                "scaled_dot_product_attention: q, k, v and out must share one compute scalar "
                "(float with half or bfloat16; double only with double)");
  constexpr const char* function = "scaled_dot_product_attention";
  // Packing first: views on other sequences also have other lengths, and that is the cause.
  const bool packed = check_packing(function, {packed_rows("q", q), packed_rows("out", out)},
                                    {packed_rows("k", k), packed_rows("v", v)});
  check_attention_shapes(function, q, k, v);
  check_output_shape(function, q, v.dim, out);
  check_output_aliasing(function, q, k, v, out);
  if (packed) {
    check_packed_options(function, options);
    if (weights != nullptr) {
      throw_invalid_argument(function,
                             "weights are not available for packed views: pad the sequences");
    }
  }
  const T scale = resolve_scale(function, options.scale, q.dim);
  const KernelPlan plan = plan_attention<T>(
      {q.batch, q.heads, k.heads, q.length, k.length, q.dim, v.dim, Index(sizeof(TKV))}, options,
      weights != nullptr, function);
  if (!packed) {
    const Mask<T> mask(function, q.batch, q.heads, q.length, k.length, options, plan.isa);
    run_attention(plan, q, k, v, out, mask, scale, weights,
                  padded_rows(logsumexp, q.heads, q.length));
    return;
  }
  const MaskOptions<T> per_sequence = per_sequence_options<MaskOptions<T>>(options, q, k);
  const Mask<T> mask(function, q.batch, q.heads, q.length, k.length, per_sequence, plan.isa);
  run_attention(plan, q, k, v, out, mask, scale, weights,
                RowValues<T>{logsumexp, 0, q.row_offsets[q.batch], q.row_offsets});
}

}  // namespace detail

/// Attention on (B, H, L, D) views, written into `out` (B, Hq, Lq, Dv), which may be any
/// strided view (e.g. (B, Lq, Hq, Dv) memory, so that heads are already merged).
/// Optional outputs: `weights` (B, Hq, Lq, Lk) and `logsumexp` (B, Hq, Lq), contiguous, in
/// the compute scalar (float for 16-bit data).
///
/// Packed sequences (FlashAttention's varlen calls): q and out from packed_view() of the
/// query tokens with cu_seqlens_q, k and v with cu_seqlens_k. Every option applies per
/// sequence (causal bottom-right at n_k(b) - n_q(b), window, sink tokens, ALiBi, softcap,
/// learned sinks, mods, every algorithm); keep_mask, bias, key_lengths, query_lengths and
/// weights must be empty; `logsumexp` is (Hq, Tq). Work items never cross a sequence: the
/// result is bitwise that of calling each sequence on its own with the same algorithm and
/// tiles (docs/packed.md).
template <class T>
void scaled_dot_product_attention_into(const HeadsView<const T>& q,  // (B, Hq, Lq, D)
                                       const HeadsView<const T>& k,  // (B, Hkv, Lk, D)
                                       const HeadsView<const T>& v,  // (B, Hkv, Lk, Dv)
                                       const HeadsView<T>& out,      // (B, Hq, Lq, Dv)
                                       const AttentionOptions<compute_scalar_t<T>>& options = {},
                                       compute_scalar_t<T>* weights = nullptr,    // or null
                                       compute_scalar_t<T>* logsumexp = nullptr)  // or null
{
  detail::attention_into<T, T, T>(q, k, v, out, options, weights, logsumexp);
}

/// Mixed storage, e.g. float q and out against a 16-bit KV cache: q as TQ, k and v as TKV,
/// out as TO, all with the same compute scalar (double mixes with nothing).
template <class TQ, class TKV, class TO,
          class = std::enable_if_t<!(std::is_same_v<TQ, TKV> && std::is_same_v<TQ, TO>)>>
void scaled_dot_product_attention_into(const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                                       const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                                       const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                                       const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
                                       const AttentionOptions<compute_scalar_t<TQ>>& options = {},
                                       compute_scalar_t<TQ>* weights = nullptr,    // or null
                                       compute_scalar_t<TQ>* logsumexp = nullptr)  // or null
{
  detail::attention_into<TQ, TKV, TO>(q, k, v, out, options, weights, logsumexp);
}

/// Batched attention on rank-4 row-major tensors or tensor maps (B, H, L, D).
/// Returns out (B, Hq, Lq, Dv) stored as `Out` (default: q's scalar; e.g.
/// `scaled_dot_product_attention<float>(q, k, v)` for float output from half inputs); fills
/// `weights` (B, Hq, Lq, Lk) and `logsumexp` (B, Hq, Lq) in the compute scalar when given.
/// k and v share one scalar; q may differ (float queries against a half cache).
template <class Out = void, class TQ, class TK, class TV,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV>>>
auto scaled_dot_product_attention(
    const TQ& q,  // (B, Hq, Lq, D)
    const TK& k,  // (B, Hkv, Lk, D)
    const TV& v,  // (B, Hkv, Lk, Dv)
    const AttentionOptions<compute_scalar_t<detail::rank4_scalar_t<TQ>>>& options = {},
    Tensor<compute_scalar_t<detail::rank4_scalar_t<TQ>>, 4>* weights = nullptr,  // (B, Hq, Lq, Lk)
    Tensor<compute_scalar_t<detail::rank4_scalar_t<TQ>>, 3>* logsumexp = nullptr)  // (B, Hq, Lq)
{
  using SQ = detail::rank4_scalar_t<TQ>;
  using SKV = detail::rank4_scalar_t<TK>;
  using SO = std::conditional_t<std::is_void_v<Out>, SQ, Out>;
  static_assert(std::is_same_v<SKV, detail::rank4_scalar_t<TV>>,
                "scaled_dot_product_attention: k and v must have the same scalar type");
  const HeadsView<const SQ> qv = detail::as_heads_view(q);
  const HeadsView<const SKV> kv = detail::as_heads_view(k);
  const HeadsView<const SKV> vv = detail::as_heads_view(v);
  detail::check_attention_shapes("scaled_dot_product_attention", qv, kv, vv);
  if (qv.row_offsets != nullptr || kv.row_offsets != nullptr || vv.row_offsets != nullptr) {
    detail::throw_invalid_argument("scaled_dot_product_attention",
                                   "packed views need a packed output: call "
                                   "scaled_dot_product_attention_into with packed_view() of the "
                                   "output tokens");
  }
  Tensor<SO, 4> out(qv.batch, qv.heads, qv.length, vv.dim);
  if (weights != nullptr)
    weights->resize(qv.batch, qv.heads, qv.length, kv.length);
  if (logsumexp != nullptr)
    logsumexp->resize(qv.batch, qv.heads, qv.length);
  detail::attention_into<SQ, SKV, SO>(qv, kv, vv, bhld_view(out), options,
                                      weights != nullptr ? weights->data() : nullptr,
                                      logsumexp != nullptr ? logsumexp->data() : nullptr);
  return out;
}

/// One head: q (Lq, D), k (Lk, D), v (Lk, Dv) -> out (Lq, Dv). Any Eigen matrix expression
/// (column-major inputs are copied to row-major first). Masks broadcast as (1, 1, Lq, Lk);
/// key_lengths, if given, has one entry. Fills `weights` (Lq, Lk) and `logsumexp` (Lq)
/// when given.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& q,  // (Lq, D)
    const Eigen::MatrixBase<DK>& k,  // (Lk, D)
    const Eigen::MatrixBase<DV>& v,  // (Lk, Dv)
    const AttentionOptions<compute_scalar_t<typename DQ::Scalar>>& options = {},
    Matrix<compute_scalar_t<typename DQ::Scalar>>* weights = nullptr,    // (Lq, Lk)
    Vector<compute_scalar_t<typename DQ::Scalar>>* logsumexp = nullptr)  // (Lq)
{
  using T = typename DQ::Scalar;
  static_assert(std::is_same_v<T, typename DK::Scalar> && std::is_same_v<T, typename DV::Scalar>,
                "scaled_dot_product_attention: q, k and v must have the same scalar type");
  using RowMajorRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
  const RowMajorRef qr(q), kr(k), vr(v);
  const auto view = [](const RowMajorRef& m) {
    return HeadsView<const T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride()};
  };
  Matrix<T> out(qr.rows(), vr.cols());
  const HeadsView<const T> qv = view(qr), kv = view(kr), vv = view(vr);
  detail::check_attention_shapes("scaled_dot_product_attention", qv, kv, vv);
  if (weights != nullptr)
    weights->resize(qr.rows(), kr.rows());
  if (logsumexp != nullptr)
    logsumexp->resize(qr.rows());
  scaled_dot_product_attention_into<T>(
      qv, kv, vv, HeadsView<T>{out.data(), 1, 1, out.rows(), out.cols(), 0, 0, out.cols()}, options,
      weights != nullptr ? weights->data() : nullptr,
      logsumexp != nullptr ? logsumexp->data() : nullptr);
  return out;
}

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_ATTENTION_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
