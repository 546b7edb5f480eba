// Explicit instantiations of tests/support/instances.hpp: ATTN_TEST_INSTANCES_FLOAT, _16BIT and
// _BACKWARD, in one unit because they share the float vector kernels (see instances.hpp).
#include "support/instances.hpp"

ATTN_TEST_INSTANCES_FLOAT()
ATTN_TEST_INSTANCES_16BIT()
ATTN_TEST_INSTANCES_BACKWARD()
