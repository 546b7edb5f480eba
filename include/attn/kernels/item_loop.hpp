// attn/kernels/item_loop.hpp: the parallel loop over the independent work items of a kernel.
//
// Items are handed to the OpenMP threads dynamically, one at a time; each thread makes its
// scratch once (make_scratch()) and reuses it for all its items. Every item is computed by
// one thread in the same way whatever the thread count, so results are bitwise identical
// for any number of threads. Small problems (under about a million FLOPs, attn/plan.hpp) run
// on the calling thread: a parallel region costs more than they do.
#pragma once

#include "attn/config.hpp"

namespace attn::detail {

/// body(item, scratch) for every item in [0, items), on the OpenMP threads when `parallel`
/// (KernelPlan::parallel).
template <class MakeScratch, class Body>
void for_each_item(Index items, bool parallel, const MakeScratch& make_scratch, const Body& body) {
  (void)parallel;
#if ATTN_HAS_OPENMP
#pragma omp parallel if (parallel)
#endif
  {
    auto scratch = make_scratch();
#if ATTN_HAS_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index item = 0; item < items; ++item)
      body(item, scratch);
  }
}

}  // namespace attn::detail
