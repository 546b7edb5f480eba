// attn::compiled: the generic instruction set's kernels (Eigen's products; float and double).
#include <attn/instances.hpp>
#include <attn/kernels/dispatch.hpp>

ATTN_GENERIC_KERNEL_INSTANCES(ATTN_DEFINE_INSTANCE)
