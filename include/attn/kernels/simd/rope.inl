// attn/kernels/simd/rope.inl: the vector rotation of kernels/rope.hpp, compiled once per
// vector instruction set (simd/foreach_isa.hpp) on its primitives (avx2.hpp, avx512.hpp):
// float tables, rows of float, Eigen::half or Eigen::bfloat16.
//
//   half_split   a = x[i : i + lanes), b = x[i + R/2 : ...), c and s straight from the table:
//                x[i...] = a c - b s, x[i + R/2...] = b c + a s
//   interleaved  v = x[2i : 2i + lanes) holds lanes / 2 pairs; c and s are the pairs' table
//                entries, each loaded twice ([c0, c0, c1, c1, ...]); with w = v, pairs swapped:
//                v c - w s in the even lanes, v c + w s in the odd ones (one fmaddsub)
// Pairs past the last whole vector go through generic::rope_pairs.

template <class T, class S>
void rope_rows(S* x, Index rows, Index row_stride, const T* table, Index rotary_dim,
               const Index* positions, bool interleaved) {
  static_assert(std::is_same_v<T, float>, "rope_rows: the vector rotation takes float tables");
  const Index half = rotary_dim / 2;
  for (Index r = 0; r < rows; ++r) {
    S* row = x + r * row_stride;
    const float* cosines = table + positions[r] * rotary_dim;
    const float* sines = cosines + half;
    Index i = 0;  // pairs done
    if (interleaved) {
      for (; 2 * i + lanes <= rotary_dim; i += lanes / 2) {
        const vec v = load_widened(row + 2 * i);
        store_narrowed(row + 2 * i, fmaddsub(v, load_pairs(cosines + i),
                                             mul(swap_pairs(v), load_pairs(sines + i))));
      }
    } else {
      for (; i + lanes <= half; i += lanes) {
        const vec a = load_widened(row + i), b = load_widened(row + half + i);
        const vec c = load(cosines + i), s = load(sines + i);
        store_narrowed(row + i, fmsub(a, c, mul(b, s)));
        store_narrowed(row + half + i, fmadd(a, s, mul(b, c)));
      }
    }
    generic::rope_pairs(row, cosines, sines, half, i, interleaved);
  }
}
