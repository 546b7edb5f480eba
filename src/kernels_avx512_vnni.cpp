// attn::compiled: the avx512_vnni level's own kernel, decode's scores on int8 products,
// compiled inside its target region as in a header-only build (kernels/int8_decode.hpp),
// whatever this unit's flags. (The level's other entries are avx512's: src/kernels_avx512.cpp.)
#include <attn/instances.hpp>
#include <attn/kernels/dispatch.hpp>

#if ATTN_X86_DISPATCH
ATTN_INT8_KERNEL_INSTANCES(ATTN_DEFINE_INSTANCE)
#endif
