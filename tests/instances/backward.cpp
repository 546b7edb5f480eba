// Explicit instantiations of tests/support/instances.hpp: ATTN_TEST_INSTANCES_BACKWARD.
#include "support/instances.hpp"

ATTN_TEST_INSTANCES_BACKWARD()
