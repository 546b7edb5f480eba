// Explicit instantiations of tests/support/instances.hpp: ATTN_TEST_INSTANCES_LAYERS.
#include "support/instances.hpp"

ATTN_TEST_INSTANCES_LAYERS()
