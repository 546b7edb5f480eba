// attn/kernels/flash_backward.inl: the tile loop of the flash backward, written once and
// compiled for every instruction set.
//
// No include guard and no #include: kernels/flash_backward.hpp includes this file inside
// namespace attn::detail::generic, attn::detail::avx2 and attn::detail::avx512 (in their
// target regions), after the forward's online_softmax.inl, whose tile products it uses
// (pack_queries, scores, hide_outside_intervals, exp_columns, accumulate, padded) with the
// queries of a tile along the vector lanes, as in the forward:
//
//   qt    (D, W)    scale * q tile^T        dot  (Dv, W)  dout tile^T
//   st    (Bk, W)   scores^T -> p^T         dpt  (Bk, W)  (dout v^T)^T -> scale * ds^T
//   dqt   (D, W)    dq tile^T, summed over the key tiles
//   dk, dv (Lk, D), (Lk, Dv)  the whole kv head's gradients, summed over query tiles and
//                             the query heads of the group
//
// For the rows i of a query tile and the keys j of a key tile (z = the masked, modified
// scores; lse and delta_i = dout_i . out_i saved or computed once per tile):
//   p_ij  = exp(z_ij - lse_i)                          the forward's probabilities
//   dv_j += sum_i p_ij dout_i
//   dp_ij = dout_i . v_j
//   ds_ij = p_ij (dp_ij - delta_i) * (1 - tanh^2(s_ij / cap))   (the factor with softcap)
//   dq_i += scale sum_j ds_ij k_j,   dk_j += scale sum_i ds_ij q_i

struct BackwardKernels {
  static constexpr Isa level = isa;

  static Index padded_width(Index rows) { return padded(rows); }

  /// The gradients from queries [i0, i0 + rows) of one (b, query head h) pair, whose rows of
  /// q, dout, lse and delta are given: dq of those rows written, dk and dv of the whole kv
  /// head accumulated. Key tiles the mask hides are skipped; visible ones skip the mask.
  ///   pass 1: qt = scale * q^T, dot = dout^T, shift = lse (0 where -inf: such rows see
  ///           only -inf scores), +inf in the padding columns (their p is 0)
  ///   pass 2: for each key tile [j0, j1) the mask does not hide:
  ///             st = k[j0:j1] qt, masked as in the forward; p^T = exp(st - shift)
  ///             dv[j0:j1] += p^T dout                                  (GEMM)
  ///             dpt = v[j0:j1] dot;  dpt = scale * p^T (dpt - delta) (* softcap factor)
  ///             dqt += k[j0:j1]^T dpt;  dk[j0:j1] += dpt q              (GEMM)
  ///   pass 3: dq = dqt^T (zeros when the rows see no key)
  template <class T>
  static void backward_tile(const HeadMatrix<const T>& q,     // (rows, D)  queries i0 ..
                            const HeadMatrix<const T>& dout,  // (rows, Dv)
                            const T* lse, const T* delta,     // (rows) each
                            const HeadMatrix<const T>& k,     // (Lk, D)    the whole kv head
                            const HeadMatrix<const T>& v,     // (Lk, Dv)
                            HeadMatrix<T> dq,                 // (rows, D)  written
                            HeadMatrix<T> dk,                 // (Lk, D)    accumulated
                            HeadMatrix<T> dv,                 // (Lk, Dv)   accumulated
                            const Mask<T>& mask, const std::optional<T>& softcap, Index b,
                            Index h, T scale, Index i0, Index key_tile,
                            BackwardWorkspace<T>& workspace) {
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    constexpr T plus_inf = std::numeric_limits<T>::infinity();
    const Index rows = q.rows(), i1 = i0 + rows, width = padded(rows);
    const Index dim = q.cols(), value_dim = dout.cols();
    const Index stride = width;  // as in the forward: the tile's own width
    ATTN_ASSERT(rows > 0 && width <= workspace.width && key_tile <= workspace.keys);
    T* dqt = workspace.dqt.data();
    bool first_tile = true;

    const auto [keys_first, keys_last] = mask.key_range(b, i0, i1);
    if (keys_first < keys_last) {
      T* qt = workspace.qt.data();
      T* dot = workspace.dot.data();
      T* st = workspace.st.data();
      T* dpt = workspace.dpt.data();
      T* shift = workspace.shift.data();
      T* deltas = workspace.delta.data();
      pack_queries(q.data(), q.outerStride(), rows, dim, scale, qt, stride, width);  // pass 1
      pack_queries(dout.data(), dout.outerStride(), rows, value_dim, T(1), dot, stride, width);
      for (Index r = 0; r < width; ++r) {
        shift[r] = r < rows ? (lse[r] == minus_inf ? T(0) : lse[r]) : plus_inf;
        deltas[r] = r < rows ? delta[r] : T(0);
      }
      std::fill_n(workspace.ones.data(), width, T(1));
      for (Index j0 = keys_first; j0 < keys_last; j0 += key_tile) {  // pass 2
        const Index j1 = std::min(j0 + key_tile, keys_last), cols = j1 - j0;
        const TileVisibility visibility = mask.classify(b, h, i0, i1, j0, j1);
        if (visibility == TileVisibility::hidden)
          continue;
        const bool masked = visibility == TileVisibility::partial || mask.modifies_scores();
        const T* k_tile = k.data() + j0 * k.outerStride();
        const T* v_tile = v.data() + j0 * v.outerStride();
        scores(k_tile, k.outerStride(), cols, qt, stride, dim, width, st, stride, static_cast<T*>(nullptr));
        if (softcap) {  // the raw scores, for the derivative of tanh
          std::copy_n(st, cols * stride, workspace.raw.data());
        }
        const bool elementwise = mask.has_keep_mask() || mask.modifies_scores() ||
                                 (mask.has_sink_tokens() && j0 < mask.sink_tokens());
        if (masked && elementwise) {
          Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>>
              scores_view(st, rows, cols, Eigen::OuterStride<>(stride));
          mask.apply(b, h, i0, j0, scores_view);
        } else if (masked) {
          std::int32_t* lo = workspace.key_lo.data();
          std::int32_t* hi = workspace.key_hi.data();
          for (Index r = 0; r < width; ++r) {
            const auto [first, last] =
                r < rows ? mask.key_interval(b, i0 + r) : std::array<Index, 2>{j0, j1};
            lo[r] = static_cast<std::int32_t>(std::clamp(first - j0, Index(0), cols));
            hi[r] = static_cast<std::int32_t>(std::clamp(last - j0, Index(0), cols));
          }
          hide_outside_intervals(st, stride, cols, width, lo, hi, workspace.tile_max.data());
        }
        exp_columns(st, stride, cols, width, shift, workspace.sums.data());  // p^T
        gemm(level, cols, value_dim, rows, st, stride, dout.data(), dout.outerStride(),
             dv.data() + j0 * dv.outerStride(), dv.outerStride(), static_cast<const T*>(nullptr), true, false);
        scores(v_tile, v.outerStride(), cols, dot, stride, value_dim, width, dpt, stride,
               static_cast<T*>(nullptr));
        for (Index j = 0; j < cols; ++j) {
          const T* p = st + j * stride;
          T* ds = dpt + j * stride;
          for (Index r = 0; r < width; ++r)
            ds[r] = scale * (p[r] * (ds[r] - deltas[r]));
        }
        if (softcap)
          apply_softcap_derivative(workspace.raw.data(), cols * stride, *softcap, dpt);
        accumulate(dpt, stride, cols, width, k_tile, k.outerStride(), dim,
                   first_tile ? nullptr : workspace.ones.data(), dqt, stride);
        gemm(level, cols, dim, rows, dpt, stride, q.data(), q.outerStride(),
             dk.data() + j0 * dk.outerStride(), dk.outerStride(), static_cast<const T*>(nullptr), true, false);
        first_tile = false;
      }
    }
    for (Index r = 0; r < rows; ++r) {  // pass 3
      T* row = dq.row(r).data();
      for (Index d = 0; d < dim; ++d)
        row[d] = first_tile ? T(0) : dqt[d * stride + r];
    }
  }

  /// ds[n] *= 1 - tanh^2(raw[n] / cap): the derivative of cap * tanh(s / cap).
  template <class T>
  static void apply_softcap_derivative(const T* raw, Index n, T cap, T* ds) {
    const T inverse = T(1) / cap;
    for (Index e = 0; e < n; ++e) {
      const T t = std::tanh(raw[e] * inverse);
      ds[e] *= T(1) - t * t;
    }
  }
};
