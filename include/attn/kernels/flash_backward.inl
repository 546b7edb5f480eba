// attn/kernels/flash_backward.inl: the key-tile loop of the flash backward (FlashAttention-2's
// order: a key tile outside, the query tiles that see it inside), written once and compiled
// for every instruction set.
//
// No include guard and no #include: kernels/backward_tiles.hpp includes this file once per
// instruction set (simd/foreach_isa.hpp), inside attn::detail::generic, ::avx2 and ::avx512.
// Its entry point, backward_key_tile, is listed in each namespace's table (simd/table.inl). It uses
// that namespace's tile products (pack_queries, scores, exp_rows, add_product, score_gradient_row,
// dropout_row, softcap_derivative, padded), here with the keys of a tile along the vector lanes and
// the queries on the rows:
//
//   kt, vt    (D, W), (Dv, W)   scale * k tile^T and v tile^T, packed once per key tile
//   k         (W, D)            the key tile's rows, copied once per key tile
//   s         (Bq, W)           scores -> p of one query tile
//   dp        (Bq, W)           dout v^T -> scale * ds
//   q, dout   (Bq, D), (Bq, Dv) the query tile's rows, copied (not transposed: each element
//                               is broadcast)
//   dk, dv    the key tile's rows, summed in place over the query tiles and the query heads
//             of the group
// (every row of these tiles backward_row_padding elements longer than it needs)
//
// so that every product is the forward's scores register block (scores_block):
//   s = q kt,  dp = dout vt              (scores: a row of q times the rows of kt)
//   dq += ds k                           (add_product: the rows of ds weight the rows of k)
//   dv += (p f)^T dout,  dk += ds^T q    (add_product, the columns of p and ds as weights)
// For the rows i of a query tile and the keys j of the key tile (z = the masked, modified
// scores; lse_i saved by the forward, delta_i = dout_i . out_i):
//   p_ij  = exp(z_ij - lse_i)
//   ds_ij = p_ij (f_ij dout_i . v_j - delta_i) * (1 - tanh^2(s_ij / cap))   (softcap's factor)
//   dv_j += sum_i f_ij p_ij dout_i,   f_ij = the dropout's factor (attn/dropout.hpp), else 1
//  dk_j += scale sum_i ds_ij q_i,  dq_i += scale sum_j ds_ij k_j

/// Row i of m, or null for an empty matrix (no arithmetic on a null pointer).
template <class Map>  // a HeadMatrix, by value: its data() keeps the map's constness
inline auto row_of(Map m, Index i) -> decltype(m.data()) {
  return m.data() == nullptr ? nullptr : m.data() + i * m.outerStride();
}

/// Hides what the mask hides in the scores s (rows, width) of queries [i0, i0 + rows) and
/// keys [j0, j0 + keys), and the padding columns [keys, width); applies softcap, ALiBi and
/// the bias, as the forward does.
template <class T>
inline void mask_backward_scores(const AttentionProblem<T>& problem, TileVisibility visibility,
                                 Index b, Index h, Index i0, Index rows, Index j0, Index keys,
                                 Index width, T* s, Index stride) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const bool masked = visibility == TileVisibility::partial || problem.modifies_scores();
  const bool elementwise = problem.mask().has_elementwise_mask() || problem.modifies_scores() ||
                           (problem.mask().has_sink_tokens() && j0 < problem.mask().sink_tokens());
  if (masked && elementwise) {
    Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> view(s, rows, keys,
                                                        Eigen::OuterStride<>(stride));
    problem.apply(b, h, i0, j0, view, visibility);
  } else if (masked) {  // one interval per row
    for (Index r = 0; r < rows; ++r) {
      const auto [first, last] = problem.mask().key_interval(b, i0 + r);
      const Index lo = std::clamp(first - j0, Index(0), keys);
      const Index hi = std::clamp(last - j0, lo, keys);
      T* row = s + r * stride;
      std::fill(row, row + lo, minus_inf);
      std::fill(row + hi, row + keys, minus_inf);
    }
  }
  if (width > keys) {
    for (Index r = 0; r < rows; ++r)
      std::fill(s + r * stride + keys, s + r * stride + width, minus_inf);
  }
}

/// The gradients through keys [j0, j0 + keys) of one (b, kv head): dk and dv of those keys
/// written, the dq of every query of the `group` query heads that sees them accumulated.
/// `heads` gives, for query head g of the group, its q, dout, lse, delta and dq (all rows).
///   pass 1: the k tile copied, kt = scale * k tile^T, vt = v tile^T
///   pass 2: for each query head of the group, each query tile [i0, i1) the mask does not
///           hide on this key tile:
///             s = q kt, masked as in the forward (and -inf in the padding columns);
///             p = exp(s - lse) (a row whose lse is -inf sees only -inf scores: shift 0)
///             dv += (p f)^T dout   (f: the dropout's factors, regenerated; 1 without)
///             dp = dout vt;  ds = scale * p (f dp - delta) (* the softcap factor)
///             dk += ds^T q;  dq += ds k
///   dk and dv of the tile start at zero (and stay zero if no query sees the tile).
template <class T>
void backward_key_tile(const HeadMatrix<const T>& k,  // (Lk, D)   the whole kv head
                       const HeadMatrix<const T>& v,  // (Lk, Dv)
                       HeadMatrix<T> dk,              // (Lk, D)   rows j0.. written
                       HeadMatrix<T> dv,              // (Lk, Dv)
                       const BackwardHead<T>* heads, Index group,
                       const AttentionProblem<T>& problem, const std::optional<T>& softcap, Index b,
                       Index kv_head, T scale, Index j0, Index keys, Index query_tile,
                       BackwardWorkspace<T>& workspace) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const Index j1 = j0 + keys, width = padded(keys), stride = workspace.stride;
  const Index dim = k.cols(), value_dim = v.cols();
  const Index k_stride = dim + backward_row_padding, q_stride = k_stride;
  const Index dout_stride = value_dim + backward_row_padding;
  ATTN_ASSERT(keys > 0 && width <= workspace.width && query_tile <= workspace.rows);
  T* kt = workspace.kt.data();
  T* vt = workspace.vt.data();
  T* s = workspace.s.data();
  T* dp = workspace.dp.data();
  T* shift = workspace.shift.data();
  T* k_tile = workspace.k.data();
  T* q_rows = workspace.q.data();
  T* dout_rows = workspace.dout.data();
  T* dk_tile = row_of(dk, j0);
  T* dv_tile = row_of(dv, j0);
  copy_rows(row_of(k, j0), k.outerStride(), keys, dim, k_tile, k_stride);  // pass 1
  pack_queries(k_tile, k_stride, keys, dim, scale, kt, stride, width);
  pack_queries(row_of(v, j0), v.outerStride(), keys, value_dim, T(1), vt, stride, width);
  dk.middleRows(j0, keys).setZero();
  dv.middleRows(j0, keys).setZero();
  for (Index g = 0; g < group; ++g) {  // pass 2
    const Index h = kv_head * group + g;
    const BackwardHead<T> head = heads[g];  // the maps, by value
    const Index rows_of_head = head.q.rows();
    for (Index i0 = 0; i0 < rows_of_head; i0 += query_tile) {
      const Index rows = std::min(query_tile, rows_of_head - i0), i1 = i0 + rows;
      const TileVisibility visibility = problem.mask().classify(b, h, i0, i1, j0, j1);
      if (visibility == TileVisibility::hidden)
        continue;
      copy_rows(row_of(head.q, i0), head.q.outerStride(), rows, dim, q_rows, q_stride);
      copy_rows(row_of(head.dout, i0), head.dout.outerStride(), rows, value_dim, dout_rows,
                dout_stride);
      scores(q_rows, q_stride, rows, kt, stride, dim, width, s, stride, static_cast<T*>(nullptr));
      if (softcap) {  // the raw scores, for the derivative of tanh (not the rows' padding)
        for (Index r = 0; r < rows; ++r)
          std::copy_n(s + r * stride, width, workspace.raw.data() + r * stride);
      }
      mask_backward_scores(problem, visibility, b, h, i0, rows, j0, keys, width, s, stride);
      for (Index r = 0; r < rows; ++r) {
        const T lse = head.lse[i0 + r];
        shift[r] = lse == minus_inf ? T(0) : lse;
      }
      exp_rows(s, stride, rows, width, shift, workspace.sums.data());  // p
      const Dropout<T>& dropout = problem.dropout();
      if (dropout.active()) {  // f: the forward's dropout factors, regenerated; dv takes p f
        for (Index r = 0; r < rows; ++r) {
          dropout_row(dropout, dropout.row_key(b, h, i0 + r), j0, keys, width, s + r * stride,
                      workspace.drop.data() + r * stride, dp + r * stride);
        }
      }
      // a_transposed: the keys are the rows of the product and the query rows its depth
      // NOLINTNEXTLINE(readability-suspicious-call-argument)
      add_product<true>(dropout.active() ? dp : s, stride, keys, dout_rows, dout_stride, rows,
                        value_dim, dv_tile, dv.outerStride());
      if (value_dim > 0) {
        scores(dout_rows, dout_stride, rows, vt, stride, value_dim, width, dp, stride,
               static_cast<T*>(nullptr));
      } else {  // Dv = 0: dp is 0 (and vt an empty buffer)
        std::fill_n(dp, rows * stride, T(0));
      }
      for (Index r = 0; r < rows; ++r) {  // ds = scale p (f dp - delta)
        score_gradient_row(s + r * stride,
                           dropout.active() ? workspace.drop.data() + r * stride : nullptr,
                           head.delta[i0 + r], scale, width, dp + r * stride);
      }
      if (softcap) {
        for (Index r = 0; r < rows; ++r)
          softcap_derivative(workspace.raw.data() + r * stride, width, *softcap, dp + r * stride);
      }
      // NOLINTNEXTLINE(readability-suspicious-call-argument): transposed, as for dv
      add_product<true>(dp, stride, keys, q_rows, q_stride, rows, dim, dk_tile, dk.outerStride());
      add_product(dp, stride, rows, k_tile, k_stride, keys, dim, row_of(head.dq, i0),
                  head.dq.outerStride());
    }
  }
}
