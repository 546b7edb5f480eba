// attn::compiled: linear attention, its gradients and its recurrent state.
#include <attn/instances.hpp>
#include <attn/linear_attention.hpp>

ATTN_LINEAR_ATTENTION_INSTANCES(ATTN_DEFINE_INSTANCE)
ATTN_LINEAR_ATTENTION_CLASSES(ATTN_DEFINE_CLASS)
