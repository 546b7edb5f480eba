// attn/block_mask.hpp: a mask_mod classified block by block, once, for reuse (PyTorch
// FlexAttention's create_block_mask).
//
// The (Lq, Lk) plane of each (b, h) is cut into blocks of q_block x k_block; each block is
// hidden (no visible pair: kernels skip it), visible (every pair visible: kernels skip the
// mask_mod there) or partial (kernels evaluate the mask_mod element by element). Building
// evaluates the mask_mod on every pair of every block, once; the result takes one byte per
// block. Batch and heads may be 1, meaning the same classes for every batch entry / head
// (FlexAttention's B = None, H = None). A kernel tile that spans several blocks takes the
// classes of all of them: hidden if all are, visible if all are, partial otherwise, so any
// tile size works and tiles that are multiples of the blocks lose nothing.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/mods.hpp"

namespace attn {

class BlockMask {
 public:
  /// No block mask.
  BlockMask() = default;

  /// Classifies every block of (batch, heads, q_length, k_length) by evaluating `mask_mod`,
  /// with its loops compiled for `isa` (default: the widest instruction set the CPU has; the
  /// classes do not depend on it).
  BlockMask(MaskMod mask_mod, Index batch, Index heads, Index q_length, Index k_length,
            Index q_block = 128, Index k_block = 128, Isa isa = best_isa())
      : mask_mod_(std::move(mask_mod)),
        batch_(batch),
        heads_(heads),
        q_length_(q_length),
        k_length_(k_length),
        q_block_(q_block),
        k_block_(k_block) {
    constexpr const char* function = "BlockMask";
    if (!mask_mod_)
      detail::throw_invalid_argument(function, "mask_mod is empty");
    if (batch < 1 || heads < 1 || q_length < 0 || k_length < 0) {
      detail::throw_invalid_argument(
          function, "sizes are " + detail::shape_string({batch, heads, q_length, k_length}) +
                        " (B, H, Lq, Lk): B and H must be >= 1 and the lengths >= 0");
    }
    if (q_block < 1 || k_block < 1) {
      detail::throw_invalid_argument(function, "blocks are " + std::to_string(q_block) + " x " +
                                                   std::to_string(k_block) + ": must be >= 1");
    }
    q_blocks_ = (q_length + q_block - 1) / q_block;
    k_blocks_ = (k_length + k_block - 1) / k_block;
    auto classes = std::make_shared<std::vector<TileVisibility>>(
        static_cast<std::size_t>(batch * heads * q_blocks_ * k_blocks_));
    std::size_t n = 0;
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < heads; ++h) {
        for (Index qb = 0; qb < q_blocks_; ++qb) {
          const Index i0 = qb * q_block, i1 = std::min(i0 + q_block, q_length);
          for (Index kb = 0; kb < k_blocks_; ++kb) {
            const Index j0 = kb * k_block, j1 = std::min(j0 + k_block, k_length);
            (*classes)[n++] = mask_mod_.classify(b, h, i0, i1, j0, j1, isa);
          }
        }
      }
    }
    classes_ = std::move(classes);
  }

  bool empty() const { return !mask_mod_; }
  /// The mask_mod the blocks were classified with (kernels evaluate it on partial blocks).
  const MaskMod& mask_mod() const { return mask_mod_; }

  Index batch() const { return batch_; }
  Index heads() const { return heads_; }
  Index q_length() const { return q_length_; }
  Index k_length() const { return k_length_; }
  Index q_block() const { return q_block_; }
  Index k_block() const { return k_block_; }
  Index q_blocks() const { return q_blocks_; }
  Index k_blocks() const { return k_blocks_; }

  /// The class of block (qb, kb) of batch entry b, head h (each taken modulo a size-1 batch
  /// or heads).
  TileVisibility block(Index b, Index h, Index qb, Index kb) const {
    const Index bb = batch_ == 1 ? 0 : b, hh = heads_ == 1 ? 0 : h;
    return (*classes_)[static_cast<std::size_t>(((bb * heads_ + hh) * q_blocks_ + qb) * k_blocks_ +
                                                kb)];
  }

  /// The class of the tile [i0, i1) x [j0, j1) from the blocks it overlaps; an empty tile
  /// is hidden.
  TileVisibility classify(Index b, Index h, Index i0, Index i1, Index j0, Index j1) const {
    if (i0 >= i1 || j0 >= j1)
      return TileVisibility::hidden;
    bool any_visible = false, all_visible = true;
    for (Index qb = i0 / q_block_; qb <= (i1 - 1) / q_block_; ++qb) {
      for (Index kb = j0 / k_block_; kb <= (j1 - 1) / k_block_; ++kb) {
        const TileVisibility c = block(b, h, qb, kb);
        any_visible = any_visible || c != TileVisibility::hidden;
        all_visible = all_visible && c == TileVisibility::visible;
      }
    }
    if (!any_visible)
      return TileVisibility::hidden;
    return all_visible ? TileVisibility::visible : TileVisibility::partial;
  }

  /// How many blocks are hidden, visible and partial, over every stored (b, h).
  std::array<Index, 3> counts() const {
    std::array<Index, 3> n{0, 0, 0};
    if (classes_) {
      for (const TileVisibility c : *classes_)
        ++n[static_cast<std::size_t>(c)];
    }
    return n;
  }

  /// Bytes of the classes (one per block).
  std::size_t bytes() const { return classes_ ? classes_->size() : 0; }

  /// E.g. "BlockMask (1, 1, 8192, 8192) in blocks of 128 x 128: 3584 hidden, 448 visible,
  /// 64 partial".
  std::string describe() const {
    if (empty())
      return "BlockMask (empty)";
    const auto n = counts();
    return "BlockMask " + detail::shape_string({batch_, heads_, q_length_, k_length_}) +
           " in blocks of " + std::to_string(q_block_) + " x " + std::to_string(k_block_) + ": " +
           std::to_string(n[0]) + " hidden, " + std::to_string(n[1]) + " visible, " +
           std::to_string(n[2]) + " partial";
  }

 private:
  MaskMod mask_mod_;
  Index batch_ = 0, heads_ = 0, q_length_ = 0, k_length_ = 0;
  Index q_block_ = 1, k_block_ = 1, q_blocks_ = 0, k_blocks_ = 0;
  std::shared_ptr<const std::vector<TileVisibility>> classes_;  // (B, H, q blocks, k blocks)
};

}  // namespace attn
