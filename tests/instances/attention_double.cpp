// Explicit instantiations of tests/support/instances.hpp: ATTN_TEST_INSTANCES_DOUBLE.
#include "support/instances.hpp"

ATTN_TEST_INSTANCES_DOUBLE()
