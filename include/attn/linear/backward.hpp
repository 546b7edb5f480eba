// attn/linear/backward.hpp: the gradients of linear attention (attn/linear_attention.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/checks.hpp"
#include "attn/config.hpp"
#include "attn/linear/feature_map.hpp"
#include "attn/linear/forward.hpp"
#include "attn/mask.hpp"
#include "attn/tensor.hpp"

namespace attn {

// ---------------------------------------------------------------------------------------------
// Backward: the gradients of a scalar loss with respect to q, k and v, given dout = dL/dout.
//
// Per query row i (of one query head) and visible key j, with A_ij = phi(q_i) . phi(k_j),
// den_i = sum_j A_ij and out_i = sum_j A_ij v_j / (den_i + eps):
//
//   u_i = dout_i / (den_i + eps)                  (Dv)
//   c_i = -(dout_i . out_i) / (den_i + eps)       scalar
//   dA_ij = u_i . v_j + c_i
//   d phi(q_i) = S_i u_i + c_i z_i                S_i, z_i: the forward's sums over i's keys
//   d phi(k_j) = R_j v_j + r_j,  dv_j = R_j^T phi(k_j)
//                R_j = sum_i phi(q_i) u_i^T  (M, Dv),  r_j = sum_i c_i phi(q_i)  (M)
//                over the query rows i that see key j (of every query head of the group)
//   dq_i, dk_j = the feature map's vector-Jacobian product of d phi(q_i), d phi(k_j)
//
// Non-causal: one S, z and one R, r for the head. Causal: pass 1 runs over the chunks in the
// forward's order with the running S, z (recomputing out_i and den_i as the forward did) and
// gives dq; pass 2 runs over them in reverse with the running R, r and gives dk and dv. The
// intra-chunk pairs go through the same masked (C, C) blocks as the forward. u and c of
// every row are kept between the passes: (group * Lq) * (Dv + 1) scalars; nothing is (L, L)
// or per position (L, M, Dv).
//
// FAVOR+ shifts are differentiated exactly, not held constant (Performer's implementations
// stop the gradient at the max). Query row i's features are exp(a_i - max(a_i)) / sqrt(m),
// and a chunk's key features exp(a_j - s_c) / sqrt(m) with s_c the head's key shift when that
// chunk ran, itself one key's exponent. Scaling all of a row's features (or all the keys a
// chunk sees) by one factor changes out_i only through eps: d out_i / d shift =
// -out_i eps / (den_i + eps), so the gradient on the shift is eps * c_i, summed over the rows
// that used it; it flows to the exponent the shift is (its row and feature). With eps = 0 it
// vanishes, and the constant treatment and the exact one coincide.
// ---------------------------------------------------------------------------------------------

/// dq, dk and dv of linear_attention_backward, shaped like q, k and v.
template <class Storage>  // Tensor<T, 4> or Matrix<T>
struct LinearAttentionGradients {
  Storage dq;  ///< (B, Hq, Lq, D) or (Lq, D)
  Storage dk;  ///< (B, Hkv, Lk, D) or (Lk, D)
  Storage dv;  ///< (B, Hkv, Lk, Dv) or (Lk, Dv)
};

namespace detail {

/// Per-thread buffers of the linear attention backward: allocated once per call.
template <class T>
struct LinearBackwardWorkspace {
  Matrix<T> q_features;       // (C, M)   phi(Q_c)
  Matrix<T> k_features;       // (C, M)   phi(K_c)
  Matrix<T> d_q_features;     // (C, M)   d phi(Q_c)
  Matrix<T> d_k_features;     // (C, M)   d phi(K_c)
  Matrix<T> scores;           // (C, C)   causal: masked phi(Q_c) phi(K_c)^T
  Matrix<T> d_scores;         // (C, C)   causal: masked dA
  Matrix<T> out;              // (C, Dv)  the forward's output rows
  Matrix<T> d_values;         // (C, Dv)  dv of the chunk's keys
  Vector<T> denominator;      // (C)      den + eps
  Matrix<T> state;            // (M, Dv)  S = sum phi(k_j) v_j^T
  Vector<T> normaliser;       // (M)      z = sum phi(k_j)
  Matrix<T> d_state;          // (M, Dv)  R = sum phi(q_i) u_i^T
  Vector<T> d_normaliser;     // (M)      r = sum c_i phi(q_i)
  Matrix<T> u;                // (group * Lq, Dv) causal, (C, Dv) non-causal
  Vector<T> c;                // (group * Lq)     causal, (C)     non-causal
  std::vector<Index> argmax;  // (C) FAVOR+: each query row's largest exponent
  // FAVOR+, one entry per chunk of queries (one for non-causal): the key shift it saw, the
  // key row and feature that shift is the exponent of ({-1, -1}: none), the gradient on it.
  std::vector<T> shifts;
  std::vector<std::pair<Index, Index>> owners;
  std::vector<T> d_shifts;
  T key_shift = -std::numeric_limits<T>::infinity();
  std::pair<Index, Index> owner{-1, -1};

  void reserve(Index chunk, Index features, Index value_dim, bool causal, Index rows) {
    q_features.resize(chunk, features);
    k_features.resize(chunk, features);
    d_q_features.resize(chunk, features);
    d_k_features.resize(chunk, features);
    if (causal) {
      scores.resize(chunk, chunk);
      d_scores.resize(chunk, chunk);
    }
    out.resize(chunk, value_dim);
    d_values.resize(chunk, value_dim);
    denominator.resize(chunk);
    state.resize(features, value_dim);
    normaliser.resize(features);
    d_state.resize(features, value_dim);
    d_normaliser.resize(features);
    u.resize(causal ? rows : chunk, value_dim);
    c.resize(causal ? rows : chunk);
  }
  void reset() {
    state.setZero();
    normaliser.setZero();
    d_state.setZero();
    d_normaliser.setZero();
    key_shift = -std::numeric_limits<T>::infinity();
    owner = {-1, -1};
    shifts.clear();
    owners.clear();
    d_shifts.clear();
  }
  /// Key features of rows [j0, j0 + n) into k_features, raising the shift as the forward
  /// does (and rescaling S, z), noting which exponent the shift comes from.
  void key_features(const FeatureMap<T>& map, const HeadMatrix<const T>& k, Index j0, Index n) {
    std::pair<Index, Index> raised{-1, -1};
    auto phi_k = k_features.topRows(n);  // (n, M)
    const T factor = map.apply_keys(k.middleRows(j0, n), phi_k, key_shift, &raised);
    if (raised.first >= 0)
      owner = {j0 + raised.first, raised.second};
    if (factor != T(1)) {
      state *= factor;
      normaliser *= factor;
    }
  }
  void absorb(const HeadMatrix<const T>& v, Index j0, Index n) {
    const auto phi_k = k_features.topRows(n);
    state.noalias() += phi_k.transpose() * v.middleRows(j0, n);
    normaliser.noalias() += phi_k.colwise().sum().transpose();
  }
};

/// Zeroes local key c > r + diagonal of row r of block (n, nk): the forward's tril mask.
template <class Block>
void hide_future_keys(Block&& block, Index diagonal) {
  const Index keys = block.cols();
  for (Index r = 0; r < block.rows(); ++r) {
    const Index first_hidden = std::clamp(r + diagonal + 1, Index(0), keys);
    block.row(r).tail(keys - first_hidden).setZero();
  }
}

/// Pass 1 on query rows [i0, i0 + n) of one head: recomputes out and den as the forward did
/// (state S, z = keys before the chunk; plus keys [kv0, kv0 + intra_keys), whose features
/// are in ws.k_features, local key c visible to local row r iff c <= r + diagonal), writes
/// u (n, Dv), c (n) and dq rows. Returns sum_r eps * c_r, the gradient on the key shift.
template <class T>
T linear_backward_query_chunk(const FeatureMap<T>& map, const HeadMatrix<const T>& q,  // (Lq, D)
                              const HeadMatrix<const T>& v,                            // (Lk, Dv)
                              const HeadMatrix<const T>& dout,                         // (Lq, Dv)
                              HeadMatrix<T>& dq,                                       // (Lq, D)
                              Index i0, Index n, Index kv0, Index intra_keys, Index diagonal, T eps,
                              Eigen::Ref<Matrix<T>> u,  // (n, Dv)
                              Eigen::Ref<Vector<T>> c,  // (n)
                              LinearBackwardWorkspace<T>& ws) {
  const auto q_rows = q.middleRows(i0, n);  // (n, D)
  const auto g = dout.middleRows(i0, n);    // (n, Dv)
  auto phi_q = ws.q_features.topRows(n);    // (n, M)
  map.apply_queries(q_rows, phi_q, ws.argmax);
  auto out = ws.out.topRows(n);               // (n, Dv)
  auto denominator = ws.denominator.head(n);  // (n)
  out.noalias() = phi_q * ws.state;           // the forward's passes 1 and 2
  denominator.noalias() = phi_q * ws.normaliser;
  const auto phi_k = ws.k_features.topRows(intra_keys);  // (nk, M)
  const auto v_intra = v.middleRows(kv0, intra_keys);    // (nk, Dv)
  if (intra_keys > 0) {
    auto scores = ws.scores.topLeftCorner(n, intra_keys);  // (n, nk)
    scores.noalias() = phi_q * phi_k.transpose();
    hide_future_keys(scores, diagonal);
    out.noalias() += scores * v_intra;
    denominator += scores.rowwise().sum();
  }
  denominator.array() += eps;
  out.array().colwise() /= denominator.array();           // the forward's output
  u.array() = g.array().colwise() / denominator.array();  // dout / (den + eps)
  c.array() = -(g.array() * out.array()).rowwise().sum() / denominator.array();
  auto d_phi_q = ws.d_q_features.topRows(n);  // (n, M)
  d_phi_q.noalias() = u * ws.state.transpose();
  d_phi_q.noalias() += c * ws.normaliser.transpose();
  if (intra_keys > 0) {
    auto d_scores = ws.d_scores.topLeftCorner(n, intra_keys);  // (n, nk)
    d_scores.noalias() = u * v_intra.transpose();
    d_scores.colwise() += c;
    hide_future_keys(d_scores, diagonal);
    d_phi_q.noalias() += d_scores * phi_k;
  }
  auto dq_rows = dq.middleRows(i0, n);
  map.vjp(q_rows, phi_q, d_phi_q, dq_rows);
  if (map.kind() == FeatureKind::favor_plus) {  // each row's own shift: its largest exponent
    for (Index r = 0; r < n; ++r) {
      auto dq_row = dq_rows.row(r);
      map.add_exponent_gradient(q_rows.row(r), ws.argmax[static_cast<std::size_t>(r)], eps * c(r),
                                dq_row);
    }
  }
  return eps * c.sum();
}

/// Pass 2 on keys [j0, j0 + n) whose features at shift `shift` the state R, r (every query
/// row that sees them, rescaled to that shift) covers: dk = vjp(R v + r), dv = R^T phi(k).
/// With `intra`, the chunk's own rows are added first (the masked (n, nk) blocks).
template <class T>
void linear_backward_keys(const FeatureMap<T>& map, const HeadMatrix<const T>& k,  // (Lk, D)
                          const HeadMatrix<const T>& v,                            // (Lk, Dv)
                          HeadMatrix<T>& dk, HeadMatrix<T>& dv, Index j0, Index n, T shift,
                          LinearBackwardWorkspace<T>& ws) {
  auto phi_k = ws.k_features.topRows(n);      // (n, M)
  auto d_phi_k = ws.d_k_features.topRows(n);  // (n, M)
  map.apply_keys_at(k.middleRows(j0, n), phi_k, shift);
  d_phi_k.noalias() = v.middleRows(j0, n) * ws.d_state.transpose();
  d_phi_k.rowwise() += ws.d_normaliser.transpose();
  auto dv_rows = dv.middleRows(j0, n);
  dv_rows.noalias() = phi_k * ws.d_state;
  auto dk_rows = dk.middleRows(j0, n);
  map.vjp(k.middleRows(j0, n), phi_k, d_phi_k, dk_rows);
}

/// One item of the backward: kv head g of batch entry b (its K, V and their gradients) and
/// the `group` query heads that read it.
template <class T>
struct LinearBackwardItem {
  const HeadsView<const T>& q;     // (B, Hq, Lq, D)
  const HeadsView<const T>& dout;  // (B, Hq, Lq, Dv)
  const HeadsView<T>& dq;          // (B, Hq, Lq, D)
  HeadMatrix<const T> k_head;      // (Lk, D)
  HeadMatrix<const T> v_head;      // (Lk, Dv)
  HeadMatrix<T> dk_head;           // (Lk, D)
  HeadMatrix<T> dv_head;           // (Lk, Dv)
  Index b, g, group;
};

/// The non-causal backward of one item: S, z over its keys, pass 1 over every query row (dq,
/// and R, r), pass 2 over the keys (dk, dv). Returns how many keys received gradients.
template <class T>
Index linear_backward_non_causal(LinearBackwardItem<T>& item, const FeatureMap<T>& map,
                                 Index key_length, Index chunk, T eps,
                                 LinearBackwardWorkspace<T>& ws) {
  auto& [q, dout, dq, k_head, v_head, dk_head, dv_head, b, g, group] = item;
  const Index q_length = q.length;
  const bool favor = map.kind() == FeatureKind::favor_plus;
  for (Index a = 0; a < key_length; a += chunk) {  // S, z: the forward's absorb_keys
    const Index n = std::min(chunk, key_length - a);
    ws.key_features(map, k_head, a, n);
    ws.absorb(v_head, a, n);
  }
  T d_shift = 0;
  for (Index h = g * group; h < (g + 1) * group; ++h) {  // pass 1: dq, and R, r
    const HeadMatrix<const T> q_head = q.head(b, h), dout_head = dout.head(b, h);
    HeadMatrix<T> dq_head = dq.head(b, h);
    for (Index i0 = 0; i0 < q_length; i0 += chunk) {
      const Index n = std::min(chunk, q_length - i0);
      auto u = ws.u.topRows(n);
      auto c = ws.c.head(n);
      d_shift += linear_backward_query_chunk<T>(map, q_head, v_head, dout_head, dq_head, i0, n, 0,
                                                0, 0, eps, u, c, ws);
      const auto phi_q = ws.q_features.topRows(n);
      ws.d_state.noalias() += phi_q.transpose() * u;
      ws.d_normaliser.noalias() += phi_q.transpose() * c;
    }
  }
  for (Index a = 0; a < key_length; a += chunk)  // pass 2: dk, dv
    linear_backward_keys(map, k_head, v_head, dk_head, dv_head, a, std::min(chunk, key_length - a),
                         ws.key_shift, ws);
  if (favor) {
    ws.owners.push_back(ws.owner);
    ws.d_shifts.push_back(d_shift);
  }
  return key_length;
}

/// The causal backward of one item: pass 1 in the forward's chunk order (dq), pass 2 in
/// reverse (dk, dv). Returns how many keys received gradients.
template <class T>
Index linear_backward_causal(LinearBackwardItem<T>& item, const FeatureMap<T>& map,
                             Index key_length, Causal causal, Index chunk, T eps,
                             LinearBackwardWorkspace<T>& ws) {
  auto& [q, dout, dq, k_head, v_head, dk_head, dv_head, b, g, group] = item;
  const Index q_length = q.length;
  const bool favor = map.kind() == FeatureKind::favor_plus;
  Index covered = 0;  // keys [0, covered) receive gradients, the others none
  // Pass 1, the forward's chunk loop: query chunk [i0, i0 + n) sees the keys before
  // i0 + offset through S, z and its diagonal block [lo, hi) through the masked scores.
  const Index offset = linear_causal_offset(causal, q_length, key_length);
  const auto bounds = [&](Index i0, Index n, Index& lo, Index& hi) {
    lo = std::clamp(i0 + offset, Index(0), key_length);
    hi = std::clamp(i0 + offset + n, Index(0), key_length);
  };
  Index absorbed = 0;
  for (Index i0 = 0; i0 < q_length; i0 += chunk) {
    const Index n = std::min(chunk, q_length - i0);
    Index lo = 0, hi = 0;
    bounds(i0, n, lo, hi);
    for (; absorbed < lo; absorbed += std::min(chunk, lo - absorbed)) {  // bottom_right
      const Index m = std::min(chunk, lo - absorbed);
      ws.key_features(map, k_head, absorbed, m);
      ws.absorb(v_head, absorbed, m);
    }
    const Index intra_keys = hi - lo;
    if (intra_keys > 0)
      ws.key_features(map, k_head, lo, intra_keys);
    T d_shift = 0;
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      const HeadMatrix<const T> q_head = q.head(b, h), dout_head = dout.head(b, h);
      HeadMatrix<T> dq_head = dq.head(b, h);
      const Index row0 = (h - g * group) * q_length + i0;
      auto u = ws.u.middleRows(row0, n);
      auto c = ws.c.segment(row0, n);
      d_shift += linear_backward_query_chunk<T>(map, q_head, v_head, dout_head, dq_head, i0, n, lo,
                                                intra_keys, i0 + offset - lo, eps, u, c, ws);
    }
    ws.shifts.push_back(ws.key_shift);
    ws.owners.push_back(ws.owner);
    ws.d_shifts.push_back(d_shift);
    if (intra_keys > 0) {
      ws.absorb(v_head, lo, intra_keys);
      absorbed = hi;
    }
  }
  // Pass 2, the chunks in reverse: R, r hold the query rows of the later chunks, in units
  // of the current chunk's key shift (it only grows along the forward, so the rescaling
  // factors are <= 1).
  const auto chunks = static_cast<Index>(ws.shifts.size());
  for (Index ci = chunks - 1; ci >= 0; --ci) {
    const Index i0 = ci * chunk, n = std::min(chunk, q_length - i0);
    Index lo = 0, hi = 0;
    bounds(i0, n, lo, hi);
    const T shift = ws.shifts[static_cast<std::size_t>(ci)];
    if (favor && ci + 1 < chunks) {
      const T later = ws.shifts[static_cast<std::size_t>(ci + 1)];
      if (later != shift) {
        const T factor = std::exp(shift - later);
        ws.d_state *= factor;
        ws.d_normaliser *= factor;
      }
    }
    const Index intra_keys = hi - lo;
    auto phi_k = ws.k_features.topRows(intra_keys);      // (nk, M)
    auto d_phi_k = ws.d_k_features.topRows(intra_keys);  // (nk, M)
    auto d_values = ws.d_values.topRows(intra_keys);     // (nk, Dv)
    const auto v_intra = v_head.middleRows(lo, intra_keys);
    if (intra_keys > 0) {  // the later chunks' rows
      map.apply_keys_at(k_head.middleRows(lo, intra_keys), phi_k, shift);
      d_phi_k.noalias() = v_intra * ws.d_state.transpose();
      d_phi_k.rowwise() += ws.d_normaliser.transpose();
      d_values.noalias() = phi_k * ws.d_state;
    }
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      auto phi_q = ws.q_features.topRows(n);
      map.apply_queries(q.head(b, h).middleRows(i0, n), phi_q);
      const Index row0 = (h - g * group) * q_length + i0;
      const auto u = ws.u.middleRows(row0, n);
      const auto c = ws.c.segment(row0, n);
      if (intra_keys > 0) {  // this chunk's own rows, through the masked blocks
        auto scores = ws.scores.topLeftCorner(n, intra_keys);
        auto d_scores = ws.d_scores.topLeftCorner(n, intra_keys);
        scores.noalias() = phi_q * phi_k.transpose();
        hide_future_keys(scores, i0 + offset - lo);
        d_scores.noalias() = u * v_intra.transpose();
        d_scores.colwise() += c;
        hide_future_keys(d_scores, i0 + offset - lo);
        d_phi_k.noalias() += d_scores.transpose() * phi_q;
        d_values.noalias() += scores.transpose() * u;
      }
      ws.d_state.noalias() += phi_q.transpose() * u;
      ws.d_normaliser.noalias() += phi_q.transpose() * c;
    }
    if (intra_keys > 0) {
      auto dk_rows = dk_head.middleRows(lo, intra_keys);
      map.vjp(k_head.middleRows(lo, intra_keys), phi_k, d_phi_k, dk_rows);
      dv_head.middleRows(lo, intra_keys) = d_values;
    }
    if (ci == chunks - 1)
      covered = hi;
  }
  // The keys absorbed before the first chunk (bottom_right with Lk > Lq): every row sees
  // them, at the first chunk's shift.
  const Index leading = std::clamp(offset, Index(0), key_length);
  if (q_length > 0) {
    for (Index a = 0; a < leading; a += chunk)
      linear_backward_keys(map, k_head, v_head, dk_head, dv_head, a, std::min(chunk, leading - a),
                           ws.shifts.front(), ws);
  }
  return q_length > 0 ? std::max(covered, leading) : 0;
}

/// The backward for every query head that reads kv head g of batch entry b.
template <class T>
void linear_backward_kv_head(const HeadsView<const T>& q, const HeadsView<const T>& k,
                             const HeadsView<const T>& v, const HeadsView<const T>& dout,
                             const HeadsView<T>& dq, const HeadsView<T>& dk, const HeadsView<T>& dv,
                             const FeatureMap<T>& map, Index b, Index g, Index group,
                             Index key_length, Causal causal, Index chunk, T eps,
                             LinearBackwardWorkspace<T>& ws) {
  LinearBackwardItem<T> item{
      q, dout, dq, k.head(b, g), v.head(b, g), dk.head(b, g), dv.head(b, g), b, g, group};
  const HeadMatrix<const T>& k_head = item.k_head;
  HeadMatrix<T>& dk_head = item.dk_head;
  HeadMatrix<T>& dv_head = item.dv_head;
  const bool favor = map.kind() == FeatureKind::favor_plus;
  ws.reset();
  const Index covered = causal == Causal::none
                            ? linear_backward_non_causal(item, map, key_length, chunk, eps, ws)
                            : linear_backward_causal(item, map, key_length, causal, chunk, eps, ws);
  const Index hidden = k.length - covered;  // keys no query sees: padding, or beyond the last
  dk_head.bottomRows(hidden).setZero();
  dv_head.bottomRows(hidden).setZero();
  if (favor) {  // the key shifts, through the exponents they are
    for (std::size_t e = 0; e < ws.owners.size(); ++e) {
      const auto [row, feature] = ws.owners[e];
      if (row < 0 || ws.d_shifts[e] == T(0))
        continue;
      auto dk_row = dk_head.row(row);
      map.add_exponent_gradient(k_head.row(row), feature, ws.d_shifts[e], dk_row);
    }
  }
}

template <class T>
void check_gradient_aliasing(
    const char* function, std::initializer_list<std::pair<const char*, HeadsView<const T>>> in,
    std::initializer_list<std::pair<const char*, HeadsView<const T>>> out) {
  for (auto o = out.begin(); o != out.end(); ++o) {
    for (const auto& i : in) {
      if (views_may_overlap(o->second, i.second)) {
        throw_invalid_argument(function, std::string(o->first) + " overlaps " + i.first +
                                             ": the gradients must share no element with q, k, "
                                             "v, dout or each other");
      }
    }
    for (auto p = out.begin(); p != o; ++p) {
      if (views_may_overlap(o->second, p->second)) {
        throw_invalid_argument(function, std::string(o->first) + " overlaps " + p->first +
                                             ": the gradients must share no element with q, k, "
                                             "v, dout or each other");
      }
    }
  }
}

}  // namespace detail

/// The backward of linear_attention_into: dq (B, Hq, Lq, D), dk (B, Hkv, Lk, D) and
/// dv (B, Hkv, Lk, Dv) of a loss whose gradient with respect to the output is dout
/// (B, Hq, Lq, Dv), for the same q, k, v and options as the forward (feature map, causal
/// alignment, key_lengths, eps, chunk: the same chunks, so the same FAVOR+ shifts). Needs
/// only the forward's inputs: the forward's sums are recomputed. Padding keys and keys no
/// query sees get zero gradients. Any strided views; the gradients must not overlap the
/// inputs or each other. Work is split over (batch, kv head) items with OpenMP, results
/// bitwise identical for any thread count.
///
/// Cost: about 3x the forward's GEMM FLOPs (dq, dk and dv each need a pass like the
/// forward's). Extra memory: attn/linear_attention.hpp.
template <class T>
void linear_attention_backward_into(const HeadsView<const T>& q,     // (B, Hq, Lq, D)
                                    const HeadsView<const T>& k,     // (B, Hkv, Lk, D)
                                    const HeadsView<const T>& v,     // (B, Hkv, Lk, Dv)
                                    const HeadsView<const T>& dout,  // (B, Hq, Lq, Dv)
                                    const HeadsView<T>& dq,          // (B, Hq, Lq, D)
                                    const HeadsView<T>& dk,          // (B, Hkv, Lk, D)
                                    const HeadsView<T>& dv,          // (B, Hkv, Lk, Dv)
                                    const LinearAttentionOptions<T>& options = {}) {
  constexpr const char* function = "linear_attention_backward";
  detail::check_attention_shapes(function, q, k, v);
  const auto check_shape = [&](const char* name, const auto& x, const auto& like, Index dim,
                               const char* legend) {
    if (x.batch != like.batch || x.heads != like.heads || x.length != like.length || x.dim != dim) {
      detail::throw_invalid_argument(
          function,
          std::string(name) + " is " + detail::shape_string({x.batch, x.heads, x.length, x.dim}) +
              " but must be " + detail::shape_string({like.batch, like.heads, like.length, dim}) +
              " " + legend);
    }
  };
  check_shape("dout", dout, q, v.dim, "(B, Hq, Lq, Dv)");
  check_shape("dq", dq, q, q.dim, "(B, Hq, Lq, D), the shape of q");
  check_shape("dk", dk, k, k.dim, "(B, Hkv, Lk, D), the shape of k");
  check_shape("dv", dv, v, v.dim, "(B, Hkv, Lk, Dv), the shape of v");
  detail::check_linear_options(function, options, q, k);
  const FeatureMap<T>& map = options.feature_map;
  if (!map.has_derivative()) {
    detail::throw_invalid_argument(function,
                                   "the custom feature map has no derivative: build it with "
                                   "FeatureMap::custom(function, vjp, features)");
  }
  detail::check_gradient_aliasing<T>(function, {{"q", q}, {"k", k}, {"v", v}, {"dout", dout}},
                                     {{"dq", HeadsView<const T>(dq)},
                                      {"dk", HeadsView<const T>(dk)},
                                      {"dv", HeadsView<const T>(dv)}});

  const Index features = map.features(q.dim);
  const LinearPlan plan = detail::plan_linear_call(function, q, k, v, options, true);
  const Index chunk = plan.chunk;
  const bool causal = plan.causal;
  const Index group = k.heads == 0 ? 1 : q.heads / k.heads;
  const auto make_workspace = [&] {  // one per thread
    detail::LinearBackwardWorkspace<T> ws;
    ws.reserve(chunk, features, v.dim, causal, group * q.length);
    return ws;
  };
  detail::for_each_kv_head(
      k, options, plan, make_workspace,
      [&](Index b, Index g, Index key_length, detail::LinearBackwardWorkspace<T>& ws) {
        detail::linear_backward_kv_head(q, k, v, dout, dq, dk, dv, map, b, g, group, key_length,
                                        options.causal, chunk, options.eps, ws);
      });
}

/// The backward of the batched linear_attention on rank-4 row-major tensors or maps:
/// {dq (B, Hq, Lq, D), dk (B, Hkv, Lk, D), dv (B, Hkv, Lk, Dv)}.
template <class TQ, class TK, class TV, class TO,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV> && detail::is_rank4_tensor_v<TO>>>
LinearAttentionGradients<Tensor<detail::rank4_scalar_t<TQ>, 4>> linear_attention_backward(
    const TQ& q,     // (B, Hq, Lq, D)
    const TK& k,     // (B, Hkv, Lk, D)
    const TV& v,     // (B, Hkv, Lk, Dv)
    const TO& dout,  // (B, Hq, Lq, Dv)
    const LinearAttentionOptions<detail::rank4_scalar_t<TQ>>& options = {}) {
  using T = detail::rank4_scalar_t<TQ>;
  static_assert(std::is_same_v<T, detail::rank4_scalar_t<TK>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TV>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TO>>,
                "linear_attention_backward: q, k, v and dout must have the same scalar type");
  const HeadsView<const T> qv = detail::as_heads_view(q), kv = detail::as_heads_view(k),
                           vv = detail::as_heads_view(v), ov = detail::as_heads_view(dout);
  detail::check_attention_shapes("linear_attention_backward", qv, kv, vv);
  LinearAttentionGradients<Tensor<T, 4>> grads;
  grads.dq.resize(qv.batch, qv.heads, qv.length, qv.dim);
  grads.dk.resize(kv.batch, kv.heads, kv.length, kv.dim);
  grads.dv.resize(vv.batch, vv.heads, vv.length, vv.dim);
  linear_attention_backward_into<T>(qv, kv, vv, ov, bhld_view(grads.dq), bhld_view(grads.dk),
                                    bhld_view(grads.dv), options);
  return grads;
}

/// One head: q (Lq, D), k (Lk, D), v (Lk, Dv), dout (Lq, Dv) -> {dq (Lq, D), dk (Lk, D),
/// dv (Lk, Dv)}. Any Eigen matrix expression; key_lengths, if given, has one entry.
template <class DQ, class DK, class DV, class DO>
LinearAttentionGradients<Matrix<typename DQ::Scalar>> linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q,     // (Lq, D)
    const Eigen::MatrixBase<DK>& k,     // (Lk, D)
    const Eigen::MatrixBase<DV>& v,     // (Lk, Dv)
    const Eigen::MatrixBase<DO>& dout,  // (Lq, Dv)
    const LinearAttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  static_assert(std::is_same_v<T, typename DK::Scalar> && std::is_same_v<T, typename DV::Scalar> &&
                    std::is_same_v<T, typename DO::Scalar>,
                "linear_attention_backward: q, k, v and dout must have the same scalar type");
  using RowMajorRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
  const RowMajorRef qr(q), kr(k), vr(v), orr(dout);
  const auto view = [](const RowMajorRef& m) {
    return HeadsView<const T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride()};
  };
  const auto out_view = [](Matrix<T>& m) {
    return HeadsView<T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.cols()};
  };
  const HeadsView<const T> qv = view(qr), kv = view(kr), vv = view(vr), ov = view(orr);
  detail::check_attention_shapes("linear_attention_backward", qv, kv, vv);
  LinearAttentionGradients<Matrix<T>> grads{Matrix<T>(qr.rows(), qr.cols()),
                                            Matrix<T>(kr.rows(), kr.cols()),
                                            Matrix<T>(vr.rows(), vr.cols())};
  linear_attention_backward_into<T>(qv, kv, vv, ov, out_view(grads.dq), out_view(grads.dk),
                                    out_view(grads.dv), options);
  return grads;
}

}  // namespace attn
