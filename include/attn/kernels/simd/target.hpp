// attn/kernels/simd/target.hpp: compile a region of code for one instruction set, whatever
// flags the translation unit is built with.
//
//   ATTN_BEGIN_TARGET_AVX2         ... ATTN_END_TARGET   AVX2 + FMA + F16C, and never AVX-512
//   ATTN_BEGIN_TARGET_AVX512       ... ATTN_END_TARGET   AVX-512F (with AVX2, FMA, F16C)
//   ATTN_BEGIN_TARGET_AVX512_VNNI  ... ATTN_END_TARGET   AVX-512F, BW, VL and VNNI
//   ATTN_BEGIN_TARGET_AVX512_BF16  ... ATTN_END_TARGET   AVX-512F, BW, VL, VNNI and BF16
//
// Every function defined in the region (templates, member functions and lambdas included)
// carries the target attribute, so the intrinsics of that instruction set may be used in it.
// GCC takes `#pragma GCC target`; Clang ignores that pragma and takes
// `#pragma clang attribute` instead. The AVX2 region also switches AVX-512 off, so that the
// AVX2 kernels compiled in a unit built with, say, -mavx2 contain no AVX-512 instruction: the
// linker keeps one copy of each inline function, and that copy must run on every CPU the
// dispatcher (attn/cpu.hpp) sends to it.
//
// GCC also turns off floating-point contraction in the regions: it contracts a * b + c into
// one FMA by default in C++ (-ffp-contract=fast), wherever inlining brings the two together,
// so the same kernel could round differently in two translation units (in attn::compiled
// and in a user's header-only unit, say). The kernels' FMAs are explicit intrinsics; the
// rest rounds each operation, as clang's default (contraction within one expression only)
// does too.
//
// And in a unit optimised for speed (-O1, -O2; not -O0, where one debugs, nor -Os) GCC
// compiles the regions at -O3, so that a plain -O2 build runs the kernels as fast as an -O3
// one: at -O2 GCC 12 left decode over q8_0 and q4_0 caches 1.04-1.21x slower, and no one
// flag of -O3 made up the difference (docs/performance.md, "Tuning choices"). The price is
// the regions' compile time at -O2. (-O3 changes no result: contraction stays off and GCC
// reassociates no floating-point sum without -ffast-math.)
//
// Values of vector type never cross from a region to code outside it: the interface of the
// region's kernels is pointers and scalars (a __m256 argument between functions of different
// targets changes the calling convention).
#pragma once

#include "attn/cpu.hpp"

#if ATTN_X86_DISPATCH

// A translation unit built with AVX-512 gets its intrinsics defined for its own target, so an
// AVX2 region that switched AVX-512 off could not inline them; such a unit needs an AVX-512
// CPU anyway (its own code and every inline function it compiles, Eigen's and the standard
// library's included, may use AVX-512), so there the AVX2 region leaves AVX-512 on.
// (_Pragma takes one string literal, hence the four spelled-out variants.)
// clang-format off
#if defined(__clang__)
#if defined(__AVX512F__)
#define ATTN_BEGIN_TARGET_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#else
#define ATTN_BEGIN_TARGET_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c,no-avx512f\"))), apply_to = function)")
#endif
#define ATTN_BEGIN_TARGET_AVX512 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx2,fma,f16c\"))), apply_to = function)")
#define ATTN_BEGIN_TARGET_AVX512_VNNI \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c\"))), apply_to = function)")
#define ATTN_BEGIN_TARGET_AVX512_BF16 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c\"))), apply_to = function)")
#define ATTN_END_TARGET _Pragma("clang attribute pop")
#else
#if defined(__OPTIMIZE__) && !defined(__OPTIMIZE_SIZE__)
#define ATTN_DETAIL_GCC_KERNEL_OPTIONS _Pragma("GCC optimize(\"O3,fp-contract=off\")")
#else
#define ATTN_DETAIL_GCC_KERNEL_OPTIONS _Pragma("GCC optimize(\"fp-contract=off\")")
#endif
#if defined(__AVX512F__)
#define ATTN_BEGIN_TARGET_AVX2                                          \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")") \
      ATTN_DETAIL_GCC_KERNEL_OPTIONS
#else
#define ATTN_BEGIN_TARGET_AVX2                                                     \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,no-avx512f\")") \
      ATTN_DETAIL_GCC_KERNEL_OPTIONS
#endif
#define ATTN_BEGIN_TARGET_AVX512                                                \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx2,fma,f16c\")") \
      ATTN_DETAIL_GCC_KERNEL_OPTIONS
#define ATTN_BEGIN_TARGET_AVX512_VNNI                                           \
  _Pragma("GCC push_options")                                                   \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c\")") \
          ATTN_DETAIL_GCC_KERNEL_OPTIONS
#define ATTN_BEGIN_TARGET_AVX512_BF16                                                      \
  _Pragma("GCC push_options")                                                              \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c\")") \
          ATTN_DETAIL_GCC_KERNEL_OPTIONS
#define ATTN_END_TARGET _Pragma("GCC pop_options")
#endif
// clang-format on

#include <immintrin.h>

#endif  // ATTN_X86_DISPATCH
