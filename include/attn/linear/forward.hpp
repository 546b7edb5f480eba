// attn/linear/forward.hpp: linear attention's forward (attn/linear_attention.hpp): its options,
// the non-causal form by one pass of key sums and the causal form by chunked prefix sums.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/checks.hpp"
#include "attn/config.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/linear/feature_map.hpp"
#include "attn/mask.hpp"
#include "attn/plan.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Everything about a linear attention call except the tensors.
template <class T>
struct LinearAttentionOptions {
  FeatureMap<T> feature_map;       ///< phi; default elu(x) + 1
  Causal causal = Causal::none;    ///< query i sees keys j <= i + offset (mask.hpp's alignment)
  std::vector<Index> key_lengths;  ///< (B) valid keys per batch entry; empty = all
  T eps = T(1e-6);                 ///< added to every normaliser phi(q_i) . z; with eps = 0 a
                                   ///< row whose normaliser is 0 gives NaN, not 0
  Index chunk = 0;                 ///< rows per chunk; 0 = the plan's (default_linear_chunk)
  /// Not supported by linear attention: must stay empty. Present so that options carried
  /// over from scaled_dot_product_attention fail loudly instead of being ignored.
  Broadcast<bool> keep_mask;
  Broadcast<T> bias;  ///< not supported either: must stay empty
};

namespace detail {

/// Per-thread buffers of the linear attention kernels: allocated once per call.
template <class T>
struct LinearWorkspace {
  Matrix<T> q_features;   // (C, M)
  Matrix<T> k_features;   // (C, M)
  Matrix<T> scores;       // (C, C) intra-chunk phi(q) phi(k)^T, causal only
  Matrix<T> state;        // (M, Dv)  S = sum phi(k_j) v_j^T
  Vector<T> normaliser;   // (M)      z = sum phi(k_j)
  Vector<T> denominator;  // (C)
  T key_shift = -std::numeric_limits<T>::infinity();  // FAVOR+ only

  void reserve(Index chunk, Index features, Index value_dim, bool causal) {
    q_features.resize(chunk, features);
    k_features.resize(chunk, features);
    if (causal)
      scores.resize(chunk, chunk);
    state.resize(features, value_dim);
    normaliser.resize(features);
    denominator.resize(chunk);
  }
  void reset() {
    state.setZero();
    normaliser.setZero();
    key_shift = -std::numeric_limits<T>::infinity();
  }
  void rescale(T factor) {
    if (factor != T(1)) {
      state *= factor;
      normaliser *= factor;
    }
  }
};

/// Adds keys [j0, j1) of one kv head to the state, `chunk` rows at a time.
template <class T>
void absorb_keys(const FeatureMap<T>& map, const HeadMatrix<const T>& k,  // (Lk, D)
                 const HeadMatrix<const T>& v,                            // (Lk, Dv)
                 Index j0, Index j1, Index chunk, LinearWorkspace<T>& ws) {
  for (Index a = j0; a < j1; a += chunk) {
    const Index n = std::min(chunk, j1 - a);
    auto phi_k = ws.k_features.topRows(n);  // (n, M)
    ws.rescale(map.apply_keys(k.middleRows(a, n), phi_k, ws.key_shift));
    ws.state.noalias() += phi_k.transpose() * v.middleRows(a, n);
    ws.normaliser.noalias() += phi_k.colwise().sum().transpose();
  }
}

/// out rows [i0, i0 + n) of one query head: phi(q) S / (phi(q) z + eps), plus, when
/// `intra_keys` > 0, the keys [kv0, kv0 + intra_keys) not yet in the state, whose features
/// are in ws.k_features: local key c is visible to local row r iff c <= r + diagonal.
template <class T>
void linear_query_chunk(const FeatureMap<T>& map, const HeadMatrix<const T>& q,  // (Lq, D)
                        const HeadMatrix<const T>& v,                            // (Lk, Dv)
                        HeadMatrix<T>& out,                                      // (Lq, Dv)
                        Index i0, Index n, Index kv0, Index intra_keys, Index diagonal, T eps,
                        LinearWorkspace<T>& ws) {
  auto phi_q = ws.q_features.topRows(n);  // (n, M)
  map.apply_queries(q.middleRows(i0, n), phi_q);
  auto out_chunk = out.middleRows(i0, n);         // (n, Dv)
  auto denominator = ws.denominator.head(n);      // (n)
  out_chunk.noalias() = phi_q * ws.state;         // pass 1: the state (keys before the chunk)
  denominator.noalias() = phi_q * ws.normaliser;  //         and its normaliser
  if (intra_keys > 0) {                           // pass 2: keys on the chunk's diagonal
    auto scores = ws.scores.topLeftCorner(n, intra_keys);  // (n, nk)
    scores.noalias() = phi_q * ws.k_features.topRows(intra_keys).transpose();
    for (Index r = 0; r < n; ++r) {  // hide keys c > r + diagonal (tril mask)
      const Index first_hidden = std::clamp(r + diagonal + 1, Index(0), intra_keys);
      scores.row(r).tail(intra_keys - first_hidden).setZero();
    }
    out_chunk.noalias() += scores * v.middleRows(kv0, intra_keys);
    denominator += scores.rowwise().sum();
  }
  out_chunk.array().colwise() /= denominator.array() + eps;  // pass 3: normalise
}

/// Query i of a causal call sees keys j <= i + offset: mask.hpp's per-sequence rule, from
/// this sequence's key length (0 for top_left, key_length - Lq for bottom_right). The
/// forward and the backward both take it from here.
inline Index linear_causal_offset(Causal causal, Index q_length, Index key_length) {
  return causal == Causal::top_left ? 0 : key_length - q_length;
}

/// Linear attention for every query head that reads kv head g of batch entry b.
template <class T>
void linear_attention_kv_head(const HeadsView<const T>& q, const HeadsView<const T>& k,
                              const HeadsView<const T>& v, const HeadsView<T>& out,
                              const FeatureMap<T>& map, Index b, Index g, Index group,
                              Index key_length, Causal causal, Index chunk, T eps,
                              LinearWorkspace<T>& ws) {
  const HeadMatrix<const T> k_head = k.head(b, g);  // (Lk, D)
  const HeadMatrix<const T> v_head = v.head(b, g);  // (Lk, Dv)
  const Index q_length = q.length;
  ws.reset();
  if (causal == Causal::none) {
    absorb_keys(map, k_head, v_head, 0, key_length, chunk, ws);
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      const HeadMatrix<const T> q_head = q.head(b, h);
      HeadMatrix<T> out_head = out.head(b, h);
      for (Index i0 = 0; i0 < q_length; i0 += chunk) {
        linear_query_chunk(map, q_head, v_head, out_head, i0, std::min(chunk, q_length - i0), 0, 0,
                           0, eps, ws);
      }
    }
    return;
  }
  // Causal: query i sees keys j <= i + offset (and j < key_length). Chunk [i0, i0 + n) takes
  // the keys before i0 + offset from the state and the keys [i0 + offset, i0 + offset + n)
  // (its diagonal block) through one masked (n, n) product; then those keys join the state.
  const Index offset = linear_causal_offset(causal, q_length, key_length);
  Index absorbed = 0;  // the state holds keys [0, absorbed)
  for (Index i0 = 0; i0 < q_length; i0 += chunk) {
    const Index n = std::min(chunk, q_length - i0);
    const Index diagonal_key = i0 + offset;  // key on row i0's diagonal
    const Index lo = std::clamp(diagonal_key, Index(0), key_length);
    const Index hi = std::clamp(diagonal_key + n, Index(0), key_length);
    if (absorbed < lo) {  // only before the first chunk (bottom_right with Lk > Lq)
      absorb_keys(map, k_head, v_head, absorbed, lo, chunk, ws);
      absorbed = lo;
    }
    const Index intra_keys = hi - lo;
    if (intra_keys > 0) {
      auto phi_k = ws.k_features.topRows(intra_keys);
      ws.rescale(map.apply_keys(k_head.middleRows(lo, intra_keys), phi_k, ws.key_shift));
    }
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      HeadMatrix<T> out_head = out.head(b, h);
      linear_query_chunk(map, q.head(b, h), v_head, out_head, i0, n, lo, intra_keys,
                         diagonal_key - lo, eps, ws);
    }
    if (intra_keys > 0) {
      const auto phi_k = ws.k_features.topRows(intra_keys);
      ws.state.noalias() += phi_k.transpose() * v_head.middleRows(lo, intra_keys);
      ws.normaliser.noalias() += phi_k.colwise().sum().transpose();
      absorbed = hi;
    }
  }
}

template <class T>
void check_linear_options(const char* function, const LinearAttentionOptions<T>& options,
                          const HeadsView<const T>& q, const HeadsView<const T>& k) {
  if (!options.keep_mask.empty()) {
    const auto& d = options.keep_mask.dims();
    throw_invalid_argument(function, "keep_mask is " + shape_string({d[0], d[1], d[2], d[3]}) +
                                         ": linear attention never forms the (Lq, Lk) scores, "
                                         "so it cannot apply a boolean mask (use causal and "
                                         "key_lengths, or scaled_dot_product_attention)");
  }
  if (!options.bias.empty()) {
    const auto& d = options.bias.dims();
    throw_invalid_argument(function, "bias is " + shape_string({d[0], d[1], d[2], d[3]}) +
                                         ": linear attention never forms the (Lq, Lk) scores, "
                                         "so it cannot add a bias to them (use "
                                         "scaled_dot_product_attention)");
  }
  if (!(options.eps >= T(0)) || !std::isfinite(options.eps)) {
    throw_invalid_argument(function,
                           "eps is " + std::to_string(options.eps) + ": must be finite and >= 0");
  }
  const FeatureMap<T>& map = options.feature_map;
  if (map.kind() == FeatureKind::favor_plus && map.projection().cols() != q.dim) {
    throw_invalid_argument(function,
                           "the FAVOR+ projection is " +
                               shape_string({map.projection().rows(), map.projection().cols()}) +
                               " (m, D) but q and k have D = " + std::to_string(q.dim));
  }
  // key_lengths: the same rules and messages as scaled_dot_product_attention.
  (void)Mask(function, q.batch, q.heads, q.length, k.length, options.causal, Window{},
             options.key_lengths);
}

/// The plan of a linear attention call on these views (attn/plan.hpp).
template <class T>
LinearPlan plan_linear_call(const char* function, const HeadsView<const T>& q,
                            const HeadsView<const T>& k, const HeadsView<const T>& v,
                            const LinearAttentionOptions<T>& options, bool backward) {
  const LinearAttentionShape shape{q.batch,  q.heads,
                                   k.heads,  q.length,
                                   k.length, options.feature_map.features(q.dim),
                                   v.dim,    options.causal != Causal::none};
  return plan_linear_attention(shape, options.chunk, backward, function);
}

/// body(b, kv head, n_k(b), workspace) for every (b, kv head) item of `plan`, on the OpenMP
/// threads when it is parallel (kernels/item_loop.hpp): each item is computed by one thread
/// in one order, so any thread count gives the same bits.
template <class T, class MakeWorkspace, class Body>
void for_each_kv_head(const HeadsView<const T>& k, const LinearAttentionOptions<T>& options,
                      const LinearPlan& plan, const MakeWorkspace& make_workspace,
                      const Body& body) {
  for_each_item(plan.work_items, plan.parallel, make_workspace, [&](Index item, auto& ws) {
    const Index b = item / k.heads;
    const Index key_length =
        options.key_lengths.empty() ? k.length : options.key_lengths[static_cast<std::size_t>(b)];
    body(b, item % k.heads, key_length, ws);
  });
}

}  // namespace detail

/// Linear attention on (B, H, L, D) views, written into `out` (B, Hq, Lq, Dv), which may be
/// any strided view. Work is split over (batch, kv head) items with OpenMP; each item computes
/// its key/value sums once for all the query heads that share them, in the same way on any
/// thread, so results are bitwise identical for any thread count (tested).
template <class T>
void linear_attention_into(const HeadsView<const T>& q,  // (B, Hq, Lq, D)
                           const HeadsView<const T>& k,  // (B, Hkv, Lk, D)
                           const HeadsView<const T>& v,  // (B, Hkv, Lk, Dv)
                           const HeadsView<T>& out,      // (B, Hq, Lq, Dv)
                           const LinearAttentionOptions<T>& options = {}) {
  constexpr const char* function = "linear_attention";
  detail::check_attention_shapes(function, q, k, v);
  detail::check_output_shape(function, q, v.dim, out);
  detail::check_linear_options(function, options, q, k);
  detail::check_output_aliasing(function, q, k, v, out);

  const FeatureMap<T>& map = options.feature_map;
  const Index features = map.features(q.dim);
  const LinearPlan plan = detail::plan_linear_call(function, q, k, v, options, false);
  const Index chunk = plan.chunk;
  const bool causal = plan.causal;
  const Index group = k.heads == 0 ? 1 : q.heads / k.heads;
  const auto make_workspace = [&] {  // one per thread
    detail::LinearWorkspace<T> ws;
    ws.reserve(chunk, features, v.dim, causal);
    return ws;
  };
  detail::for_each_kv_head(k, options, plan, make_workspace,
                           [&](Index b, Index g, Index key_length, detail::LinearWorkspace<T>& ws) {
                             detail::linear_attention_kv_head(q, k, v, out, map, b, g, group,
                                                              key_length, options.causal, chunk,
                                                              options.eps, ws);
                           });
}

/// Batched linear attention on rank-4 row-major tensors or tensor maps (B, H, L, D).
/// Returns out (B, Hq, Lq, Dv).
template <class TQ, class TK, class TV,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV>>>
Tensor<detail::rank4_scalar_t<TQ>, 4> linear_attention(
    const TQ& q,  // (B, Hq, Lq, D)
    const TK& k,  // (B, Hkv, Lk, D)
    const TV& v,  // (B, Hkv, Lk, Dv)
    const LinearAttentionOptions<detail::rank4_scalar_t<TQ>>& options = {}) {
  using T = detail::rank4_scalar_t<TQ>;
  static_assert(std::is_same_v<T, detail::rank4_scalar_t<TK>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TV>>,
                "linear_attention: q, k and v must have the same scalar type");
  const HeadsView<const T> qv = detail::as_heads_view(q);
  const HeadsView<const T> kv = detail::as_heads_view(k);
  const HeadsView<const T> vv = detail::as_heads_view(v);
  detail::check_attention_shapes("linear_attention", qv, kv, vv);
  Tensor<T, 4> out(qv.batch, qv.heads, qv.length, vv.dim);
  linear_attention_into<T>(qv, kv, vv, bhld_view(out), options);
  return out;
}

/// One head: q (Lq, D), k (Lk, D), v (Lk, Dv) -> out (Lq, Dv). Any Eigen matrix expression
/// (column-major inputs are copied to row-major first); key_lengths, if given, has one entry.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> linear_attention(
    const Eigen::MatrixBase<DQ>& q,  // (Lq, D)
    const Eigen::MatrixBase<DK>& k,  // (Lk, D)
    const Eigen::MatrixBase<DV>& v,  // (Lk, Dv)
    const LinearAttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  static_assert(std::is_same_v<T, typename DK::Scalar> && std::is_same_v<T, typename DV::Scalar>,
                "linear_attention: q, k and v must have the same scalar type");
  using RowMajorRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
  const RowMajorRef qr(q), kr(k), vr(v);
  const auto view = [](const RowMajorRef& m) {
    return HeadsView<const T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride()};
  };
  const HeadsView<const T> qv = view(qr), kv = view(kr), vv = view(vr);
  detail::check_attention_shapes("linear_attention", qv, kv, vv);
  Matrix<T> out(qr.rows(), vr.cols());
  linear_attention_into<T>(qv, kv, vv,
                           HeadsView<T>{out.data(), 1, 1, out.rows(), out.cols(), 0, 0, out.cols()},
                           options);
  return out;
}

}  // namespace attn
