// attn/kernels/simd/tile_products.inl: the tile products of the flash kernel and the widening
// of 16-bit rows, written once on the vector primitives of the namespace that includes this file
// (simd/avx2.hpp, simd/avx512.hpp: vec, lanes, load, store, fmadd, exp_shifted, the block
// sizes, ...). No include guard and no #include: simd/tile_products.hpp includes it once per
// vector instruction set (simd/foreach_isa.hpp), inside attn::detail::avx2 and ::avx512
// within their target regions.
//
// Flash keeps the queries of a tile along the vector lanes (kernels/online_softmax.inl):
//
//   qt   (D, W)    scale * q tile^T, W = the query tile rounded up to whole vectors
//   st   (Bk, W)   scores^T, then probabilities^T, of one key tile
//   ot   (Dv, W)   unnormalised output^T
//   k    (Bk, D)   read in place, not transposed, not packed: each k[j, d] is broadcast
//   v    (Bk, Dv)  read in place, each v[j, e] broadcast the same way
//
// so st = k qt and ot += v^T st are products whose vector operand is a row of qt or st and
// whose scalar operand is one element of a k or v row; the softmax reduces over keys, down
// the columns of st, as elementwise max/add of vectors of queries.
//
// Decode's products (queries on the rows) are in decode_products.inl, the backward's in
// backward_products.inl.
//
// exp_shifted (in the primitives) computes exp(d), d = x - shift <= 0: n = round(d log2 e),
// r = d - n ln 2 in two parts (Cody-Waite, so r is exact to float precision), exp(d) =
// 2^n p(r) with p the degree-6 minimax polynomial of exp on |r| <= ln(2)/2 (relative error
// 1.9e-9); 13 vector operations per vector. Results below the smallest normal float (d <
// -87, and -inf) are exactly 0: producing a subnormal costs a microcode assist of about 150
// cycles per vector on Intel cores, and a probability below 1.2e-38 beside the row's
// maximum of 1 changes nothing. NaN stays NaN.

/// Query columns are padded to whole vectors.
inline Index padded(Index n) {
  return (n + lanes - 1) / lanes * lanes;
}

// --- Flash: queries along the lanes -----------------------------------------------------

/// qt[d, 0:width) = scale * q[0:rows, d], zeros in columns [rows, width).
inline void pack_queries(const float* q, Index q_stride,  // (rows, D)
                         Index rows, Index dim, float scale, float* qt, Index qt_stride,
                         Index width) {  // (D, width)
  const vec scale_vector = set1(scale);
  Index r0 = 0;
  if (q_stride <= (Index{1} << 26)) {  // 32-bit gather offsets
    for (; r0 + lanes <= rows; r0 += lanes) {
      const float* column = q + r0 * q_stride;
      for (Index d = 0; d < dim; ++d)
        store(qt + d * qt_stride + r0, mul(gather_strided(column + d, q_stride), scale_vector));
    }
  }
  for (Index d = 0; d < dim; ++d) {
    for (Index r = r0; r < rows; ++r)
      qt[d * qt_stride + r] = scale * q[r * q_stride + d];
    std::fill(qt + d * qt_stride + rows, qt + d * qt_stride + width, 0.0f);
  }
}

/// The elementwise max of x[0], ..., x[N - 1], as a balanced tree (depth log2 N): R - 1
/// dependent maxes in a chain are a large share of a scores call at D = 64.
template <std::size_t N>
inline vec max_tree(const vec* x) {
  if constexpr (N == 1)
    return x[0];
  else
    return maximum(max_tree<N / 2>(x), max_tree<N - N / 2>(x + N / 2));
}

/// column_max[0:C lanes) = max(column_max, max_r block[r][:]): the column maxima of an (R x C
/// vectors) block of scores while it is still in registers (the products on bf16 and int8
/// dot products use it too).
template <std::size_t R, std::size_t C>
inline void update_column_max(const vec (&block)[R][C], float* column_max) {
#pragma GCC unroll 4
  for (std::size_t c = 0; c < C; ++c) {
    vec column[R];
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r)
      column[r] = block[r][c];
    float* running = column_max + lanes * static_cast<Index>(c);
    store(running, maximum(max_tree<R>(column), load(running)));
  }
}

/// st[r, 0:C lanes) = sum_d k[r, d] * qt[d, 0:C lanes) for r < R: an (R x C vectors) register
/// block (`accumulating`: st[r, :] += that sum, in the same order; `k_transposed`: k[r, d] is
/// read at k[d * k_stride + r], a column of a row-major (D, R) block). With `column_max`, also
/// column_max = max(column_max, max_r st[r, :]) while the block is still in registers.
template <std::size_t R, std::size_t C, bool accumulating = false, bool k_transposed = false>
inline void scores_block(const float* k, Index k_stride,    // (R, D) rows of k
                         const float* qt, Index qt_stride,  // (D, C lanes) columns of qt
                         Index dim, float* st, Index st_stride,
                         float* column_max) {  // (C lanes) or null
  vec acc[R][C];
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      acc[r][c] = accumulating
                      ? load(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c))
                      : zero();
    }
  }
  // unrolled by 4: at D = 64 a call is only ~800 cycles, so its loop overhead and exit count
#pragma GCC unroll 4
  for (Index d = 0; d < dim; ++d) {
    vec q[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      q[c] = load(qt + d * qt_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const vec key = set1(k_transposed ? k[d * k_stride + static_cast<Index>(r)]
                                        : k[static_cast<Index>(r) * k_stride + d]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = fmadd(key, q[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      store(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c), acc[r][c]);
  }
  if (column_max != nullptr)
    update_column_max(acc, column_max);
}

/// scores_block for `rows` (1 .. R) keys.
template <std::size_t C, std::size_t R = static_cast<std::size_t>(score_rows),
          bool accumulating = false, bool k_transposed = false>
inline void scores_rows(Index rows, const float* k, Index k_stride, const float* qt,
                        Index qt_stride, Index dim, float* st, Index st_stride, float* column_max) {
  if constexpr (R > 0) {
    if (rows == static_cast<Index>(R)) {
      return scores_block<R, C, accumulating, k_transposed>(k, k_stride, qt, qt_stride, dim, st,
                                                            st_stride, column_max);
    }
    scores_rows<C, R - 1, accumulating, k_transposed>(rows, k, k_stride, qt, qt_stride, dim, st,
                                                      st_stride, column_max);
  }
}

/// st[0:keys, 0:width) = k[0:keys] qt; with `column_max`, column_max[0:width) = the column
/// maxima of st (computed while the blocks are in registers).
inline void scores(const float* k, Index k_stride,  // (keys, D)
                   Index keys, const float* qt,     // (D, width)
                   Index qt_stride, Index dim, Index width, float* st,
                   Index st_stride,      // (keys, width)
                   float* column_max) {  // (width) or null
  if (column_max != nullptr)
    std::fill(column_max, column_max + width, -std::numeric_limits<float>::infinity());
  constexpr Index block_width = score_vectors * lanes;
  for (Index j = 0; j < keys; j += score_rows) {
    const Index rows = std::min(score_rows, keys - j);
    const float* k_rows = k + j * k_stride;
    float* st_rows = st + j * st_stride;
    Index c0 = 0;
    for (; c0 + block_width <= width; c0 += block_width) {
      scores_rows<static_cast<std::size_t>(score_vectors)>(
          rows, k_rows, k_stride, qt + c0, qt_stride, dim, st_rows + c0, st_stride,
          column_max != nullptr ? column_max + c0 : nullptr);
    }
    for (; c0 < width; c0 += lanes) {
      scores_rows<1>(rows, k_rows, k_stride, qt + c0, qt_stride, dim, st_rows + c0, st_stride,
                     column_max != nullptr ? column_max + c0 : nullptr);
    }
  }
}

/// column_max[0:width) = the column maxima of st[0:keys, 0:width), four chains per vector so
/// that the max latency overlaps.
inline void column_maxima(const float* st, Index st_stride, Index keys, Index width,
                          float* column_max) {
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    vec m[4];
    for (vec& x : m)
      x = set1(-std::numeric_limits<float>::infinity());
    const float* column = st + c0;
    Index j = 0;
    for (; j + 4 <= keys; j += 4) {
#pragma GCC unroll 4
      for (std::size_t u = 0; u < 4; ++u)
        m[u] = maximum(load(column + (j + static_cast<Index>(u)) * st_stride), m[u]);
    }
    for (; j < keys; ++j)
      m[0] = maximum(load(column + j * st_stride), m[0]);
    store(column_max + c0, maximum(maximum(m[0], m[1]), maximum(m[2], m[3])));
  }
}

/// st[j, c] = -inf for every key j outside [lo[c], hi[c]) (tile-relative): the causal limit,
/// the window and the key length, a vector of queries at a time; and column_max = the column
/// maxima of the result, in the same pass.
inline void hide_outside_intervals(float* st, Index st_stride, Index keys,  // (keys, width)
                                   Index width, const std::int32_t* lo,
                                   const std::int32_t* hi,  // (width) each
                                   float* column_max) {     // (width)
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    const ivec first = load_indices(lo + c0);
    const ivec last = load_indices(hi + c0);
    vec m[2] = {set1(-std::numeric_limits<float>::infinity()),
                set1(-std::numeric_limits<float>::infinity())};
    for (Index j = 0; j < keys; ++j) {
      float* at = st + j * st_stride + c0;
      const vec score = hide_outside(load(at), static_cast<std::int32_t>(j), first, last);
      store(at, score);
      m[j & 1] = maximum(score, m[j & 1]);
    }
    store(column_max + c0, maximum(m[0], m[1]));
  }
}

/// st[j, c] = exp(st[j, c] - shift[c]) in place and sums[c] = sum_j st[j, c], for c < width.
inline void exp_columns(float* st, Index st_stride, Index keys, Index width,  // (keys, width)
                        const float* shift, float* sums) {                    // (width) each
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    const vec s = load(shift + c0);
    float* column = st + c0;
    vec sum0 = zero(), sum1 = zero();
    Index j = 0;
    for (; j + 1 < keys; j += 2) {  // two chains: the adds do not wait for each other
      const vec p0 = exp_shifted(load(column + j * st_stride), s);
      const vec p1 = exp_shifted(load(column + (j + 1) * st_stride), s);
      store(column + j * st_stride, p0);
      store(column + (j + 1) * st_stride, p1);
      sum0 = add(sum0, p0);
      sum1 = add(sum1, p1);
    }
    if (j < keys) {
      const vec p0 = exp_shifted(load(column + j * st_stride), s);
      store(column + j * st_stride, p0);
      sum0 = add(sum0, p0);
    }
    store(sums + c0, add(sum0, sum1));
  }
}

/// out[i] = exp(x[i] - shift[i]) for i < n (x[i] <= shift[i], or NaN).
inline void exp_difference(const float* x, const float* shift, float* out, Index n) {
  Index i = 0;
  for (; i + lanes <= n; i += lanes)
    store(out + i, exp_shifted(load(x + i), load(shift + i)));
  if (i < n)
    store_first(out + i, exp_shifted(load_first(x + i, n - i), load_first(shift + i, n - i)),
                n - i);
}

/// ot[e, 0:C lanes) = alpha * ot[e, :] + sum_j v[j, e] * pt[j, :] for e < R: an (R x C
/// vectors) register block of the transposed output. With `first`, the old ot is neither read
/// nor rescaled (it may be uninitialised); with alpha null, it is accumulated into as it is.
template <std::size_t R, std::size_t C>
inline void values_block(const float* pt, Index pt_stride,          // (keys, C lanes) of st
                         const float* v, Index v_stride,            // (keys, R) block of v
                         Index keys, const float* alpha,            // (C lanes) or null
                         bool first, float* ot, Index ot_stride) {  // (R, C lanes) of ot
  vec acc[R][C];
  if (first) {
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = zero();
    }
  } else {
    vec rescale[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      rescale[c] = alpha != nullptr ? load(alpha + lanes * static_cast<Index>(c)) : set1(1.0f);
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        const float* from = ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c);
        acc[r][c] = mul(rescale[c], load(from));
      }
    }
  }
#pragma GCC unroll 4  // as in scores_block
  for (Index j = 0; j < keys; ++j) {
    vec p[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      p[c] = load(pt + j * pt_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const vec value = set1(v[j * v_stride + static_cast<Index>(r)]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = fmadd(value, p[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      store(ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c), acc[r][c]);
  }
}

/// values_block for `rows` (1 .. R) value dims and `vectors` (1 .. C) vectors of queries.
template <std::size_t C = static_cast<std::size_t>(value_vectors),
          std::size_t R = static_cast<std::size_t>(value_rows)>
inline void values_rows(Index vectors, Index rows, const float* pt, Index pt_stride, const float* v,
                        Index v_stride, Index keys, const float* alpha, bool first, float* ot,
                        Index ot_stride) {
  if constexpr (C > 0 && R > 0) {
    if (vectors < static_cast<Index>(C)) {
      return values_rows<C - 1, R>(vectors, rows, pt, pt_stride, v, v_stride, keys, alpha, first,
                                   ot, ot_stride);
    }
    if (rows == static_cast<Index>(R))
      return values_block<R, C>(pt, pt_stride, v, v_stride, keys, alpha, first, ot, ot_stride);
    values_rows<C, R - 1>(vectors, rows, pt, pt_stride, v, v_stride, keys, alpha, first, ot,
                          ot_stride);
  }
}

/// Keys per pass of ot += v^T p over all the blocks of ot: the chunks of st (32 KiB at 128
/// queries) and of v (16 KiB at Dv = 64) stay near L1 while ot's blocks pass over them.
inline constexpr Index value_keys = 64;

/// ot[0:Dv, 0:width) = alpha * ot + v[0:keys]^T st[0:keys]; alpha null: ot = v^T st (the
/// row's first visible tile; the old ot is not read).
inline void accumulate(const float* st, Index st_stride, Index keys, Index width,  // (keys, width)
                       const float* v, Index v_stride, Index value_dim,            // (keys, Dv)
                       const float* alpha,                                         // (width)
                       float* ot, Index ot_stride) {                               // (Dv, width)
  constexpr Index block_width = value_vectors * lanes;
  for (Index c0 = 0; c0 < keys; c0 += value_keys) {
    const Index chunk = std::min(value_keys, keys - c0);
    const bool first = alpha == nullptr && c0 == 0;
    const float* pt = st + c0 * st_stride;
    const float* v_rows = v + c0 * v_stride;
    for (Index q0 = 0; q0 < width; q0 += block_width) {
      const Index vectors = std::min(value_vectors, (width - q0) / lanes);
      const float* rescale = c0 == 0 && alpha != nullptr ? alpha + q0 : nullptr;
      for (Index e = 0; e < value_dim; e += value_rows) {
        values_rows(vectors, std::min(value_rows, value_dim - e), pt + q0, st_stride, v_rows + e,
                    v_stride, chunk, rescale, first, ot + e * ot_stride + q0, ot_stride);
      }
    }
  }
}

// --- Widening ---------------------------------------------------------------------------

/// dst[0:n) = src[0:n) as float (exact for half and bfloat16).
template <class S>
inline void widen(const S* src, float* dst, Index n) {
  const Index vector_end = n / lanes * lanes;
  for (Index i = 0; i < vector_end; i += lanes)
    store(dst + i, load_widened(src + i));
  for (Index i = vector_end; i < n; ++i)
    dst[i] = static_cast<float>(src[i]);
}
