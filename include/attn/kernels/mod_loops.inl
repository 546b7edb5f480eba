// attn/kernels/mod_loops.inl: the loops that run a user's score_mod or mask_mod over a tile
// (attn/mods.hpp), included once per instruction set by attn/kernels/mod_loops.hpp.
// Do not include it directly.
//
// The callable is inlined here, so the loop vectorises when the callable can be vectorised
// (arithmetic, table look-ups along the tile's contiguous direction); ATTN_VECTORIZED_LOOP
// asks GCC for that in -O2 builds too, whose cheap cost model would not. The scores are
// restrict-qualified: a callable reads its own tables, never the tile (so the compiler may
// keep a per-head value such as an ALiBi slope in a register instead of reloading it after
// every store).

/// data[at] = f(data[at], b, h, q_idx, kv_idx) over the tile, the contiguous direction inside.
template <class F, class T>
ATTN_VECTORIZED_LOOP void score_tile(const void* callable, const ScoreTile<T>& t) {
  const F& f = *static_cast<const F*>(callable);
  T* data = t.data;
  const Index b = t.b, h = t.h, i0 = t.i0, j0 = t.j0;
  if (t.row_stride == 1 && t.col_stride != 1) {
    for (Index c = 0; c < t.cols; ++c) {
      T* __restrict column = data + c * t.col_stride;
      const Index kv_idx = j0 + c;
      for (Index r = 0; r < t.rows; ++r)
        column[r] = static_cast<T>(f(column[r], b, h, i0 + r, kv_idx));
    }
  } else {
    for (Index r = 0; r < t.rows; ++r) {
      T* __restrict row = data + r * t.row_stride;
      const Index q_idx = i0 + r;
      for (Index c = 0; c < t.cols; ++c)
        row[c * t.col_stride] = static_cast<T>(f(row[c * t.col_stride], b, h, q_idx, j0 + c));
    }
  }
}

/// data[at] = -inf where f(b, h, q_idx, kv_idx) is false.
template <class F, class T>
ATTN_VECTORIZED_LOOP void hide_tile(const void* callable, const ScoreTile<T>& t) {
  const F& f = *static_cast<const F*>(callable);
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  T* data = t.data;
  const Index b = t.b, h = t.h, i0 = t.i0, j0 = t.j0;
  if (t.row_stride == 1 && t.col_stride != 1) {
    for (Index c = 0; c < t.cols; ++c) {
      T* __restrict column = data + c * t.col_stride;
      const Index kv_idx = j0 + c;
      for (Index r = 0; r < t.rows; ++r)
        column[r] = f(b, h, i0 + r, kv_idx) ? column[r] : minus_inf;
    }
  } else {
    for (Index r = 0; r < t.rows; ++r) {
      T* __restrict row = data + r * t.row_stride;
      const Index q_idx = i0 + r;
      for (Index c = 0; c < t.cols; ++c)
        row[c * t.col_stride] = f(b, h, q_idx, j0 + c) ? row[c * t.col_stride] : minus_inf;
    }
  }
}

/// How many pairs of [i0, i1) x [j0, j1) f shows, or -1 as soon as the rows seen so far
/// hold both a shown and a hidden pair (the tile is partial whatever the rest holds).
template <class F>
ATTN_VECTORIZED_LOOP Index count_visible(const void* callable, Index b, Index h, Index i0, Index i1,
                                         Index j0, Index j1) {
  const F& f = *static_cast<const F*>(callable);
  Index visible = 0;
  for (Index i = i0; i < i1; ++i) {
    Index row = 0;
    for (Index j = j0; j < j1; ++j)
      row += f(b, h, i, j) ? 1 : 0;
    visible += row;
    if (visible != 0 && visible != (i - i0 + 1) * (j1 - j0))
      return -1;
  }
  return visible;
}
