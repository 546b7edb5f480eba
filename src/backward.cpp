// attn::compiled: the gradients of attention, padded and packed.
#include <attn/attention_backward.hpp>
#include <attn/instances.hpp>

ATTN_BACKWARD_INSTANCES(ATTN_DEFINE_INSTANCE)
