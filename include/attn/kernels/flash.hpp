// attn/kernels/flash.hpp: tiled attention with an online softmax (FlashAttention's forward).
//
//   q    (B, Hq, Lq, D)    work items: (b, query head, query tile of Bq rows)
//   k    (B, Hkv, Lk, D)   read in place through the strided head view, key tile by key tile
//   v    (B, Hkv, Lk, Dv)  (16-bit k and v are widened tile by tile, quantized blocks
//                           dequantized: a view of blocks has D / 32 units per row)
//   out  (B, Hq, Lq, Dv)
//
// The kernel of one work item is flash_tile (kernels/online_softmax.inl), compiled for each
// instruction set; the plan (attn/plan.hpp) says which one runs (kernels/dispatch.hpp) and
// with which tiles. The (Lq, Lk) scores never exist. Tiles the mask hides entirely are skipped
// without any arithmetic (a causal mask does about half the work, a window O(L * window)); tiles it
// shows entirely skip mask evaluation (only a bias, if any, is added).
//
// Extra memory per thread (the one statement of it; docs/kernels.md links here), with W = Bq
// rounded up to whole vectors (16 floats for AVX-512, 8 for AVX2) and Bk = min(key tile, Lk):
// W * (D + Bk + Dv + 6) scalars and 3 * W 32-bit integers (kernels/workspace.hpp: q tile,
// scores, accumulator, six row vectors; the key bounds and dropout keys of the tile's rows),
// plus Bk * (D + Dv) scalars when k or v is stored in 16 bits, blocks or pages (on every path) and
// Bq * (D + Dv) when q and out are; independent of Lq and Lk. Float, D = Dv = 64, default
// tiles: 197 KiB (128 x 256), 98 KiB causal (64 x 256). On bf16 products
// (KernelPlan::bf16_products) add (W + Bk) (D + 1) + Bk (Dv + 1) 16-bit values, the
// operands in pairs (kernels/bf16_tiles.hpp): 74 KiB more at D = Dv = 64, 128 x 256. On int8
// products (KernelPlan::int8_products) add the head's keys quantized, Lk (4 ceil(D / 4) + 8)
// bytes, and the query tile's, about W D bytes (kernels/int8_tiles.hpp): 1.1 MiB more at
// Lk = 8192, D = 128: the one kernel here whose memory grows with Lk.
#pragma once

#include <algorithm>
#include <type_traits>

#include "attn/config.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/widening.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/quantized.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Flash attention over all (b, query head, query tile) items of the plan. Items are handed
/// out last query tile first: under a top-left causal mask the last tiles carry the most work.
template <class TQ, class TK, class TV, class TO>
void run_flash(const KernelPlan& plan,
               const HeadsView<const TQ>& q,  // (B, Hq, Lq, D)
               const HeadsView<const TK>& k,  // (B, Hkv, Lk, D)  (blocks: D / 32 units)
               const HeadsView<const TV>& v,  // (B, Hkv, Lk, Dv) (blocks: Dv / 32 units)
               const HeadsView<TO>& out,      // (B, Hq, Lq, Dv)
               const AttentionProblem<compute_scalar_t<TQ>>& problem, compute_scalar_t<TQ> scale,
               const RowValues<compute_scalar_t<TQ>>& logsumexp) {  // (B, Hq, Lq) or null
  using T = compute_scalar_t<TQ>;
  const Index q_heads = q.heads, q_length = q.length, k_length = k.length;
  const Index group = q_heads / k.heads;
  const Index query_tile = plan.query_tile;
  const Index key_tile = std::min(plan.key_tile, k_length);
  const Index q_tiles = (q_length + query_tile - 1) / query_tile;
  struct Scratch {
    Workspace<T> workspace;
    Matrix<T> q_rows;  // a widened query tile (16-bit q)
    NarrowedRows<T, TO> out_rows;
  };
  const ForwardKernels<T, TK, TV>& kernels = forward_kernels<T, TK, TV>(plan.isa);
  // bf16 or int8 products (the plan's choice, available only where the table has them)
  const auto flash_tile = plan.bf16_products   ? kernels.flash_tile_bf16
                          : plan.int8_products ? kernels.flash_tile_int8
                                               : kernels.flash_tile;
  ATTN_ASSERT(flash_tile != nullptr);
  const auto make_scratch = [&] {
    Scratch scratch;
    const Index width = kernels.padded(std::min(query_tile, q_length));
    const Index value_dim = v.dim * values_per_unit_v<TV>;
    scratch.workspace.reserve_flash(width, key_tile, q.dim, value_dim,
                                    !std::is_same_v<TK, T> || !std::is_same_v<TV, T> ||
                                        k.pages != nullptr || v.pages != nullptr);
    if (plan.bf16_products)
      scratch.workspace.reserve_bf16(width, key_tile, q.dim, value_dim);
    if (plan.int8_products)
      scratch.workspace.reserve_int8_flash(width, q.dim);
    return scratch;
  };
  for_each_item(plan.work_items, plan.parallel, make_scratch, [&](Index item, Scratch& s) {
    const auto [b, h, i0, rows] = query_tile_item(item, q_tiles, query_tile, q);
    if (rows <= 0)
      return;
    const HeadMatrix<const T> q_rows = rows_as<T, TQ>(plan.isa, q.head(b, h), i0, rows, s.q_rows);
    T* lse = logsumexp.head(b, h);
    flash_tile(q_rows, k, v, s.out_rows.rows(out.head(b, h), i0, rows), problem, b, h, h / group,
               scale, i0, key_tile, s.workspace, lse != nullptr ? lse + i0 : nullptr);
    s.out_rows.store(out.head(b, h), i0, rows);
  });
}

}  // namespace attn::detail
