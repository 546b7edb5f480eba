// attn::compiled: the avx512_bf16 level's own kernel, the flash tile on bf16 products,
// compiled inside its target region as in a header-only build (kernels/bf16_tiles.hpp),
// whatever this unit's flags. (The level's other entries are avx512's: src/kernels_avx512.cpp.)
#include <attn/instances.hpp>
#include <attn/kernels/dispatch.hpp>

#if ATTN_X86_DISPATCH
ATTN_BF16_KERNEL_INSTANCES(ATTN_DEFINE_INSTANCE)
#endif
