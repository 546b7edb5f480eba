// attn/attn.hpp: the whole public API.
#pragma once

#include "attn/attention.hpp"
#include "attn/config.hpp"
#include "attn/heads.hpp"
#include "attn/init.hpp"
#include "attn/kv_cache.hpp"
#include "attn/linear_attention.hpp"
#include "attn/mask.hpp"
#include "attn/multihead.hpp"
#include "attn/precision.hpp"
#include "attn/projection.hpp"
#include "attn/score_modifiers.hpp"
#include "attn/softmax.hpp"
#include "attn/tensor.hpp"
#include "attn/viz.hpp"
