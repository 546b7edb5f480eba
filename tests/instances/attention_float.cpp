// Explicit instantiations of tests/support/instances.hpp: ATTN_TEST_INSTANCES_FLOAT.
#include "support/instances.hpp"

ATTN_TEST_INSTANCES_FLOAT()
