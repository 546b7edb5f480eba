// attn/distributed.hpp: one sequence across the ranks of an MPI communicator (attn::mpi;
// docs/distributed.md). Only includes; attn/attn.hpp does not include it, so that the rest of
// attn never needs MPI.
#pragma once

#include "attn/distributed/ring.hpp"            // ring_attention(_into): the forward
#include "attn/distributed/ring_backward.hpp"   // ring_attention_backward(_into)
#include "attn/distributed/sequence_split.hpp"  // SequenceSplit, token_runs, local_length
#include "attn/distributed/split_cache.hpp"     // split_cache_attend_into: decoding
#include "attn/distributed/ulysses.hpp"         // ulysses_attention(_backward)_into
