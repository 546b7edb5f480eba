// attn::compiled: scaled dot-product attention, padded and packed, and the decode kernel's
// driver, for every storage combination of attn/instances.hpp.
#include <attn/attention.hpp>
#include <attn/instances.hpp>
#include <attn/kernels/decode.hpp>

ATTN_ATTENTION_INSTANCES(ATTN_DEFINE_INSTANCE)
ATTN_DECODE_INSTANCES(ATTN_DEFINE_INSTANCE)
