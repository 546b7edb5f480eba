// attn/kernels/simd/table.inl: the entry points of one instruction set, as one table.
//
// No include guard and no #include: kernels/dispatch.hpp includes this file once per
// instruction set (simd/foreach_isa.hpp), inside attn::detail::generic, ::avx2 and ::avx512,
// after every per-instruction-set source. dispatch() hands a caller the Table of the set its
// plan chose; the members are variable templates, so a translation unit instantiates only
// the kernels it asks for (the float ones of a float call, say, not the backward's).

struct Table {
  static constexpr Isa level = isa;
  /// "generic", "avx2", "avx512" (a function, also so that the target region of the set has
  /// one: clang warns about a region that has none).
  static const char* name() { return isa_name(level); }

  /// flash_tile for compute scalar T, K stored as SK and V as SV.
  template <class T, class SK, class SV>
  static constexpr ForwardKernels<T, SK, SV> forward{level, lanes, &flash_tile<T, SK, SV>, nullptr};

  /// decode_split and merge_splits for compute scalar T, K stored as SK and V as SV.
  template <class T, class SK, class SV>
  static constexpr DecodeKernels<T, SK, SV> decode{level, widens_in_registers,
                                                   &decode_split<T, SK, SV>, &merge_splits<T>};

  /// The key-tile step of the flash backward.
  template <class T>
  static constexpr BackwardKernels<T> backward{level, lanes, &backward_key_tile<T>};

  /// The float GEMM of the projections (T = float).
  template <class T>
  static constexpr GemmKernel gemm = &gemm_of<Gemm, T>;

  /// The rotation of RoPE for float tables and rows stored as S.
  template <class S>
  static constexpr RopeKernel<S> rope = &rope_rows<float, S>;

  /// 16-bit S widened to float.
  template <class S>
  static constexpr WidenKernel<S> widening = &widen<S>;
};
