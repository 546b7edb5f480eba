// Differential fuzz target (libFuzzer): naive, chunked, flash and decode attention must agree,
// flash and decode on every instruction set the CPU has (attn/cpu.hpp).
//
// Build and run: scripts/fuzz.sh (fuzz/README.md). Each input is decoded into one problem:
//
//   q  (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)   B <= 3, Hkv <= 2, Hq/Hkv <= 2,
//                                                              Lq, Lk <= 70, D, Dv <= 70
//   float or double; every mask kind and combination (causal top_left / bottom_right, window,
//   key_lengths, query_lengths, sink tokens, keep_mask and bias with any broadcast shape, -inf
//   and +inf in the bias, ALiBi, softcap, learned sinks), scale, tile sizes; values uniform in
//   [-2, 2] with a sprinkling of large values (up to 2^20) and of NaN; or, for some inputs,
//   one invalid argument. Without a keep-mask or bias, some inputs also run every kernel
//   as packed sequences (packed_view(), through scaled_dot_product_attention_into) on the
//   same sequences, checked by the same rules.
//
//   Mods (attn/mods.hpp; header bit 32), with any of the above:
//   - a mask_mod looking up a (B or 1, Hq or 1, Lq, Lk) table made of blocks each all
//     visible, all hidden or random, given as options.mask_mod or as options.block_mask
//     (blocks of 1 to 70, as the table's blocks or not, equal to the kernel tiles or not;
//     flash then takes the blocks as its tiles unless the input sets tiles);
//   - a score_mod s * f[h] + t[h][i - j], either term or both (t finite, sometimes -inf;
//     sometimes NaN at one (b, h, i, j)), f and t per head or shared.
//   The reference gets the same functions (Problem::mask_mod, score_mod, in long double).
//   Packed calls get them with positions within each sequence, a block mask sized by the
//   longest sequences. A mod called outside [0, B) x [0, Hq) x [0, Lq) x [0, Lk) (the
//   longest sequences' Lq and Lk in a packed call) fails the input. Invalid arguments of
//   their own: mask_mod and block_mask both given, a block mask of other sizes (padded and
//   packed calls).
//
// Oracle (README, "Error contract"):
//   - invalid argument: every kernel (and linear_attention, for the checks it shares) throws
//     std::invalid_argument with the same message (packed calls: the same as each other);
//     otherwise nothing throws;
//   - NaN reaches, in every kernel and in the reference: the whole row when a visible key's
//     score is NaN or +inf (NaN in the query, the key or its bias); column e of a row that has
//     a finite score when a visible key's v[j, e] is NaN. The other elements are compared
//     when column e of the head's v holds no NaN; NaN only in the value rows of hidden keys
//     (or of a fully masked row) is unspecified and not compared (naive and chunked multiply
//     every value row by its weight, 0 x NaN = NaN; flash skips hidden tiles). The score
//     is the score_mod's: its NaN pair reaches the row when visible, its -inf acts as a
//     -inf bias (with softcap it becomes -softcap, a finite score); hidden pairs' values of
//     a score_mod are discarded;
//   - error bound, per compared element, against the long double reference of
//     tests/support/reference.hpp, which shares no code with attn (its own visibility rule,
//     softmax and loops):  |kernel - ref| <= 2 |plain_T - ref| + floor + cond, where plain_T
//     is the same reference's loops run in T, and
//       floor = (32 + 2 Lk) eps max(1, max|v|)       (tests/test_kernels.cpp's 2x-plain rule,
//                                                      its floor widened for long rows)
//       cond  = 2 max|v| min(1, 2 (D + 4) eps S)     (S = the largest |term| of a visible
//                                                      logit: scale sum_d |q_d k_d| |f[h]|,
//                                                      |t[h][i - j]|, ALiBi, bias; logits
//                                                      rounded differently by each kernel
//                                                      move the softmax by up to 2 max|ds|
//                                                      in l1)
//     and log-sum-exp within 64 eps max(|ref|, 1) + 2 (D + 4) eps S, -inf exactly where the
//     reference has -inf;
//   - the flash backward on every instruction set agrees with the naive backward (no NaN or
//     large values; mask_mod and block_mask included; the bound is at check_backward); with
//     a score_mod, naive and flash backward throw std::invalid_argument; on packed
//     problems the packed backward (naive, and flash on every instruction set) agrees with
//     the padded naive backward on each sequence's rows;
//   - linear_attention (elu + 1, causal or not, key_lengths, no NaN or large values) agrees
//     with its quadratic form in R within (64 + 4 (D + Lk)) eps max(1, max|v|).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/block_mask.hpp>
#include <attn/cpu.hpp>
#include <attn/linear_attention.hpp>
#include <attn/mods.hpp>

#include "support/masked_problem.hpp"
#include "support/reference.hpp"

namespace {

using attn::Index;

/// Reads the fuzz input byte by byte; past the end every read gives 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  unsigned byte() { return pos_ < size_ ? data_[pos_++] : 0u; }
  /// An integer in [lo, hi].
  Index in(Index lo, Index hi) {
    const unsigned span = static_cast<unsigned>(hi - lo + 1);
    return lo + static_cast<Index>(byte() % span);
  }
  bool flag() { return (byte() & 1u) != 0; }
  std::uint64_t seed() {
    std::uint64_t s = 0;
    for (int n = 0; n < 4; ++n)
      s = (s << 8) | byte();
    return s;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_, pos_ = 0;
};

/// splitmix64: the same stream on every platform (std distributions are not portable).
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53;
  }
  Index below(Index n) { return static_cast<Index>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t state_;
};

enum class Invalid : int {
  none,
  head_dims,     // k's D differs from q's
  value_length,  // v's Lk differs from k's
  batch,         // k's B differs
  group,         // Hq not a multiple of Hkv
  zero_dim,      // D = 0
  window,        // window side -2
  key_count,     // key_lengths has B + 1 entries
  key_length,    // key_lengths[0] = Lk + 1
  keep_shape,    // keep_mask not broadcastable
  bias_shape,    // bias not broadcastable
  alibi_count,   // Hq + 1 slopes
  softcap,       // softcap <= 0
  scale,         // scale NaN
  tile,          // query_tile -1
  out_shape,     // out view of the wrong shape
  query_count,   // query_lengths has B + 1 entries
  sink_count,    // Hq + 1 sinks
  sink_value,    // a sink of NaN or inf
  sink_tokens,   // sink_tokens -1
  mods_both,     // mask_mod and block_mask both given
  block_shape,   // block_mask built for other sizes
  count
};

bool is_mod_invalid(Invalid e) {
  return e == Invalid::mods_both || e == Invalid::block_shape;
}

/// Invalid arguments that linear_attention checks the same way.
bool shared_with_linear(Invalid e) {
  return e == Invalid::head_dims || e == Invalid::value_length || e == Invalid::batch ||
         e == Invalid::group || e == Invalid::zero_dim || e == Invalid::key_count ||
         e == Invalid::key_length || e == Invalid::out_shape;
}

/// One decoded problem, values in double (exactly representable in float: rounded first).
struct Problem {
  bool use_double = false;
  Index batch = 1, q_heads = 1, kv_heads = 1, q_length = 1, k_length = 1, dim = 1, value_dim = 1;
  Invalid invalid = Invalid::none;
  attn::Causal causal = attn::Causal::none;
  attn::Window window{};
  std::vector<Index> key_lengths;
  std::array<Index, 4> keep_dims{0, 0, 0, 0}, bias_dims{0, 0, 0, 0};  // 0 = none
  std::vector<bool> keep;
  std::vector<double> bias, alibi;
  double softcap = 0;  // 0 = none
  double scale = 0;    // 0 = default
  std::vector<Index> query_lengths;
  Index sink_tokens = 0;
  std::vector<double> sinks;  // (Hq) learned sinks, or empty
  bool packed = false;        // also run the packed entry point on the same sequences
  Index query_tile = 0, key_tile = 0;
  std::vector<double> q, k, v;  // (B, Hq, Lq, D), (B, Hkv, Lk', D), (B', Hkv, Lk, Dv)
  Index k_batch = 1, k_dim = 1, v_length = 1, out_dim = 1;
  bool linear = false;
  bool large = false, has_nan = false;

  // FlexAttention's mods (attn/mods.hpp), given when the header has bit 32.
  enum class MaskModUse : int { none, mask_mod, block_mask, both };
  MaskModUse mask_use = MaskModUse::none;
  std::array<Index, 4> mask_dims{0, 0, 0, 0};  // (B or 1, Hq or 1, Lq, Lk) of mask_table
  std::vector<std::uint8_t> mask_table;        // 1 = visible, in blocks of structure_q x _k
  Index structure_q = 1, structure_k = 1;
  Index block_q = 1, block_k = 1;                 // the BlockMask's blocks
  bool block_batch = false, block_heads = false;  // the BlockMask sized with B, Hq (else 1)
  int wrong_block_dim = 0;                        // Invalid::block_shape: which size is off
  bool wrong_block_down = false;                  // ... by -1 (when > 0), else +1
  bool score_add = false, score_scale = false;    // score_mod: s * factor[h] + table[h][i - j]
  Index score_heads = 0;                          // Hq or 1
  std::vector<double> score_table;                // (score_heads, Lq + Lk - 1), -inf allowed
  std::vector<double> score_factor;               // (score_heads)
  std::array<Index, 4> nan_pair{-1, -1, -1, -1};  // (b, h, i, j) whose score_mod is NaN

  bool has_mask_mod() const { return mask_use != MaskModUse::none; }
  bool has_score_mod() const { return score_add || score_scale; }
  /// The mask_mod: key j visible to query i of (b, h), by the table.
  bool mask_visible(Index b, Index h, Index i, Index j) const {
    const auto& d = mask_dims;
    const Index n = (((d[0] == 1 ? 0 : b) * d[1] + (d[1] == 1 ? 0 : h)) * d[2] + i) * d[3] + j;
    return mask_table[static_cast<std::size_t>(n)] != 0;
  }
  double score_added(Index h, Index i, Index j) const {
    const Index hs = score_heads == 1 ? 0 : h;
    return score_add ? score_table[static_cast<std::size_t>(hs * (q_length + k_length - 1) + i - j +
                                                            k_length - 1)]
                     : 0.0;
  }
  double score_multiplied(Index h) const {
    return score_scale ? score_factor[static_cast<std::size_t>(score_heads == 1 ? 0 : h)] : 1.0;
  }
  /// The score_mod in R: the kernels' (R = T), the reference's (R = long double).
  template <class R>
  R score_mod(R s, Index b, Index h, Index i, Index j) const {
    if (score_scale)
      s = s * static_cast<R>(score_multiplied(h));
    if (score_add)
      s = s + static_cast<R>(score_added(h, i, j));
    if (b == nan_pair[0] && h == nan_pair[1] && i == nan_pair[2] && j == nan_pair[3])
      s = std::numeric_limits<R>::quiet_NaN();
    return s;
  }
};

double rounded(bool use_double, double x) {
  return use_double ? x : static_cast<double>(static_cast<float>(x));
}

std::array<Index, 4> broadcast_dims(Bytes& in, const std::array<Index, 4>& full) {
  const unsigned bits = in.byte();
  std::array<Index, 4> dims{};
  for (std::size_t d = 0; d < 4; ++d)
    dims[d] = (bits >> d) & 1u ? full[d] : 1;
  return dims;
}

Index product(const std::array<Index, 4>& d) {
  return d[0] * d[1] * d[2] * d[3];
}

/// A block size in [1, 70] for `length`: the kernel's tile, the whole length, any size or a
/// small one.
Index block_size(Bytes& in, Index length, Index tile) {
  const unsigned mode = in.byte() % 4;
  const Index any = in.in(1, 70);
  switch (mode) {
    case 0:
      return tile > 0 ? tile : any;
    case 1:
      return std::clamp<Index>(length, 1, 70);
    case 2:
      return any;
    default:
      return 1 + any % 8;
  }
}

/// The mods' choices (the tables are filled from the random stream later, by fill_mods).
void decode_mods(Bytes& in, Problem& p) {
  using Use = Problem::MaskModUse;
  const unsigned mods = in.byte();
  p.mask_use = (mods & 3u) == 3 ? Use::block_mask : static_cast<Use>(mods & 3u);
  if (p.invalid == Invalid::mods_both)
    p.mask_use = Use::both;
  else if (p.invalid == Invalid::block_shape)
    p.mask_use = Use::block_mask;
  p.score_add = (mods & 4u) != 0;
  p.score_scale = (mods & 8u) != 0;
  const unsigned blocks = in.byte();
  p.mask_dims = {(mods & 16u) != 0 ? std::max<Index>(p.batch, 1) : 1,
                 (mods & 32u) != 0 ? p.q_heads : 1, p.q_length, p.k_length};
  // A block mask is classified per (b, h) where the table differs per (b, h).
  p.block_batch = p.mask_dims[0] != 1 || (blocks & 1u) != 0;
  p.block_heads = p.mask_dims[1] != 1 || (blocks & 2u) != 0;
  p.block_q = block_size(in, p.q_length, p.query_tile);
  p.block_k = block_size(in, p.k_length, p.key_tile);
  // The table's blocks: the block mask's (so that it gets every class), or others.
  p.structure_q = (blocks & 4u) != 0 ? block_size(in, p.q_length, p.query_tile) : p.block_q;
  p.structure_k = (blocks & 4u) != 0 ? block_size(in, p.k_length, p.key_tile) : p.block_k;
  p.wrong_block_dim = static_cast<int>((blocks >> 3) % 4);
  p.wrong_block_down = (blocks & 32u) != 0;
  p.score_heads = (mods & 64u) != 0 ? p.q_heads : 1;
  if (p.has_score_mod() && (mods & 128u) != 0)
    p.nan_pair = {0, 0, 0, 0};  // placed by fill_mods
}

/// The mods' tables: the mask in blocks of structure_q x structure_k, each all visible, all
/// hidden or random; the score table in [-3, 3] with some -inf; the factors in [-2, 2].
void fill_mods(Problem& p, Random& rng) {
  if (p.has_mask_mod()) {
    const auto& d = p.mask_dims;
    p.mask_table.assign(static_cast<std::size_t>(product(d)), 0);
    const Index share = 1 + rng.below(7);  // of 8: the visible share of a random block
    for (Index bh = 0; bh < d[0] * d[1]; ++bh) {
      for (Index i0 = 0; i0 < d[2]; i0 += p.structure_q) {
        for (Index j0 = 0; j0 < d[3]; j0 += p.structure_k) {
          const Index kind = rng.below(3);  // 0 hidden, 1 visible, 2 random
          for (Index i = i0; i < std::min(i0 + p.structure_q, d[2]); ++i) {
            for (Index j = j0; j < std::min(j0 + p.structure_k, d[3]); ++j) {
              p.mask_table[static_cast<std::size_t>((bh * d[2] + i) * d[3] + j)] =
                  kind == 1 || (kind == 2 && rng.below(8) < share);
            }
          }
        }
      }
    }
  }
  if (p.score_add) {
    p.score_table.resize(
        static_cast<std::size_t>(p.score_heads * std::max<Index>(p.q_length + p.k_length - 1, 0)));
    for (double& t : p.score_table) {
      t = rng.below(16) == 0 ? -std::numeric_limits<double>::infinity()
                             : rounded(p.use_double, rng.uniform(-3, 3));
    }
  }
  if (p.score_scale) {
    p.score_factor.resize(static_cast<std::size_t>(p.score_heads));
    for (double& f : p.score_factor)
      f = rounded(p.use_double, rng.uniform(-2, 2));
  }
  if (p.nan_pair[0] == 0) {
    p.nan_pair = {rng.below(std::max<Index>(p.batch, 1)), rng.below(p.q_heads),
                  rng.below(std::max<Index>(p.q_length, 1)),
                  rng.below(std::max<Index>(p.k_length, 1))};
  }
}

Problem decode(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  Problem p;
  const unsigned header = in.byte();
  p.use_double = (header & 1u) != 0;
  p.linear = (header & 2u) != 0;
  p.large = (header & 4u) != 0;
  const bool nan = (header & 8u) != 0;
  const unsigned invalid = in.byte() % 48;
  p.invalid = invalid < static_cast<unsigned>(Invalid::count) ? static_cast<Invalid>(invalid)
                                                              : Invalid::none;
  p.batch = in.in(0, 3);
  p.kv_heads = in.in(1, 2);
  p.q_heads = p.kv_heads * in.in(1, 2);
  p.q_length = in.in(0, 70);
  p.k_length = in.in(0, 70);
  p.dim = in.in(1, 70);
  p.value_dim = in.in(0, 70);
  // Keep most problems small so that the fuzzer runs many of them.
  if ((header & 16u) == 0) {
    p.q_length %= 20;
    p.k_length %= 24;
    p.dim = 1 + p.dim % 17;
    p.value_dim %= 18;
  }
  const Index full_l = p.k_length;

  const unsigned masks = in.byte();
  p.causal = static_cast<attn::Causal>(masks % 3);
  if (masks & 4u)
    p.window = {in.in(-1, 20), in.in(-1, 20)};
  if (masks & 8u) {
    for (Index b = 0; b < p.batch; ++b)
      p.key_lengths.push_back(in.in(0, full_l));
  }
  const std::array<Index, 4> full{p.batch, p.q_heads, p.q_length, p.k_length};
  if (masks & 16u)
    p.keep_dims = broadcast_dims(in, full);
  if (masks & 32u)
    p.bias_dims = broadcast_dims(in, full);
  if (masks & 64u) {
    for (Index h = 0; h < p.q_heads; ++h)
      p.alibi.push_back(static_cast<double>(in.byte()) / 64.0);
  }
  if (masks & 128u)
    p.softcap = 0.25 + static_cast<double>(in.byte()) / 4.0;
  const unsigned scale = in.byte();
  if (scale & 1u)
    p.scale = std::ldexp((scale & 2u) ? -1.0 : 1.0, static_cast<int>(scale >> 2) % 12 - 6);
  p.query_tile = in.in(0, 20);
  p.key_tile = in.in(0, 20);
  const unsigned extras = in.byte();
  if (extras & 1u) {
    for (Index b = 0; b < p.batch; ++b)
      p.query_lengths.push_back(in.in(0, p.q_length));
  }
  if (extras & 2u)
    p.sink_tokens = in.in(1, 6);
  if (extras & 4u) {
    for (Index h = 0; h < p.q_heads; ++h)
      p.sinks.push_back(static_cast<double>(in.byte()) / 32.0 - 4.0);
  }
  p.packed = (extras & 8u) != 0 && (masks & 48u) == 0;  // no keep-mask, no bias

  p.k_batch = p.batch;
  p.k_dim = p.dim;
  p.v_length = p.k_length;
  p.out_dim = p.value_dim;
  switch (p.invalid) {
    case Invalid::head_dims:
      p.k_dim = p.dim + 1;
      break;
    case Invalid::value_length:
      p.v_length = p.k_length + 1;
      break;
    case Invalid::batch:
      p.k_batch = p.batch + 1;
      break;
    case Invalid::group:
      p.q_heads = p.kv_heads == 1 ? 1 : 3;  // with Hkv = 1 the problem stays valid
      if (p.kv_heads == 1)
        p.invalid = Invalid::none;
      p.alibi.assign(p.alibi.empty() ? 0 : static_cast<std::size_t>(p.q_heads), 0.5);
      p.sinks.assign(p.sinks.empty() ? 0 : static_cast<std::size_t>(p.q_heads), 0.5);
      p.keep_dims[1] = p.keep_dims[1] == 0 ? 0 : 1;
      p.bias_dims[1] = p.bias_dims[1] == 0 ? 0 : 1;
      break;
    case Invalid::zero_dim:
      p.dim = p.k_dim = 0;
      break;
    case Invalid::window:
      p.window.left = -2;
      break;
    case Invalid::key_count:
      p.key_lengths.assign(static_cast<std::size_t>(p.batch + 1), 0);
      break;
    case Invalid::key_length:
      p.key_lengths.assign(static_cast<std::size_t>(p.batch), p.k_length);
      if (p.batch == 0)
        p.key_lengths.push_back(0);  // wrong count instead
      else
        p.key_lengths[0] = p.k_length + 1;
      break;
    case Invalid::keep_shape:
      p.keep_dims = {1, 1, p.q_length + 2, 1};
      break;
    case Invalid::bias_shape:
      p.bias_dims = {1, 1, 1, p.k_length + 2};
      break;
    case Invalid::alibi_count:
      p.alibi.assign(static_cast<std::size_t>(p.q_heads + 1), 0.25);
      break;
    case Invalid::softcap:
      p.softcap = in.flag() ? -1.0 : -0.0;
      break;
    case Invalid::scale:
      p.scale = std::numeric_limits<double>::quiet_NaN();
      break;
    case Invalid::tile:
      p.query_tile = -1;
      break;
    case Invalid::out_shape:
      p.out_dim = p.value_dim + 1;
      break;
    case Invalid::query_count:
      p.query_lengths.assign(static_cast<std::size_t>(p.batch + 1), 0);
      break;
    case Invalid::sink_count:
      p.sinks.assign(static_cast<std::size_t>(p.q_heads + 1), 0.5);
      break;
    case Invalid::sink_value:
      p.sinks.assign(static_cast<std::size_t>(p.q_heads), 0.5);
      if (p.q_heads > 0)
        p.sinks.back() = in.flag() ? std::numeric_limits<double>::quiet_NaN()
                                   : -std::numeric_limits<double>::infinity();
      else
        p.invalid = Invalid::none;
      break;
    case Invalid::sink_tokens:
      p.sink_tokens = -1;
      break;
    default:
      break;
  }
  if ((header & 32u) != 0 || is_mod_invalid(p.invalid))
    decode_mods(in, p);

  Random rng(in.seed());
  const auto fill = [&](std::vector<double>& x, Index n) {
    x.resize(static_cast<std::size_t>(n));
    for (double& e : x)
      e = rounded(p.use_double, rng.uniform(-2, 2));
  };
  fill(p.q, p.batch * p.q_heads * p.q_length * p.dim);
  fill(p.k, p.k_batch * p.kv_heads * p.k_length * p.k_dim);
  fill(p.v, p.k_batch * p.kv_heads * p.v_length * p.value_dim);
  if (p.keep_dims[0] > 0) {
    p.keep.resize(static_cast<std::size_t>(product(p.keep_dims)));
    for (std::size_t n = 0; n < p.keep.size(); ++n)
      p.keep[n] = rng.below(4) != 0;
  }
  if (p.bias_dims[0] > 0) {
    fill(p.bias, product(p.bias_dims));
    for (double& e : p.bias) {
      const Index r = rng.below(40);
      if (r == 0)
        e = -std::numeric_limits<double>::infinity();
      else if (r == 1 && (masks & 1u))
        e = std::numeric_limits<double>::infinity();
    }
  }
  fill_mods(p, rng);
  // A sprinkling of large values: up to 2^20 in magnitude, so that q . k stays far from
  // overflow in float (70 * 2^40 < 2^47).
  std::vector<double>* tensors[] = {&p.q, &p.k, &p.v, &p.bias};
  if (p.large) {
    const Index count = in.in(1, 8);
    for (Index n = 0; n < count; ++n) {
      std::vector<double>& t = *tensors[in.byte() % 4];
      if (!t.empty()) {
        const double magnitude = std::ldexp(1.0, static_cast<int>(in.in(4, 20)));
        t[static_cast<std::size_t>(rng.below(static_cast<Index>(t.size())))] =
            rounded(p.use_double, rng.uniform(-magnitude, magnitude));
      }
    }
  }
  if (nan) {
    const Index count = in.in(1, 4);
    for (Index n = 0; n < count; ++n) {
      std::vector<double>& t = *tensors[in.byte() % 4];
      if (!t.empty()) {
        t[static_cast<std::size_t>(rng.below(static_cast<Index>(t.size())))] =
            std::numeric_limits<double>::quiet_NaN();
        p.has_nan = true;
      }
    }
  }
  return p;
}

void print_problem(const Problem& p, const std::string& what) {
  std::fprintf(
      stderr,
      "fuzz_attention: %s\n  %s, B %ld, Hq %ld, Hkv %ld, Lq %ld, Lk %ld, D %ld, Dv %ld, "
      "causal %d, window (%ld, %ld), key_lengths %zu, keep [%ld %ld %ld %ld], bias "
      "[%ld %ld %ld %ld], alibi %zu, softcap %g, scale %g, tiles %ld x %ld, invalid %d, "
      "query_lengths %zu, sink tokens %ld, sinks %zu, packed %d, nan %d\n",
      what.c_str(), p.use_double ? "double" : "float", static_cast<long>(p.batch),
      static_cast<long>(p.q_heads), static_cast<long>(p.kv_heads), static_cast<long>(p.q_length),
      static_cast<long>(p.k_length), static_cast<long>(p.dim), static_cast<long>(p.value_dim),
      static_cast<int>(p.causal), static_cast<long>(p.window.left),
      static_cast<long>(p.window.right), p.key_lengths.size(), static_cast<long>(p.keep_dims[0]),
      static_cast<long>(p.keep_dims[1]), static_cast<long>(p.keep_dims[2]),
      static_cast<long>(p.keep_dims[3]), static_cast<long>(p.bias_dims[0]),
      static_cast<long>(p.bias_dims[1]), static_cast<long>(p.bias_dims[2]),
      static_cast<long>(p.bias_dims[3]), p.alibi.size(), p.softcap, p.scale,
      static_cast<long>(p.query_tile), static_cast<long>(p.key_tile), static_cast<int>(p.invalid),
      p.query_lengths.size(), static_cast<long>(p.sink_tokens), p.sinks.size(),
      static_cast<int>(p.packed), static_cast<int>(p.has_nan));
  if (p.has_mask_mod() || p.has_score_mod()) {
    std::fprintf(stderr,
                 "  mods: mask_mod %d (0 none, 1 mask_mod, 2 block_mask, 3 both), table "
                 "[%ld %ld %ld %ld] in blocks %ld x %ld, block mask blocks %ld x %ld for B %d "
                 "H %d, wrong size %d%s; score_mod add %d scale %d heads %ld, NaN at "
                 "(%ld, %ld, %ld, %ld)\n",
                 static_cast<int>(p.mask_use), static_cast<long>(p.mask_dims[0]),
                 static_cast<long>(p.mask_dims[1]), static_cast<long>(p.mask_dims[2]),
                 static_cast<long>(p.mask_dims[3]), static_cast<long>(p.structure_q),
                 static_cast<long>(p.structure_k), static_cast<long>(p.block_q),
                 static_cast<long>(p.block_k), static_cast<int>(p.block_batch),
                 static_cast<int>(p.block_heads), p.wrong_block_dim,
                 p.wrong_block_down ? " down" : " up", static_cast<int>(p.score_add),
                 static_cast<int>(p.score_scale), static_cast<long>(p.score_heads),
                 static_cast<long>(p.nan_pair[0]), static_cast<long>(p.nan_pair[1]),
                 static_cast<long>(p.nan_pair[2]), static_cast<long>(p.nan_pair[3]));
  }
}

[[noreturn]] void fail(const Problem& p, const std::string& what) {
  print_problem(p, what);
  std::abort();
}

/// Fails the input when a kernel hands a mod an index outside [0, B) x [0, Hq) x
/// [0, q_limit) x [0, k_limit) (attn/mods.hpp: a mod sees pairs of the call's sizes only;
/// for a packed call the longest sequence's).
void check_mod_indices(const Problem& p, const char* mod, Index b, Index h, Index i, Index j,
                       Index q_limit, Index k_limit) {
  if (b < 0 || b >= std::max<Index>(p.batch, 1) || h < 0 || h >= p.q_heads || i < 0 ||
      i >= q_limit || j < 0 || j >= k_limit) {
    fail(p, std::string(mod) + " called at (b, h, q_idx, kv_idx) = (" + std::to_string(b) + ", " +
                std::to_string(h) + ", " + std::to_string(i) + ", " + std::to_string(j) +
                "), outside (" + std::to_string(p.batch) + ", " + std::to_string(p.q_heads) + ", " +
                std::to_string(q_limit) + ", " + std::to_string(k_limit) + ")");
  }
}

/// The input's mask_mod, as a kernel gets it.
struct TableMaskMod {
  const Problem* p;
  Index q_limit, k_limit;
  bool operator()(Index b, Index h, Index i, Index j) const {
    check_mod_indices(*p, "mask_mod", b, h, i, j, q_limit, k_limit);
    return p->mask_visible(b, h, i, j);
  }
};

/// The input's score_mod in T, as a kernel gets it.
template <class T>
struct TableScoreMod {
  const Problem* p;
  Index q_limit, k_limit;
  T operator()(T s, Index b, Index h, Index i, Index j) const {
    check_mod_indices(*p, "score_mod", b, h, i, j, q_limit, k_limit);
    return p->score_mod<T>(s, b, h, i, j);
  }
};

/// Sets the input's mods on `options` for a call of q_length x k_length scores (the longest
/// sequences of a packed call): the mask_mod, a BlockMask of it, both, or a BlockMask of the
/// wrong sizes; and the score_mod.
template <class T>
void set_mods(const Problem& p, Index q_length, Index k_length,
              attn::AttentionOptions<T>& options) {
  using Use = Problem::MaskModUse;
  const attn::MaskMod mask_mod(TableMaskMod{&p, q_length, k_length});
  if (p.mask_use == Use::mask_mod || p.mask_use == Use::both)
    options.mask_mod = mask_mod;
  std::array<Index, 4> dims{p.block_batch ? std::max<Index>(p.batch, 1) : 1,
                            p.block_heads ? p.q_heads : 1, q_length, k_length};
  if (p.invalid == Invalid::block_shape) {
    Index& d = dims[static_cast<std::size_t>(p.wrong_block_dim)];
    if (p.wrong_block_dim < 2)
      d = std::max<Index>(2, (p.wrong_block_dim == 0 ? p.batch : p.q_heads) + 1);  // not 1
    else
      d += p.wrong_block_down && d > 0 ? -1 : 1;
    // Any pattern: this block mask's sizes are not the table's.
    options.block_mask = attn::BlockMask(
        attn::MaskMod([](Index, Index, Index i, Index j) { return (i + 2 * j) % 3 != 0; }), dims[0],
        dims[1], dims[2], dims[3], p.block_q, p.block_k);
  } else if (p.mask_use == Use::block_mask || p.mask_use == Use::both) {
    options.block_mask =
        attn::BlockMask(mask_mod, dims[0], dims[1], dims[2], dims[3], p.block_q, p.block_k);
  }
  if (p.has_score_mod())
    options.score_mod = attn::ScoreMod<T>(TableScoreMod<T>{&p, q_length, k_length});
}

/// The problem's tensors and options in scalar type S.
/// (T, H, D) tokens from padded (B, H, L, D) values: sequence b's first cu[b + 1] - cu[b] rows.
template <class S>
std::vector<S> pack_tokens(const std::vector<S>& x, const std::vector<Index>& cu, Index heads,
                           Index padded, Index dim) {
  std::vector<S> r(static_cast<std::size_t>(cu.back() * heads * dim));
  for (std::size_t b = 0; b + 1 < cu.size(); ++b)
    for (Index t = 0; t < cu[b + 1] - cu[b]; ++t)
      for (Index h = 0; h < heads; ++h)
        for (Index d = 0; d < dim; ++d)
          r[static_cast<std::size_t>(((cu[b] + t) * heads + h) * dim + d)] =
              x[static_cast<std::size_t>(((static_cast<Index>(b) * heads + h) * padded + t) * dim +
                                         d)];
  return r;
}

template <class S>
struct Typed {
  std::vector<S> q, k, v, bias;
  std::vector<S> out;
  std::vector<S> lse;
  attn::Tensor<bool, 4> keep;
  attn::AttentionOptions<S> options;
  /// run_packed's call: offsets, tokens, its out and (Hq, Tq) log-sum-exp, its options.
  struct Packed {
    std::vector<Index> cu_q, cu_k;
    std::vector<S> q, k, v, out, lse;
    attn::AttentionOptions<S> options;
  } packed;

  explicit Typed(const Problem& p) {
    const auto cast = [](const std::vector<double>& x) {
      return std::vector<S>(x.begin(), x.end());
    };
    q = cast(p.q);
    k = cast(p.k);
    v = cast(p.v);
    bias = cast(p.bias);
    options.causal = p.causal;
    options.window = p.window;
    options.key_lengths = p.key_lengths;
    options.query_lengths = p.query_lengths;
    options.sink_tokens = p.sink_tokens;
    for (const double sink : p.sinks)
      options.sinks.push_back(static_cast<S>(sink));
    if (p.keep_dims[0] > 0) {
      keep.resize(p.keep_dims[0], p.keep_dims[1], p.keep_dims[2], p.keep_dims[3]);
      for (Index n = 0; n < keep.size(); ++n)
        keep.data()[n] = p.keep[static_cast<std::size_t>(n)];
      options.keep_mask = attn::Broadcast<bool>(keep.data(), p.keep_dims);
    }
    if (p.bias_dims[0] > 0)
      options.bias = attn::Broadcast<S>(bias.data(), p.bias_dims);
    for (const double slope : p.alibi)
      options.alibi_slopes.push_back(static_cast<S>(slope));
    if (p.softcap != 0 || p.invalid == Invalid::softcap)
      options.softcap = static_cast<S>(p.softcap);
    if (p.scale != 0)
      options.scale = static_cast<S>(p.scale);
    options.query_tile = p.query_tile;
    options.key_tile = p.key_tile;
    set_mods(p, p.q_length, p.k_length, options);
  }

  /// Runs one kernel; returns the exception message, or "" when it did not throw.
  std::string run(const Problem& p, attn::Algorithm algorithm) {
    options.algorithm = algorithm;
    out.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length * p.out_dim), S(-7));
    lse.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length), S(-7));
    try {
      attn::scaled_dot_product_attention_into<S>(
          attn::bhld_view<const S>(q.data(), p.batch, p.q_heads, p.q_length, p.dim),
          attn::bhld_view<const S>(k.data(), p.k_batch, p.kv_heads, p.k_length, p.k_dim),
          attn::bhld_view<const S>(v.data(), p.k_batch, p.kv_heads, p.v_length, p.value_dim),
          attn::AttentionOutputViews{
              attn::bhld_view<S>(out.data(), p.batch, p.q_heads, p.q_length, p.out_dim),
              attn::bhl_view(lse.data(), p.batch, p.q_heads, p.q_length)},
          options);
    } catch (const std::invalid_argument& e) {
      return std::string("invalid_argument: ") + e.what();
    } catch (const std::exception& e) {
      return std::string("other exception: ") + e.what();
    }
    return "";
  }

  /// Runs one kernel through the packed entry point on the same sequences (n_q(b) queries,
  /// n_k(b) keys each), its output laid out as run()'s: padding query rows hold 0 and a
  /// log-sum-exp of -inf (the sink with one), as the reference has them.
  std::string run_packed(const Problem& p, attn::Algorithm algorithm) {
    const auto length = [](const std::vector<Index>& lengths, Index b, Index full) {
      return lengths.empty() ? full : lengths[static_cast<std::size_t>(b)];
    };
    std::vector<Index> cu_q{0}, cu_k{0};
    for (Index b = 0; b < p.batch; ++b) {
      cu_q.push_back(cu_q.back() + length(p.query_lengths, b, p.q_length));
      cu_k.push_back(cu_k.back() + length(p.key_lengths, b, p.k_length));
    }
    packed.cu_q = cu_q;
    packed.cu_k = cu_k;
    packed.q = pack_tokens(q, cu_q, p.q_heads, p.q_length, p.dim);
    packed.k = pack_tokens(k, cu_k, p.kv_heads, p.k_length, p.dim);
    packed.v = pack_tokens(v, cu_k, p.kv_heads, p.k_length, p.value_dim);
    const std::vector<S>&qp = packed.q, &kp = packed.k, &vp = packed.v;
    std::vector<S>& op = packed.out;
    std::vector<S>& lp = packed.lse;
    op.assign(static_cast<std::size_t>(cu_q.back() * p.q_heads * p.value_dim), S(-7));
    lp.assign(static_cast<std::size_t>(cu_q.back() * p.q_heads), S(-7));
    attn::AttentionOptions<S> packed_options = options;
    packed_options.algorithm = algorithm;
    packed_options.key_lengths.clear();
    packed_options.query_lengths.clear();
    // The mods see positions within each sequence; a block mask has the longest's sizes.
    Index longest_q = 0, longest_k = 0;
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      longest_q = std::max(longest_q, cu_q[b + 1] - cu_q[b]);
      longest_k = std::max(longest_k, cu_k[b + 1] - cu_k[b]);
    }
    packed_options.mask_mod = {};
    packed_options.block_mask = {};
    packed_options.score_mod = {};
    set_mods(p, longest_q, longest_k, packed_options);
    packed.options = packed_options;
    try {
      attn::scaled_dot_product_attention_into<S>(
          attn::packed_view(attn::blhd_view<const S>(qp.data(), 1, cu_q.back(), p.q_heads, p.dim),
                            cu_q),
          attn::packed_view(attn::blhd_view<const S>(kp.data(), 1, cu_k.back(), p.kv_heads, p.dim),
                            cu_k),
          attn::packed_view(
              attn::blhd_view<const S>(vp.data(), 1, cu_k.back(), p.kv_heads, p.value_dim), cu_k),
          attn::AttentionOutputViews{
              attn::packed_view(
                  attn::blhd_view<S>(op.data(), 1, cu_q.back(), p.q_heads, p.value_dim), cu_q),
              attn::packed_view(attn::bhl_view(lp.data(), 1, p.q_heads, cu_q.back()), cu_q)},
          packed_options);
    } catch (const std::invalid_argument& e) {
      return std::string("invalid_argument: ") + e.what();
    } catch (const std::exception& e) {
      return std::string("other exception: ") + e.what();
    }
    out.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length * p.value_dim), S(0));
    lse.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length),
               -std::numeric_limits<S>::infinity());
    for (Index b = 0; b < p.batch; ++b) {
      const Index first = cu_q[static_cast<std::size_t>(b)];
      for (Index h = 0; h < p.q_heads; ++h) {
        for (Index i = 0; i < p.q_length; ++i) {
          const std::size_t row = static_cast<std::size_t>((b * p.q_heads + h) * p.q_length + i);
          if (i >= cu_q[static_cast<std::size_t>(b) + 1] - first) {
            if (!p.sinks.empty())
              lse[row] = static_cast<S>(p.sinks[static_cast<std::size_t>(h)]);
            continue;
          }
          lse[row] = lp[static_cast<std::size_t>(h * cu_q.back() + first + i)];
          for (Index e = 0; e < p.value_dim; ++e)
            out[row * static_cast<std::size_t>(p.value_dim) + static_cast<std::size_t>(e)] =
                op[static_cast<std::size_t>(((first + i) * p.q_heads + h) * p.value_dim + e)];
        }
      }
    }
    return "";
  }

  std::string run_linear(const Problem& p, std::vector<S>& result) {
    attn::LinearAttentionOptions<S> linear;
    linear.causal = p.causal;
    linear.key_lengths = p.key_lengths;
    linear.chunk = p.query_tile;
    result.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length * p.out_dim), S(-7));
    try {
      attn::linear_attention_into<S>(
          attn::bhld_view<const S>(q.data(), p.batch, p.q_heads, p.q_length, p.dim),
          attn::bhld_view<const S>(k.data(), p.k_batch, p.kv_heads, p.k_length, p.k_dim),
          attn::bhld_view<const S>(v.data(), p.k_batch, p.kv_heads, p.v_length, p.value_dim),
          attn::bhld_view<S>(result.data(), p.batch, p.q_heads, p.q_length, p.out_dim), linear);
    } catch (const std::invalid_argument& e) {
      return std::string("invalid_argument: ") + e.what();
    } catch (const std::exception& e) {
      return std::string("other exception: ") + e.what();
    }
    return "";
  }
};

/// Per output row: which elements NaN must reach, which are compared, and the error terms.
/// NaN in a score reaches the whole row; NaN in v[j, e] only column e.
struct RowRule {
  std::vector<char> must_be_nan;  // (Dv)
  std::vector<char> compared;     // (Dv)
  bool sees_keys = false;
  bool any_nan = false;    // a NaN score: the log-sum-exp is not compared
  double value_max = 0;    // max |v| over the visible keys
  double logit_scale = 0;  // S: the largest |term| of a visible logit
};

/// The problem as the independent reference describes it, its numbers as T sees them.
template <class T>
attn_test::reference::Problem reference_problem(const Problem& p) {
  using attn_test::reference::Causal;
  attn_test::reference::Problem r;
  r.batch = p.batch;
  r.q_heads = p.q_heads;
  r.kv_heads = p.kv_heads;
  r.q_length = p.q_length;
  r.k_length = p.k_length;
  r.dim = p.dim;
  r.value_dim = p.value_dim;
  r.causal = p.causal == attn::Causal::top_left       ? Causal::top_left
             : p.causal == attn::Causal::bottom_right ? Causal::bottom_right
                                                      : Causal::none;
  r.window_left = p.window.left;
  r.window_right = p.window.right;
  r.key_lengths = p.key_lengths;
  if (p.keep_dims[0] > 0) {
    r.keep.dims = p.keep_dims;
    r.keep.data = p.keep;
  }
  if (p.bias_dims[0] > 0) {
    r.bias.dims = p.bias_dims;
    r.bias.data.assign(p.bias.begin(), p.bias.end());
  }
  r.alibi_slopes.assign(p.alibi.begin(), p.alibi.end());
  if (p.softcap != 0)
    r.softcap = p.softcap;
  r.query_lengths = p.query_lengths;
  r.sink_tokens = p.sink_tokens;
  r.sinks.assign(p.sinks.begin(), p.sinks.end());
  if (p.scale != 0)
    r.scale = p.scale;
  // The same functions, the score_mod in long double (its tables already hold T's numbers).
  const Problem* const problem = &p;
  if (p.has_mask_mod())
    r.mask_mod = [problem](Index b, Index h, Index i, Index j) {
      return problem->mask_visible(b, h, i, j);
    };
  if (p.has_score_mod())
    r.score_mod = [problem](long double s, Index b, Index h, Index i, Index j) {
      return problem->score_mod<long double>(s, b, h, i, j);
    };
  attn_test::round_numbers_to<T>(r);
  return r;
}

std::vector<RowRule> row_rules(const Problem& p) {
  // The reference's visibility rule, written from the docs, not attn's Mask.
  const attn_test::reference::Problem mask = reference_problem<double>(p);
  const auto bias_at = [&](Index b, Index h, Index i, Index j) {
    if (p.bias.empty())
      return 0.0;
    const auto& d = p.bias_dims;
    const Index n =
        (((d[0] == 1 ? 0 : b) * d[1] + (d[1] == 1 ? 0 : h)) * d[2] + (d[2] == 1 ? 0 : i)) * d[3] +
        (d[3] == 1 ? 0 : j);
    return p.bias[static_cast<std::size_t>(n)];
  };
  const double scale = std::abs(p.scale != 0 ? p.scale : 1 / std::sqrt(static_cast<double>(p.dim)));
  const Index group = p.q_heads / p.kv_heads;
  std::vector<RowRule> rules(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
  for (Index b = 0; b < p.batch; ++b) {
    for (Index h = 0; h < p.q_heads; ++h) {
      const Index g = h / group;
      const double* v_head = p.v.data() + (b * p.kv_heads + g) * p.k_length * p.value_dim;
      std::vector<char> nan_in_column(static_cast<std::size_t>(p.value_dim), 0);
      for (Index n = 0; n < p.k_length * p.value_dim; ++n) {
        if (std::isnan(v_head[n]))
          nan_in_column[static_cast<std::size_t>(n % p.value_dim)] = 1;
      }
      for (Index i = 0; i < p.q_length; ++i) {
        RowRule& rule = rules[static_cast<std::size_t>((b * p.q_heads + h) * p.q_length + i)];
        const double* q_row = p.q.data() + ((b * p.q_heads + h) * p.q_length + i) * p.dim;
        bool nan_score = false, finite_score = false;
        std::vector<char> nan_visible_value(static_cast<std::size_t>(p.value_dim), 0);
        for (Index j = 0; j < p.k_length; ++j) {
          if (!mask.visible(b, h, i, j))
            continue;
          rule.sees_keys = true;
          const double* k_row = p.k.data() + ((b * p.kv_heads + g) * p.k_length + j) * p.dim;
          double dot = 0;
          for (Index d = 0; d < p.dim; ++d)
            dot += std::abs(q_row[d] * k_row[d]);
          const double bias = bias_at(b, h, i, j);
          const double alibi = p.alibi.empty()
                                   ? 0.0
                                   : p.alibi[static_cast<std::size_t>(h)] *
                                         static_cast<double>(std::abs(mask.diagonal(b, i) - j));
          // What the score_mod makes of a finite score (1) or of NaN: NaN (the NaN pair),
          // -inf (a -inf in the table, which softcap maps to -softcap) or finite.
          const double stand_in = std::isnan(dot) ? std::numeric_limits<double>::quiet_NaN() : 1.0;
          const double modded = p.has_score_mod() ? p.score_mod(stand_in, b, h, i, j) : stand_in;
          const bool hidden_by_mod =
              modded == -std::numeric_limits<double>::infinity() && p.softcap == 0;
          if (std::isnan(modded) || std::isnan(bias) ||
              bias == std::numeric_limits<double>::infinity())
            nan_score = true;
          else if (bias != -std::numeric_limits<double>::infinity() && !hidden_by_mod)
            finite_score = true;
          if (std::isfinite(dot))
            rule.logit_scale =
                std::max(rule.logit_scale, scale * dot * std::abs(p.score_multiplied(h)));
          if (std::isfinite(p.score_added(h, i, j)))
            rule.logit_scale = std::max(rule.logit_scale, std::abs(p.score_added(h, i, j)));
          if (std::isfinite(bias))
            rule.logit_scale = std::max(rule.logit_scale, std::abs(bias));
          rule.logit_scale = std::max(rule.logit_scale, alibi);
          for (Index e = 0; e < p.value_dim; ++e) {
            const double x = v_head[j * p.value_dim + e];
            if (std::isnan(x))
              nan_visible_value[static_cast<std::size_t>(e)] = 1;
            else
              rule.value_max = std::max(rule.value_max, std::abs(x));
          }
        }
        if (p.softcap != 0)
          rule.logit_scale = std::max(rule.logit_scale, p.softcap);
        rule.must_be_nan.resize(static_cast<std::size_t>(p.value_dim));
        rule.compared.resize(static_cast<std::size_t>(p.value_dim));
        for (std::size_t e = 0; e < rule.compared.size(); ++e) {
          rule.must_be_nan[e] = nan_score || (finite_score && nan_visible_value[e]);
          rule.compared[e] = !rule.must_be_nan[e] && !nan_in_column[e];
        }
        rule.any_nan = nan_score;
      }
    }
  }
  return rules;
}

template <class T>
void check_attention(const Problem& p) {
  Typed<T> typed(p);
  // naive and chunked (Eigen's products), then flash and decode on every instruction set
  // this CPU has, each forced in turn (attn/cpu.hpp): one build fuzzes every path.
  struct Kernel {
    attn::Algorithm algorithm;
    attn::Isa isa;
    std::string name;
  };
  std::vector<Kernel> kernels{{attn::Algorithm::naive, attn::Isa::generic, "naive"},
                              {attn::Algorithm::chunked, attn::Isa::generic, "chunked"}};
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    for (const attn::Algorithm algorithm : {attn::Algorithm::flash, attn::Algorithm::decode}) {
      kernels.push_back({algorithm, isa,
                         std::string(attn::algorithm_name(algorithm)) + "/" + attn::isa_name(isa)});
    }
  }
  const std::size_t padded_kernels = kernels.size();
  // Packed calls of the invalid mods too: the block mask's sizes are checked against the
  // longest sequences.
  if (p.packed && (p.invalid == Invalid::none || is_mod_invalid(p.invalid))) {
    for (std::size_t n = 0; n < padded_kernels; ++n)
      kernels.push_back({kernels[n].algorithm, kernels[n].isa, "packed " + kernels[n].name});
  }
  const int kernel_count = static_cast<int>(kernels.size());
  std::string first_error, first_packed_error;
  std::vector<std::vector<T>> outs(kernels.size()), lses(kernels.size());
  for (int n = 0; n < kernel_count; ++n) {
    const Kernel& kernel = kernels[static_cast<std::size_t>(n)];
    const attn::ScopedIsa forced(kernel.isa);
    const bool packed = static_cast<std::size_t>(n) >= padded_kernels;
    const std::string error =
        packed ? typed.run_packed(p, kernel.algorithm) : typed.run(p, kernel.algorithm);
    const std::string& name = kernel.name;
    if (p.invalid != Invalid::none) {
      const std::string expected = "invalid_argument: scaled_dot_product_attention: ";
      if (error.rfind(expected, 0) != 0)
        fail(p, name + " did not throw std::invalid_argument: '" + error + "'");
      std::string& first = packed ? first_packed_error : first_error;
      if (first.empty())
        first = error;
      else if (error != first)
        fail(p, name + " threw '" + error + "' but " + (packed ? "packed naive" : "naive") + " '" +
                    first + "'");
      continue;
    }
    if (!error.empty())
      fail(p, name + " threw on a valid problem: " + error);
    outs[static_cast<std::size_t>(n)] = typed.out;
    lses[static_cast<std::size_t>(n)] = typed.lse;
  }
  if (p.linear && shared_with_linear(p.invalid)) {
    std::vector<T> ignored;
    const std::string error = typed.run_linear(p, ignored);
    if (error.rfind("invalid_argument: linear_attention: ", 0) != 0)
      fail(p, "linear_attention did not throw std::invalid_argument: '" + error + "'");
  }
  if (p.invalid != Invalid::none)
    return;
  // The truth in long double, and the same loops in T: the error of a plain implementation.
  const attn_test::reference::Problem problem = reference_problem<T>(p);
  const auto exact = [](const std::vector<T>& x) {
    return std::vector<long double>(x.begin(), x.end());
  };
  const std::vector<long double> q = exact(typed.q), k = exact(typed.k), v = exact(typed.v);
  const auto truth = attn_test::reference::attention<long double>(problem, q, k, v);
  const auto plain = attn_test::reference::attention<T>(problem, q, k, v);

  const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
  const std::vector<RowRule> rules = row_rules(p);
  const Index dv = p.value_dim;
  for (std::size_t row = 0; row < rules.size(); ++row) {
    const RowRule& rule = rules[row];
    const auto at = [&](const auto& x, Index e) {
      return static_cast<double>(
          x[row * static_cast<std::size_t>(dv) + static_cast<std::size_t>(e)]);
    };
    for (Index e = 0; e < dv; ++e) {
      if (!rule.must_be_nan[static_cast<std::size_t>(e)])
        continue;
      if (!std::isnan(at(truth.out, e)))
        fail(p, "row " + std::to_string(row) + " is reached by NaN but the reference is not");
      for (int n = 0; n < kernel_count; ++n) {
        const std::size_t kernel = static_cast<std::size_t>(n);
        if (!std::isnan(at(outs[kernel], e))) {
          fail(p, kernels[kernel].name + ": row " + std::to_string(row) + " element " +
                      std::to_string(e) + " is reached by NaN but holds " +
                      std::to_string(at(outs[kernel], e)));
        }
      }
    }
    const double logit_error = 2 * static_cast<double>(p.dim + 4) * eps * rule.logit_scale;
    const double floor =
        (32 + 2 * static_cast<double>(p.k_length)) * eps * std::max(1.0, rule.value_max);
    const double cond = 2 * rule.value_max * std::min(1.0, logit_error);
    const auto compared = [&](Index e) { return rule.compared[static_cast<std::size_t>(e)] != 0; };
    double plain_error = 0;
    for (Index e = 0; e < dv; ++e) {
      if (compared(e))
        plain_error = std::max(plain_error, std::abs(at(plain.out, e) - at(truth.out, e)));
    }
    const double lse_expected = static_cast<double>(truth.lse[row]);
    const bool nothing_seen = lse_expected == -std::numeric_limits<double>::infinity();
    // A row without a finite visible score: zeros, log-sum-exp -inf (the sink with one).
    bool no_weight = !rule.any_nan;
    for (Index j = 0; j < p.k_length; ++j)
      no_weight =
          no_weight &&
          truth.weights[row * static_cast<std::size_t>(p.k_length) + static_cast<std::size_t>(j)] ==
              0;
    if (!rule.sees_keys && !(no_weight && (nothing_seen || !p.sinks.empty())))
      fail(p, "row " + std::to_string(row) + " sees no key but the reference gives it weights");
    for (int n = 0; n < kernel_count; ++n) {
      const std::string& name = kernels[static_cast<std::size_t>(n)].name;
      const double bound = 2 * plain_error + floor + cond;
      for (Index e = 0; e < dv; ++e) {
        if (!compared(e))
          continue;
        const double expected = at(truth.out, e), actual = at(outs[static_cast<std::size_t>(n)], e);
        if (!std::isfinite(expected))
          fail(p, "row " + std::to_string(row) + ": the reference is not finite");
        if (!(std::abs(actual - expected) <= bound)) {
          fail(p, std::string(name) + ": row " + std::to_string(row) + " element " +
                      std::to_string(e) + " is " + std::to_string(actual) + ", reference " +
                      std::to_string(expected) + ", bound " + std::to_string(bound));
        }
        if (no_weight && actual != 0.0)
          fail(p, std::string(name) + ": row " + std::to_string(row) + " sees no key, not 0");
      }
      if (rule.any_nan)
        continue;
      const double lse_actual = static_cast<double>(lses[static_cast<std::size_t>(n)][row]);
      if (nothing_seen != (lse_actual == -std::numeric_limits<double>::infinity()) ||
          (!nothing_seen && !(std::abs(lse_actual - lse_expected) <=
                              64 * eps * std::max(std::abs(lse_expected), 1.0) + logit_error))) {
        fail(p, std::string(name) + ": row " + std::to_string(row) + " log-sum-exp " +
                    std::to_string(lse_actual) + ", reference " + std::to_string(lse_expected));
      }
    }
  }
}

/// linear_attention (elu + 1) against its quadratic form in R, head by head.
template <class T, class R>
void check_linear(const Problem& p) {
  Typed<T> typed(p);
  std::vector<T> out;
  const std::string error = typed.run_linear(p, out);
  if (!error.empty())
    fail(p, "linear_attention threw on a valid problem: " + error);
  const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
  const Index group = p.q_heads / p.kv_heads;
  const auto phi = [](double x) {
    return x > 0 ? static_cast<R>(x) + 1 : std::exp(static_cast<R>(x));
  };
  std::vector<R> numerator(static_cast<std::size_t>(p.value_dim));
  for (Index b = 0; b < p.batch; ++b) {
    const Index key_length =
        p.key_lengths.empty() ? p.k_length : p.key_lengths[static_cast<std::size_t>(b)];
    // mask.hpp's per-sequence diagonal.
    const Index offset = p.causal == attn::Causal::top_left ? 0 : key_length - p.q_length;
    for (Index h = 0; h < p.q_heads; ++h) {
      const Index g = h / group;
      double value_max = 0;
      for (Index n = 0; n < p.k_length * p.value_dim; ++n) {
        value_max = std::max(value_max, std::abs(p.v[static_cast<std::size_t>(
                                            (b * p.kv_heads + g) * p.k_length * p.value_dim + n)]));
      }
      const double bound =
          (64 + 4 * static_cast<double>(p.dim + p.k_length)) * eps * std::max(1.0, value_max);
      for (Index i = 0; i < p.q_length; ++i) {
        const double* q_row = p.q.data() + ((b * p.q_heads + h) * p.q_length + i) * p.dim;
        R denominator = 0;
        std::fill(numerator.begin(), numerator.end(), R(0));
        for (Index j = 0; j < key_length; ++j) {
          if (p.causal != attn::Causal::none && j > i + offset)
            continue;
          const double* k_row = p.k.data() + ((b * p.kv_heads + g) * p.k_length + j) * p.dim;
          R a = 0;
          for (Index d = 0; d < p.dim; ++d)
            a += phi(q_row[d]) * phi(k_row[d]);
          denominator += a;
          for (Index e = 0; e < p.value_dim; ++e)
            numerator[static_cast<std::size_t>(e)] +=
                a * static_cast<R>(p.v[static_cast<std::size_t>(
                        ((b * p.kv_heads + g) * p.k_length + j) * p.value_dim + e)]);
        }
        denominator += static_cast<R>(1e-6);
        for (Index e = 0; e < p.value_dim; ++e) {
          const double expected =
              static_cast<double>(numerator[static_cast<std::size_t>(e)] / denominator);
          const double actual = static_cast<double>(out[static_cast<std::size_t>(
              ((b * p.q_heads + h) * p.q_length + i) * p.value_dim + e)]);
          if (!(std::abs(actual - expected) <= bound)) {
            fail(p, "linear_attention: (b, h, i, e) = (" + std::to_string(b) + ", " +
                        std::to_string(h) + ", " + std::to_string(i) + ", " + std::to_string(e) +
                        ") is " + std::to_string(actual) + ", quadratic form " +
                        std::to_string(expected) + ", bound " + std::to_string(bound));
          }
        }
      }
    }
  }
}

/// Packed problems: the packed backward, naive and flash on every instruction set, from the
/// packed naive forward, against the padded naive backward on each sequence's rows (expected:
/// its dq, dk, dv and dsinks), within check_backward's bound.
template <class T>
void check_packed_backward(const Problem& p, Typed<T>& typed, const std::vector<T>& dout,
                           const std::vector<T>& dq, const std::vector<T>& dk,
                           const std::vector<T>& dv, const std::vector<T>& dsinks,
                           double relative) {
  if (!typed.run_packed(p, attn::Algorithm::naive).empty())
    fail(p, "the packed naive forward threw before the packed backward");
  const auto& x = typed.packed;
  const Index tq = x.cu_q.back(), tk = x.cu_k.back();
  const std::vector<T> dout_tokens = pack_tokens(dout, x.cu_q, p.q_heads, p.q_length, p.value_dim);
  const std::vector<T> expected[] = {pack_tokens(dq, x.cu_q, p.q_heads, p.q_length, p.dim),
                                     pack_tokens(dk, x.cu_k, p.kv_heads, p.k_length, p.dim),
                                     pack_tokens(dv, x.cu_k, p.kv_heads, p.k_length, p.value_dim),
                                     dsinks};
  const auto q_side = [&](const std::vector<T>& v, Index h, Index d) {  // (Tq, h, d), packed
    return attn::packed_view(attn::blhd_view(v.data(), 1, tq, h, d), x.cu_q);
  };
  const auto k_side = [&](const std::vector<T>& v, Index h, Index d) {  // (Tk, h, d), packed
    return attn::packed_view(attn::blhd_view(v.data(), 1, tk, h, d), x.cu_k);
  };
  const auto run = [&](attn::Algorithm algorithm, const std::string& name) {
    std::vector<T> g[4] = {std::vector<T>(x.q.size()), std::vector<T>(x.k.size()),
                           std::vector<T>(x.v.size()), std::vector<T>(p.sinks.size())};
    attn::AttentionOptions<T> options = x.options;
    options.algorithm = algorithm;
    attn::AttentionGradientViews<T> grads{
        attn::packed_view(attn::blhd_view(g[0].data(), 1, tq, p.q_heads, p.dim), x.cu_q),
        attn::packed_view(attn::blhd_view(g[1].data(), 1, tk, p.kv_heads, p.dim), x.cu_k),
        attn::packed_view(attn::blhd_view(g[2].data(), 1, tk, p.kv_heads, p.value_dim), x.cu_k)};
    if (!g[3].empty())
      grads.dsinks.emplace(g[3].data(), static_cast<Index>(g[3].size()));
    attn::scaled_dot_product_attention_backward_into<T>(
        q_side(x.q, p.q_heads, p.dim), k_side(x.k, p.kv_heads, p.dim),
        k_side(x.v, p.kv_heads, p.value_dim), q_side(x.out, p.q_heads, p.value_dim),
        attn::packed_view(attn::bhl_view(static_cast<const T*>(x.lse.data()), 1, p.q_heads, tq),
                          x.cu_q),
        q_side(dout_tokens, p.q_heads, p.value_dim), grads, options);
    const char* names[] = {"dq", "dk", "dv", "dsinks"};
    for (int n = 0; n < 4; ++n) {
      const std::vector<T>&a = g[n], &e = expected[n];
      double largest = 1;
      for (const T y : e) {
        if (std::isfinite(static_cast<double>(y)))
          largest = std::max(largest, std::abs(static_cast<double>(y)));
      }
      for (std::size_t m = 0; m < e.size(); ++m) {
        const double error = std::abs(static_cast<double>(a[m]) - static_cast<double>(e[m]));
        if (!(error <= relative * largest)) {
          fail(p, name + ": " + names[n] + "[" + std::to_string(m) + "] is " +
                      std::to_string(static_cast<double>(a[m])) + ", padded naive " +
                      std::to_string(static_cast<double>(e[m])) + ", bound " +
                      std::to_string(relative * largest));
        }
      }
    }
  };
  run(attn::Algorithm::naive, "packed naive backward");
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const attn::ScopedIsa forced(isa);
    run(attn::Algorithm::flash, std::string("packed flash backward/") + attn::isa_name(isa));
  }
}

/// The flash backward on every instruction set against the naive backward, from the naive
/// forward's out and log-sum-exp, for valid problems without NaN or large values:
///   |flash - naive| <= (64 + 4 (Lq + Lk + D + Dv)) eps (1 + S) max(1, max |naive|)
/// per gradient (dq, dk, dv, dbias, dsinks), S the largest |term| of a visible logit;
/// elements the naive backward leaves NaN (rows with a +inf bias) are not compared.
template <class T>
void check_backward(const Problem& p) {
  Typed<T> typed(p);
  if (!typed.run(p, attn::Algorithm::naive).empty())
    fail(p, "the naive forward threw before the backward");
  const auto view = [](std::vector<T>& x, Index b, Index h, Index l, Index d) {
    return attn::bhld_view(x.data(), b, h, l, d);
  };
  const auto cview = [](const std::vector<T>& x, Index b, Index h, Index l, Index d) {
    return attn::bhld_view(x.data(), b, h, l, d);
  };
  std::vector<T> dout(typed.out.size());
  for (std::size_t n = 0; n < dout.size(); ++n)
    dout[n] = static_cast<T>(std::cos(0.7 * static_cast<double>(n)));
  struct Gradients {
    std::vector<T> dq, dk, dv, dbias, dsinks;
  };
  const auto backward = [&](attn::Algorithm algorithm) {
    Gradients g;
    g.dq.resize(typed.q.size());
    g.dk.resize(typed.k.size());
    g.dv.resize(typed.v.size());
    g.dbias.resize(typed.bias.size());
    g.dsinks.resize(p.sinks.size());
    attn::AttentionOptions<T> options = typed.options;
    options.algorithm = algorithm;
    attn::AttentionGradientViews<T> grads{view(g.dq, p.batch, p.q_heads, p.q_length, p.dim),
                                          view(g.dk, p.batch, p.kv_heads, p.k_length, p.dim),
                                          view(g.dv, p.batch, p.kv_heads, p.k_length, p.value_dim)};
    if (!g.dbias.empty()) {
      const std::array<Index, 4>& d = options.bias.dims();
      grads.dbias = attn::bhld_view(g.dbias.data(), d[0], d[1], d[2], d[3]);
    }
    if (!g.dsinks.empty())
      grads.dsinks.emplace(g.dsinks.data(), static_cast<Index>(g.dsinks.size()));
    attn::scaled_dot_product_attention_backward_into<T>(
        cview(typed.q, p.batch, p.q_heads, p.q_length, p.dim),
        cview(typed.k, p.batch, p.kv_heads, p.k_length, p.dim),
        cview(typed.v, p.batch, p.kv_heads, p.k_length, p.value_dim),
        cview(typed.out, p.batch, p.q_heads, p.q_length, p.value_dim),
        attn::bhl_view(static_cast<const T*>(typed.lse.data()), p.batch, p.q_heads, p.q_length),
        cview(dout, p.batch, p.q_heads, p.q_length, p.value_dim), grads, options);
    return g;
  };
  const Gradients expected = backward(attn::Algorithm::naive);
  double logit_scale = 0;
  for (const RowRule& rule : row_rules(p))
    logit_scale = std::max(logit_scale, rule.logit_scale);
  const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
  const double relative =
      (64 + 4 * static_cast<double>(p.q_length + p.k_length + p.dim + p.value_dim)) * eps *
      (1 + logit_scale);
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const attn::ScopedIsa forced(isa);
    const Gradients actual = backward(attn::Algorithm::flash);
    const auto compare = [&](const char* name, const std::vector<T>& a, const std::vector<T>& e) {
      double largest = 1;
      for (const T x : e) {
        if (std::isfinite(static_cast<double>(x)))
          largest = std::max(largest, std::abs(static_cast<double>(x)));
      }
      for (std::size_t n = 0; n < e.size(); ++n) {
        if (std::isnan(static_cast<double>(e[n])))
          continue;  // a +inf bias makes its row NaN; where else NaN reaches is unspecified
        const double error = std::abs(static_cast<double>(a[n]) - static_cast<double>(e[n]));
        if (!(error <= relative * largest)) {
          fail(p, std::string("flash backward/") + attn::isa_name(isa) + ": " + name + "[" +
                      std::to_string(n) + "] is " + std::to_string(static_cast<double>(a[n])) +
                      ", naive " + std::to_string(static_cast<double>(e[n])) + ", bound " +
                      std::to_string(relative * largest));
        }
      }
    };
    compare("dq", actual.dq, expected.dq);
    compare("dk", actual.dk, expected.dk);
    compare("dv", actual.dv, expected.dv);
    compare("dbias", actual.dbias, expected.dbias);
    compare("dsinks", actual.dsinks, expected.dsinks);
  }
  if (p.packed)
    check_packed_backward(p, typed, dout, expected.dq, expected.dk, expected.dv, expected.dsinks,
                          relative);
}

/// The backward refuses a score_mod (attn/attention_backward.hpp: forward only).
template <class T>
void check_backward_refuses_score_mod(const Problem& p) {
  Typed<T> typed(p);
  if (!typed.run(p, attn::Algorithm::naive).empty())
    fail(p, "the naive forward threw before the backward");
  std::vector<T> dout(typed.out.size(), T(1)), dq(typed.q.size()), dk(typed.k.size()),
      dv(typed.v.size());
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    attn::AttentionOptions<T> options = typed.options;
    options.algorithm = algorithm;
    std::string error = "nothing";
    try {
      attn::scaled_dot_product_attention_backward_into<T>(
          attn::bhld_view<const T>(typed.q.data(), p.batch, p.q_heads, p.q_length, p.dim),
          attn::bhld_view<const T>(typed.k.data(), p.batch, p.kv_heads, p.k_length, p.dim),
          attn::bhld_view<const T>(typed.v.data(), p.batch, p.kv_heads, p.k_length, p.value_dim),
          attn::bhld_view<const T>(typed.out.data(), p.batch, p.q_heads, p.q_length, p.value_dim),
          attn::bhl_view(static_cast<const T*>(typed.lse.data()), p.batch, p.q_heads, p.q_length),
          attn::bhld_view<const T>(dout.data(), p.batch, p.q_heads, p.q_length, p.value_dim),
          {attn::bhld_view<T>(dq.data(), p.batch, p.q_heads, p.q_length, p.dim),
           attn::bhld_view<T>(dk.data(), p.batch, p.kv_heads, p.k_length, p.dim),
           attn::bhld_view<T>(dv.data(), p.batch, p.kv_heads, p.k_length, p.value_dim)},
          options);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("other exception: ") + e.what();
    }
    if (error.rfind("scaled_dot_product_attention_backward: options.score_mod is forward only",
                    0) != 0) {
      fail(p, std::string("the ") + attn::algorithm_name(algorithm) +
                  " backward with a score_mod did not throw std::invalid_argument: '" + error +
                  "'");
    }
  }
}

template <class T, class R>
void check(const Problem& p) {
  check_attention<T>(p);
  // The backward needs the forward's own shapes (the invalid-shape problems have others);
  // it takes mask_mod and block_mask, and refuses a score_mod.
  if (p.invalid == Invalid::none && p.has_score_mod())
    check_backward_refuses_score_mod<T>(p);
  else if (p.invalid == Invalid::none && !p.has_nan && !p.large)
    check_backward<T>(p);
  if (p.linear && p.invalid == Invalid::none && !p.has_nan && !p.large)
    check_linear<T, R>(p);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Problem p = decode(data, size);
  if (p.use_double)
    check<double, long double>(p);
  else
    check<float, double>(p);
  return 0;
}
