// attn::compiled: the avx2 kernels (float), compiled inside their target region as in a
// header-only build (kernels/simd/foreach_isa.hpp), whatever this unit's flags.
#include <attn/instances.hpp>
#include <attn/kernels/dispatch.hpp>

#if ATTN_X86_DISPATCH
ATTN_VECTOR_KERNEL_INSTANCES(ATTN_DEFINE_INSTANCE, attn::detail::avx2)
#endif
