// attn/kernels/simd/tile_products.hpp: the vector kernels' building blocks, compiled for every
// vector instruction set (simd/foreach_isa.hpp): the tile products of flash, decode and the
// backward (tile_products.inl, decode_products.inl, backward_products.inl) and the GEMM's
// micro-kernel and packing (gemm_micro.inl), in attn::detail::avx2 and attn::detail::avx512. Their
// generic counterparts, on Eigen, are in kernels/generic.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/dropout.hpp"
#include "attn/kernels/simd/avx2.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/quantized.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/gemm_micro.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/tile_products.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/decode_products.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/backward_products.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"
