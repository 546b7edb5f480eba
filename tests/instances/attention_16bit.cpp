// Explicit instantiations of tests/support/instances.hpp: ATTN_TEST_INSTANCES_16BIT.
#include "support/instances.hpp"

ATTN_TEST_INSTANCES_16BIT()
