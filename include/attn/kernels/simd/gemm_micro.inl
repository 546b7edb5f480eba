// attn/kernels/simd/gemm_micro.inl: the register-blocked micro-kernel of the float GEMM and
// its packing, written once on the vector primitives of the namespace that includes this
// file (simd/avx2.hpp, simd/avx512.hpp). No include guard and no #include: simd/tile_products.hpp
// includes it once per vector instruction set (simd/foreach_isa.hpp), inside
// attn::detail::avx2 and ::avx512 within their target regions.
// kernels/gemm.hpp does the cache blocking and the threads; the interface is pointers and
// scalars only.
//
// c (M, N) = a (M, K) b (K, N), row-major. A register block of c is mr = gemm_rows rows by
// nr = gemm_vectors * lanes columns: step k loads nr floats of row k of b (gemm_vectors
// vectors) and broadcasts mr scalars of column k of a, mr * gemm_vectors FMAs. Packed
// operands (both zero-padded to whole panels, so every block computes a full mr x nr tile):
//
//   ap   panels of (depth, mr)   a's rows transposed: step k reads mr consecutive scalars
//   bp   panels of (depth, nr)   b's rows cut into nr-wide strips: step k reads nr floats
//
// Every element of c is one chain of FMAs in order of k, started from 0 or from c (when
// `load_c`: a previous depth block's partial sum, or the caller's c), with the bias added
// after the last step. An edge tile runs the same chain on a copy on the stack, so its bits
// do not depend on where the tile boundaries fall. rows_unpacked runs the same
// chain on a and b as they lie, one row of c at a time (no packing, for products of a few
// rows): their bits are the packed path's too.

struct Gemm {
  static constexpr bool packed = true;                    // kernels/gemm.hpp: gemm_of
  static constexpr Index rows = gemm_rows;                // mr
  static constexpr Index columns = gemm_vectors * lanes;  // nr
  /// Cache blocks (kernels/gemm.hpp): the most of the depth (kc), of the rows of a packed at
  /// once (mc, a multiple of mr) and of the columns of b packed at once (nc).
  static constexpr Index block_depth = 256;
  static constexpr Index block_rows = gemm_block_rows;
  static constexpr Index block_columns = 4096;

  /// Panels of `rows` rows of a (count, depth): ap[p * mr * depth + k * mr + r] =
  /// a[p * mr + r, k], zeros past `count`.
  static void pack_a(const float* a, Index lda, Index count, Index depth, float* ap) {
    for (Index r0 = 0; r0 < count; r0 += rows) {
      const Index height = std::min(rows, count - r0);
      float* panel = ap + r0 * depth;
      if (height == rows) {
        // row by row: each row is read once, contiguously; the writes stay in L1
        for (Index r = 0; r < rows; ++r) {
          const float* row = a + (r0 + r) * lda;
          for (Index k = 0; k < depth; ++k)
            panel[k * rows + r] = row[k];
        }
      } else {
        for (Index k = 0; k < depth; ++k) {
          for (Index r = 0; r < rows; ++r)
            panel[k * rows + r] = r < height ? a[(r0 + r) * lda + k] : 0.0f;
        }
      }
    }
  }

  /// Panels of `columns` columns of b (depth, count): bp[q * nr * depth + k * nr + c] =
  /// b[k, q * nr + c], zeros past `count`.
  static void pack_b(const float* b, Index ldb, Index depth, Index count, float* bp) {
    for (Index c0 = 0; c0 < count; c0 += columns) {
      const Index width = std::min(columns, count - c0);
      float* panel = bp + c0 * depth;
      if (width == columns) {
        for (Index k = 0; k < depth; ++k) {
#pragma GCC unroll 4
          for (Index v = 0; v < gemm_vectors; ++v)
            store(panel + k * columns + v * lanes, load(b + k * ldb + c0 + v * lanes));
        }
      } else {
        for (Index k = 0; k < depth; ++k) {
          const float* row = b + k * ldb + c0;
          for (Index v = 0; v < gemm_vectors; ++v) {
            const Index left = width - v * lanes;  // columns of this vector that exist
            const vec x = left >= lanes ? load(row + v * lanes)
                          : left > 0    ? load_first(row + v * lanes, left)
                                        : zero();
            store(panel + k * columns + v * lanes, x);
          }
        }
      }
    }
  }

  /// c[0:mr, 0:nr) = (load_c ? c : 0) + sum_k ap[k, :]^T bp[k, :] (+ bias[0:nr)), in
  /// registers. (Nothing but the chain in the loop: a branch to a tail path makes the
  /// compilers keep accumulators on the stack.)
  static void tile(Index depth, const float* ap, const float* bp, float* c, Index ldc, bool load_c,
                   const float* bias) {
    constexpr auto R = static_cast<std::size_t>(rows);
    constexpr auto V = static_cast<std::size_t>(gemm_vectors);
    vec acc[R][V];
    if (load_c) {
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (std::size_t v = 0; v < V; ++v)
          acc[r][v] = load(c + static_cast<Index>(r) * ldc + lanes * static_cast<Index>(v));
      }
    } else {
#pragma GCC unroll 16
      for (vec(&row)[V] : acc) {
#pragma GCC unroll 4
        for (vec& a : row)
          a = zero();
      }
    }
#pragma GCC unroll 2
    for (Index k = 0; k < depth; ++k) {
      vec x[V];
#pragma GCC unroll 4
      for (std::size_t v = 0; v < V; ++v)
        x[v] = load(bp + k * columns + lanes * static_cast<Index>(v));
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
        const vec y = set1(ap[k * rows + static_cast<Index>(r)]);
#pragma GCC unroll 4
        for (std::size_t v = 0; v < V; ++v)
          acc[r][v] = fmadd(y, x[v], acc[r][v]);
      }
    }
    if (bias != nullptr) {
#pragma GCC unroll 4
      for (std::size_t v = 0; v < V; ++v) {
        const vec b = load(bias + lanes * static_cast<Index>(v));
#pragma GCC unroll 16
        for (vec(&row)[V] : acc)
          row[v] = add(row[v], b);
      }
    }
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t v = 0; v < V; ++v)
        store(c + static_cast<Index>(r) * ldc + lanes * static_cast<Index>(v), acc[r][v]);
    }
  }

  /// y[0:count * lanes) = (load_c ? y : 0) + x b (+ bias) for one row x (depth) of a and
  /// `count` whole vectors of columns of b (depth rows ldb apart), unpacked: tile()'s chain.
  /// `count` vectors in flight hide the FMA latency that one would expose.
  template <Index count>
  static void row_vectors(Index depth, const float* x, const float* b, Index ldb, float* y,
                          const float* bias, bool load_c) {
    constexpr auto V = static_cast<std::size_t>(count);
    vec acc[V];
#pragma GCC unroll 8
    for (std::size_t v = 0; v < V; ++v)
      acc[v] = load_c ? load(y + lanes * static_cast<Index>(v)) : zero();
    for (Index k = 0; k < depth; ++k) {
      const vec s = set1(x[k]);
#pragma GCC unroll 8
      for (std::size_t v = 0; v < V; ++v)
        acc[v] = fmadd(s, load(b + k * ldb + lanes * static_cast<Index>(v)), acc[v]);
    }
#pragma GCC unroll 8
    for (std::size_t v = 0; v < V; ++v) {
      const Index at = lanes * static_cast<Index>(v);
      store(y + at, bias != nullptr ? add(acc[v], load(bias + at)) : acc[v]);
    }
  }

  /// row_vectors for the last `width` < lanes columns: masked loads and stores.
  static void row_tail(Index depth, const float* x, const float* b, Index ldb, float* y,
                       const float* bias, bool load_c, Index width) {
    vec acc = load_c ? load_first(y, width) : zero();
    for (Index k = 0; k < depth; ++k)
      acc = fmadd(set1(x[k]), load_first(b + k * ldb, width), acc);
    store_first(y, bias != nullptr ? add(acc, load_first(bias, width)) : acc, width);
  }

  /// c[0:count_m, 0:count_n) = (load_c ? c : 0) + a b (+ bias) on a and b as they lie, row by
  /// row of c: for fewer rows than a register block, where packing b (and computing a whole
  /// block of mr rows) costs more than the product. The same bits as block() on packed
  /// panels (kernels/gemm.hpp chooses).
  static void rows_unpacked(Index count_m, Index count_n, Index depth, const float* a, Index lda,
                            const float* b, Index ldb, float* c, Index ldc, const float* bias,
                            bool load_c) {
    constexpr Index wide = 8;  // vectors in flight
    for (Index i = 0; i < count_m; ++i) {
      const float* x = a + i * lda;
      float* y = c + i * ldc;
      Index j = 0;
      const auto at = [&](const float* p) { return p == nullptr ? p : p + j; };
      for (; j + wide * lanes <= count_n; j += wide * lanes)
        row_vectors<wide>(depth, x, b + j, ldb, y + j, at(bias), load_c);
      for (; j + lanes <= count_n; j += lanes)
        row_vectors<1>(depth, x, b + j, ldb, y + j, at(bias), load_c);
      if (j < count_n)
        row_tail(depth, x, b + j, ldb, y + j, at(bias), load_c, count_n - j);
    }
  }

  /// c[0:count_m, 0:count_n) = (load_c ? c : 0) + ap bp (+ bias) over packed panels of a
  /// (count_m rows) and b (count_n columns), all of depth `depth`. For each panel of b, the
  /// panels of a pass under it (the b panel is reused from L1/L2, the a block from L2).
  static void block(Index count_m, Index count_n, Index depth, const float* ap, const float* bp,
                    float* c, Index ldc, bool load_c, const float* bias) {
    alignas(64) float edge[rows * columns];
    alignas(64) float edge_bias[columns];
    for (Index j = 0; j < count_n; j += columns) {
      const Index width = std::min(columns, count_n - j);
      const float* b_panel = bp + j * depth;
      if (bias != nullptr && width < columns) {
        std::fill(edge_bias, edge_bias + columns, 0.0f);
        std::copy(bias + j, bias + j + width, edge_bias);
      }
      const float* panel_bias = bias == nullptr ? nullptr : width < columns ? edge_bias : bias + j;
      for (Index i = 0; i < count_m; i += rows) {
        const Index height = std::min(rows, count_m - i);
        float* c_tile = c + i * ldc + j;
        if (height == rows && width == columns) {
          tile(depth, ap + i * depth, b_panel, c_tile, ldc, load_c, panel_bias);
          continue;
        }
        if (load_c) {
          std::fill(edge, edge + rows * columns, 0.0f);
          for (Index r = 0; r < height; ++r)
            std::copy(c_tile + r * ldc, c_tile + r * ldc + width, edge + r * columns);
        }
        tile(depth, ap + i * depth, b_panel, edge, columns, load_c, panel_bias);
        for (Index r = 0; r < height; ++r)
          std::copy(edge + r * columns, edge + r * columns + width, c_tile + r * ldc);
      }
    }
  }
};
