// attn::compiled: the KV cache, rotary embeddings, the projections and multi-head attention.
#include <attn/instances.hpp>
#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>
#include <attn/projection.hpp>
#include <attn/rope.hpp>

ATTN_KV_CACHE_CLASSES(ATTN_DEFINE_CLASS)
ATTN_ROPE_CLASSES(ATTN_DEFINE_CLASS)
ATTN_PROJECTION_CLASSES(ATTN_DEFINE_CLASS)
ATTN_MULTIHEAD_CLASSES(ATTN_DEFINE_CLASS)
