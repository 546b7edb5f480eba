// attn/kernels/item_loop.hpp: the parallel loop over the independent work items of a kernel.
//
// Items are handed to the OpenMP threads dynamically, one at a time or in runs of
// consecutive items; each thread makes its scratch once (make_scratch()) and reuses it for
// all its items. Every item is computed by one thread in the same way whatever the thread
// count, so results are bitwise identical for any number of threads. Small problems (under
// about a million FLOPs, attn/plan.hpp) run on the calling thread: a parallel region costs
// more than they do.
#pragma once

#include <algorithm>

#include "attn/config.hpp"

namespace attn::detail {

/// body(item, scratch) for every item in [0, items), on the OpenMP threads when `parallel`
/// (KernelPlan::parallel): one item at a time, or with `runs_per_thread` > 0 in runs of
/// consecutive items, about that many a thread, so that a thread's items read memory in long
/// stretches (decode's splits of one kv head follow each other in its keys) while the runs
/// keep the dynamic schedule's balance.
template <class MakeScratch, class Body>
void for_each_item(Index items, bool parallel, const MakeScratch& make_scratch, const Body& body,
                   Index runs_per_thread = 0) {
  (void)parallel;
  (void)runs_per_thread;
#if ATTN_HAS_OPENMP
#pragma omp parallel if (parallel)
#endif
  {
    auto scratch = make_scratch();
#if ATTN_HAS_OPENMP
    const Index threads = omp_get_num_threads();
    const Index run =
        runs_per_thread > 0 ? std::max<Index>(1, items / (threads * runs_per_thread)) : 1;
#pragma omp for schedule(dynamic, run)
#endif
    for (Index item = 0; item < items; ++item)
      body(item, scratch);
  }
}

/// One work item of the query-tiled kernels (chunked, flash): query rows [i0, i0 + rows) of
/// head h of batch entry b.
struct QueryTileItem {
  Index b, h, i0, rows;  ///< rows <= 0: past the end of a shorter sequence of a packed batch
};

/// Item `item` of heads * q_tiles items: (b, h) major, and within a head the query tiles last
/// first, since under a causal mask the last tiles see the most keys and the dynamic schedule
/// then hands out the longest items first. `q` gives each sequence's length (q.rows(b)).
template <class Heads>
QueryTileItem query_tile_item(Index item, Index q_tiles, Index query_tile, const Heads& q) {
  const Index head_item = item / q_tiles;  // b * Hq + h
  const Index b = head_item / q.heads, h = head_item % q.heads;
  const Index i0 = (q_tiles - 1 - item % q_tiles) * query_tile;
  return {b, h, i0, std::min(i0 + query_tile, q.rows(b)) - i0};
}

}  // namespace attn::detail
