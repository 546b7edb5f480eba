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
//   - a query row that sees no key (or only -inf scores) outputs zeros, zero weights and
//     log-sum-exp -inf, where PyTorch's math path returns NaN;
//   - NaN in q, k or v propagates to the rows it reaches.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/kernels/chunked.hpp"
#include "attn/kernels/decode.hpp"
#include "attn/kernels/flash.hpp"
#include "attn/kernels/flash_avx512.hpp"
#include "attn/kernels/naive.hpp"
#include "attn/mask.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Which kernel computes the attention.
///
/// Extra memory per thread: naive (Lq, Lk); chunked (query_tile, Lk); flash
/// query_tile * (D + key_tile + Dv + 3), independent of the sequence lengths; decode
/// G * Lq * (D + 64 + Dv + 3) per thread plus ceil(Lk / 512) * G * Lq * (Dv + 2) per
/// (b, kv head) per call, G = Hq / Hkv (kernels/decode.hpp). Automatic picks decode for
/// Lq <= decode_max_queries. Only naive can return the attention weights: asking chunked or flash
/// for them throws std::invalid_argument (automatic falls back to naive when weights are
/// requested).
enum class Algorithm : std::uint8_t {
  automatic,  ///< flash, or naive when weights are requested or the problem is tiny
  naive,      ///< materialises the (Lq, Lk) scores; the only one that returns weights
  chunked,    ///< query blocks of query_tile rows against all their visible keys
  flash,      ///< query tiles x key tiles with an online softmax; never holds (Lq, Lk)
  decode,     ///< few queries, many keys: a GQA group per tile, keys split across threads
};

/// Default tile sizes, chosen by measurement (bench/bench_attention.cpp, float, D = 64).
inline constexpr Index default_query_tile = 128;
inline constexpr Index default_key_tile = 256;
inline constexpr Index default_chunk_rows = 64;

/// Everything about an attention call except the tensors.
template <class T>
struct AttentionOptions {
  std::optional<T> scale;          ///< multiplies q k^T; default 1/sqrt(D)
  Causal causal = Causal::none;    ///< causal mask and its alignment
  Window window{};                 ///< sliding window (left, right); -1 = unbounded
  std::vector<Index> key_lengths;  ///< (B) valid keys per batch entry; empty = all
  Broadcast<bool> keep_mask;       ///< broadcastable to (B, Hq, Lq, Lk); true = may attend
  Broadcast<T> bias;               ///< broadcastable to (B, Hq, Lq, Lk); added to scores
  /// (Hq) ALiBi slopes, e.g. alibi_slopes<T>(Hq); empty = no ALiBi. Adds
  /// -slope[h] * |i + offset - j| (attn/score_modifiers.hpp).
  std::vector<T> alibi_slopes;
  /// Logit soft-capping: scores become softcap * tanh(scores / softcap) before the ALiBi
  /// term, the bias and the mask; must be > 0. Gemma 2 uses 50.
  std::optional<T> softcap;
  Algorithm algorithm = Algorithm::automatic;
  /// Query rows per work item of chunked and flash; 0 = default_chunk_rows (chunked) or
  /// default_query_tile (flash).
  Index query_tile = 0;
  /// Keys per tile of flash; 0 = default_key_tile.
  Index key_tile = 0;
};

namespace detail {

template <class TQ, class TKV>
void check_attention_shapes(const char* function, const HeadsView<const TQ>& q,
                            const HeadsView<const TKV>& k, const HeadsView<const TKV>& v) {
  const auto shapes = [&] {
    return "q is " + shape_string({q.batch, q.heads, q.length, q.dim}) + ", k is " +
           shape_string({k.batch, k.heads, k.length, k.dim}) + ", v is " +
           shape_string({v.batch, v.heads, v.length, v.dim});
  };
  if (q.batch != k.batch || q.batch != v.batch) {
    throw_invalid_argument(function, shapes() + ": batch sizes differ");
  }
  if (q.dim != k.dim)
    throw_invalid_argument(function, shapes() + ": q and k head dims differ");
  if (q.dim < 1)
    throw_invalid_argument(function, shapes() + ": the head dim must be positive");
  if (k.heads != v.heads)
    throw_invalid_argument(function, shapes() + ": k and v head counts differ");
  if (k.length != v.length)
    throw_invalid_argument(function, shapes() + ": k and v lengths differ");
  if (k.heads == 0 ? q.heads != 0 : q.heads % k.heads != 0) {
    throw_invalid_argument(function, shapes() + ": query heads (" + std::to_string(q.heads) +
                                         ") must be a multiple of key/value heads (" +
                                         std::to_string(k.heads) + ")");
  }
}

/// Problems with at most this many scores per head go to naive under Algorithm::automatic.
inline constexpr Index tiny_problem_scores = 64 * 64;

inline const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::automatic:
      return "automatic";
    case Algorithm::naive:
      return "naive";
    case Algorithm::chunked:
      return "chunked";
    case Algorithm::flash:
      return "flash";
    case Algorithm::decode:
      return "decode";
  }
  return "unknown";
}

/// The kernel that will run: automatic resolved, weights checked against the choice.
inline Algorithm resolve_algorithm(const char* function, Algorithm requested, bool wants_weights,
                                   Index q_length, Index k_length) {
  if (requested == Algorithm::automatic) {
    if (wants_weights || q_length * k_length <= tiny_problem_scores)
      return Algorithm::naive;
    return q_length <= decode_max_queries ? Algorithm::decode : Algorithm::flash;
  }
  if (wants_weights && requested != Algorithm::naive) {
    throw_invalid_argument(function, std::string("weights were requested with Algorithm::") +
                                         algorithm_name(requested) +
                                         ": only Algorithm::naive (or automatic) returns them");
  }
  return requested;
}

template <class T>
T resolve_scale(const char* function, const std::optional<T>& scale, Index dim) {
  if (!scale)
    return T(1) / std::sqrt(static_cast<T>(dim));
  if (!std::isfinite(*scale)) {
    throw_invalid_argument(function, "scale is " + std::to_string(*scale) + ": must be finite");
  }
  return *scale;
}

}  // namespace detail

namespace detail {

/// The implementation of scaled_dot_product_attention_into for q stored as TQ, k and v as
/// TKV and out as TO; the arithmetic runs in T = compute_scalar_t<TQ>. 16-bit operands are
/// widened as the kernels read them (flash: tile by tile; naive and chunked: once per head).
template <class TQ, class TKV, class TO>
void attention_into(const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                    const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                    const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                    const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
                    const AttentionOptions<compute_scalar_t<TQ>>& options,
                    compute_scalar_t<TQ>* weights,      // (B, Hq, Lq, Lk) or null
                    compute_scalar_t<TQ>* logsumexp) {  // (B, Hq, Lq) or null
  using T = compute_scalar_t<TQ>;
  static_assert(is_storage_scalar_v<TQ> && is_storage_scalar_v<TKV> && is_storage_scalar_v<TO>,
                "scaled_dot_product_attention: scalars must be floating point, Eigen::half or "
                "Eigen::bfloat16");
  static_assert(std::is_same_v<T, compute_scalar_t<TKV>> && std::is_same_v<T, compute_scalar_t<TO>>,
                "scaled_dot_product_attention: q, k, v and out must share one compute scalar "
                "(float with half or bfloat16; double only with double)");
  constexpr const char* function = "scaled_dot_product_attention";
  check_attention_shapes(function, q, k, v);
  if (out.batch != q.batch || out.heads != q.heads || out.length != q.length || out.dim != v.dim) {
    throw_invalid_argument(function,
                           "out is " + shape_string({out.batch, out.heads, out.length, out.dim}) +
                               " but must be " + shape_string({q.batch, q.heads, q.length, v.dim}) +
                               " (B, Hq, Lq, Dv)");
  }
  check_output_aliasing(function, q, k, v, out);
  const T scale = resolve_scale(function, options.scale, q.dim);
  const Mask<T> mask(function, q.batch, q.heads, q.length, k.length, options.causal, options.window,
                     options.key_lengths, options.keep_mask, options.bias, options.alibi_slopes,
                     options.softcap);

  const Algorithm algorithm =
      resolve_algorithm(function, options.algorithm, weights != nullptr, q.length, k.length);
  if (options.query_tile < 0 || options.key_tile < 0) {
    throw_invalid_argument(function, "query_tile is " + std::to_string(options.query_tile) +
                                         " and key_tile is " + std::to_string(options.key_tile) +
                                         ": tile sizes must be >= 0 (0 = default)");
  }

  const Index batch = q.batch, q_heads = q.heads, q_length = q.length, k_length = k.length;
  const Index group = k.heads == 0 ? 1 : q_heads / k.heads;  // query heads per kv head
  const double flops = 2.0 * static_cast<double>(q_length * k_length) *
                       static_cast<double>(q.dim + v.dim) * static_cast<double>(batch * q_heads);
  (void)flops;

  if (algorithm == Algorithm::naive) {
    const Index work_items = batch * q_heads;
#if ATTN_HAS_OPENMP
#pragma omp parallel if (work_items > 1 && flops > 1e6)
#endif
    {
      Matrix<T> workspace;  // one per thread, reused across heads
      WidenedHead<T, TQ> q_head;
      WidenedHead<T, TKV> k_head, v_head;
      NarrowedRows<T, TO> out_rows;
#if ATTN_HAS_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
      for (Index item = 0; item < work_items; ++item) {
        const Index b = item / q_heads;
        const Index h = item % q_heads;
        T* head_weights = weights != nullptr ? weights + item * q_length * k_length : nullptr;
        T* head_lse = logsumexp != nullptr ? logsumexp + item * q_length : nullptr;
        naive_attention_head<T>(q_head(q, b, h), k_head(k, b, h / group), v_head(v, b, h / group),
                                out_rows.rows(out.head(b, h), 0, q_length), mask, b, h, scale,
                                workspace, head_weights, head_lse);
        out_rows.store(out.head(b, h), 0, q_length);
      }
    }
    return;
  }

  if (algorithm == Algorithm::decode) {
    // Few query rows: 16-bit q and out are widened and narrowed whole, (B, Hq, Lq, D + Dv).
    std::vector<T> q_wide, out_wide;
    HeadsView<const T> q_view;
    HeadsView<T> out_view;
    if constexpr (std::is_same_v<TQ, T>) {
      q_view = q;
    } else {
      q_wide.resize(static_cast<std::size_t>(batch * q_heads * q_length * q.dim));
      q_view = bhld_view(static_cast<const T*>(q_wide.data()), batch, q_heads, q_length, q.dim);
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < q_heads; ++h) {
          for (Index i = 0; i < q_length; ++i)
            widen(q.head(b, h).row(i).data(),
                  q_wide.data() + ((b * q_heads + h) * q_length + i) * q.dim, q.dim);
        }
      }
    }
    if constexpr (std::is_same_v<TO, T>) {
      out_view = out;
    } else {
      out_wide.resize(static_cast<std::size_t>(batch * q_heads * q_length * v.dim));
      out_view = bhld_view(out_wide.data(), batch, q_heads, q_length, v.dim);
    }
    decode_attention<T, TKV>(q_view, k, v, out_view, mask, scale, logsumexp);
    if constexpr (!std::is_same_v<TO, T>) {
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < q_heads; ++h)
          out.head(b, h) = out_view.head(b, h).template cast<TO>();
      }
    }
    return;
  }

  // chunked and flash: work items are (b, h, query tile). Each item is computed by one
  // thread in the same way whatever the thread count, so results are bitwise identical for
  // any number of threads. Items are handed out dynamically, last query tile first: under
  // a top-left causal mask the last tiles carry the most work.
  const bool flash = algorithm == Algorithm::flash;
  const Index query_tile = options.query_tile > 0
                               ? options.query_tile
                               : (flash ? default_query_tile : default_chunk_rows);
  const Index key_tile = options.key_tile > 0 ? options.key_tile : default_key_tile;
  const Index q_tiles = q_length == 0 ? 0 : (q_length + query_tile - 1) / query_tile;
  const Index work_items = batch * q_heads * q_tiles;
  constexpr bool widens_kv = !std::is_same_v<TKV, T>;
#if ATTN_HAS_OPENMP
#pragma omp parallel if (work_items > 1 && flops > 1e6)
#endif
  {
    // One workspace per thread, allocated once per call.
    FlashWorkspace<T> flash_workspace;
#if ATTN_HAS_AVX512_FLASH
    avx512::FlashWorkspace avx512_workspace;
#endif
    Matrix<T> chunk_workspace, q_rows_buffer;
    WidenedHead<T, TKV> k_head, v_head;  // chunked only: flash widens k and v tile by tile
    NarrowedRows<T, TO> out_rows;
    if (flash) {
      const Index rows = std::min(query_tile, q_length), keys = std::min(key_tile, k_length);
#if ATTN_HAS_AVX512_FLASH
      if constexpr (std::is_same_v<T, float>)
        avx512_workspace.reserve(rows, keys, q.dim, v.dim, widens_kv);
      else
#endif
        flash_workspace.reserve(rows, keys, q.dim, v.dim, widens_kv);
    }
#if ATTN_HAS_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index item = 0; item < work_items; ++item) {
      const Index head_item = item / q_tiles;  // b * Hq + h
      const Index b = head_item / q_heads;
      const Index h = head_item % q_heads;
      const Index tile = q_tiles - 1 - item % q_tiles;
      const Index i0 = tile * query_tile;
      const Index rows = std::min(i0 + query_tile, q_length) - i0;
      T* tile_lse = logsumexp != nullptr ? logsumexp + head_item * q_length + i0 : nullptr;
      const HeadMatrix<const T> q_rows = rows_as<T, TQ>(q.head(b, h), i0, rows, q_rows_buffer);
      const HeadMatrix<T> tile_out = out_rows.rows(out.head(b, h), i0, rows);
      if (flash) {
#if ATTN_HAS_AVX512_FLASH
        if constexpr (std::is_same_v<T, float>) {
          avx512::flash_attention_tile<TKV>(
              q_rows, k.head(b, h / group), v.head(b, h / group), tile_out, mask, b, h, scale, i0,
              std::min(key_tile, k_length), avx512_workspace, tile_lse);
        } else
#endif
        {
          flash_attention_tile<T, TKV>(q_rows, k.head(b, h / group), v.head(b, h / group), tile_out,
                                       mask, b, h, scale, i0, std::min(key_tile, k_length),
                                       flash_workspace, tile_lse);
        }
      } else {
        chunked_attention_block<T>(q_rows, k_head(k, b, h / group), v_head(v, b, h / group),
                                   tile_out, mask, b, h, scale, i0, chunk_workspace, tile_lse);
      }
      out_rows.store(out.head(b, h), i0, rows);
    }
  }
}

}  // namespace detail

/// Attention on (B, H, L, D) views, written into `out` (B, Hq, Lq, Dv), which may be any
/// strided view (e.g. (B, Lq, Hq, Dv) memory, so that heads are already merged).
/// Optional outputs: `weights` (B, Hq, Lq, Lk) and `logsumexp` (B, Hq, Lq), contiguous, in
/// the compute scalar (float for 16-bit data).
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
