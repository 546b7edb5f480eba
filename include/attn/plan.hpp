// attn/plan.hpp: the one place that decides how an attention call runs.
//
// plan_attention() turns the problem (shapes, scalar, options) and the CPU into a
// KernelPlan: the algorithm, the instruction set of its products, the tiles and the work
// items. scaled_dot_product_attention, KVCache::attend and MultiHeadAttention all run
// through it (linear attention through plan_linear_attention(), the GEMM and RoPE through
// plan_gemm() and plan_rope()); describe() says what was chosen:
//
//   attn::plan_attention<float>({1, 8, 8, 4096, 4096, 64, 64}, options).describe()
//   "flash on avx512 (float): query tiles of 128, key tiles of 256; 256 work items
//    (B * Hq * query tiles) on 2 threads"
//
// Thresholds are keyed by instruction set and scalar and were measured with
// bench/bench_attention.cpp and bench/bench_decode.cpp (docs/performance.md).
#pragma once

#include <algorithm>
#include <array>
#include <string>
#include <type_traits>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/options.hpp"

namespace attn {

/// The shape of one attention problem: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv).
struct AttentionShape {
  Index batch = 0, q_heads = 0, kv_heads = 0, q_length = 0, k_length = 0, dim = 0, value_dim = 0;
  /// Bytes of one stored element of k and v (2 for half and bfloat16); 0: the compute
  /// scalar's. The automatic choice depends on it (decode streams K and V).
  Index kv_element_bytes = 0;
  /// Whether K or V is stored in quantized blocks (q8_0, q4_0; kv_element_bytes then 1):
  /// only decode and flash read them, and the automatic choice is quantized_decode_max_queries.
  bool kv_quantized = false;
  /// Whether K and V lie in pages (attn/paged_kv_cache.hpp): only decode and flash read
  /// them, decode taking up to decode_max_queries (or quantized_decode_max_queries) queries.
  bool kv_paged = false;
  /// Whether a causal mask hides the keys above each query's diagonal: flash then takes
  /// shorter query tiles (default_query_tile).
  bool causal = false;
  /// Whether k and v are stored as float or bfloat16, the storage bf16 products read (half
  /// and quantized blocks are not rounded to bfloat16 again).
  bool bf16_readable_kv = false;
  /// Whether k is stored in q8_0 or q4_0 blocks, the keys int8 products read.
  bool k_int8_readable = false;
};

/// How one attention call runs.
struct KernelPlan {
  Algorithm algorithm = Algorithm::naive;  ///< never automatic
  /// The instruction set of everything the call dispatches: flash's and decode's products,
  /// the widening of 16-bit data, the mods' tile loops (naive and chunked run Eigen's
  /// products whatever it is).
  Isa isa = Isa::generic;
  const char* scalar = "float";  ///< the compute scalar
  Index query_tile = 0;          ///< chunked, flash: query rows per work item
  Index key_tile = 0;            ///< flash: keys per tile
  Index split_keys = 0;          ///< decode: keys per work item (merged by log-sum-exp)
  Index key_block = 0;           ///< decode: keys per block inside a split
  Index work_items = 0;          ///< independent items handed to the threads
  bool parallel = false;         ///< whether the call opens a parallel region (big enough to pay)
  int threads = 1;               ///< threads the call may use
  /// flash: q k^T and P V on bf16 dot products with float sums (ComputePrecision::bf16)
  bool bf16_products = false;
  /// q k^T on int8 products (ComputePrecision::int8): decode over keys in q8_0 or q4_0 blocks,
  /// the queries quantized; flash over keys in any storage, keys and queries quantized
  bool int8_products = false;

  std::string describe() const {
    std::string s = std::string(algorithm_name(algorithm)) + " on " + isa_name(isa) + " (" +
                    scalar + (bf16_products ? ", bf16 products" : "") +
                    (int8_products ? ", int8 products" : "") + "): ";
    switch (algorithm) {
      case Algorithm::flash:
        s += "query tiles of " + std::to_string(query_tile) + ", key tiles of " +
             std::to_string(key_tile) + "; " + std::to_string(work_items) +
             " work items (B * Hq * query tiles)";
        break;
      case Algorithm::chunked:
        s += "query blocks of " + std::to_string(query_tile) + "; " + std::to_string(work_items) +
             " work items (B * Hq * query blocks)";
        break;
      case Algorithm::decode:
        s += "splits of " + std::to_string(split_keys) + " keys in blocks of " +
             std::to_string(key_block) + "; " + std::to_string(work_items) +
             " work items (B * Hkv * splits)";
        break;
      default:
        s += "the whole (Lq, Lk) scores per head; " + std::to_string(work_items) +
             " work items (B * Hq)";
        break;
    }
    return s + " on " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }
};

/// Keys per split of the decode kernel: the unit of parallel work and of the merge.
inline constexpr Index decode_split_keys = 512;
/// Keys per block inside a split (scored and accumulated together).
inline constexpr Index decode_key_block = 64;

/// Where the automatic choice changes kernel, measured per instruction set and K/V storage
/// with bench/bench_plan.cpp's plan_sweep: every algorithm timed in interleaved rounds at
/// Lq 1 to 64, Lk 64 to 32768, D = 128, Hq = Hkv = 8 and GQA 32/8, float and half K/V, on an
/// Intel Xeon with AVX-512 (each instruction set forced in turn; the figures are in
/// docs/performance.md, "How the plan chooses"):
///   - naive (Eigen's products on whole score rows) never won on the vector paths (1.4 to 9.7
///     times decode's time below Lk = 4096, where the old rule sent every problem of at most
///     64 * 64 scores); on the generic path it wins for a single query row per kv head;
///   - decode reads K and V once per kv head for all G * Lq rows of its group, flash once per
///     query head with its queries padded to whole vectors: decode leads for few queries, and
///     for more when flash's G passes over a kv head's K and V no longer hit the cache.
struct AutomaticChoice {
  /// G * Lq at most this (the query rows of one kv head): naive.
  Index naive_max_rows;
  /// Lq at most this: decode, when flash's passes over one kv head's K and V (G times its
  /// keys and values) read at most flash_cached_bytes...
  Index decode_max_queries_cached;
  /// ...and when they read more.
  Index decode_max_queries_streamed;
};

/// The bytes flash reads per kv head, G * Lk * (D + Dv) * sizeof(K/V), up to which the choice
/// counts them as cached. 8 MiB on the Xeon the crossovers were measured on (2 MiB of L2 per
/// core): below it the two kernels were within 5% of each other at the crossovers of three
/// runs, above it decode led by up to 40%; with the bytes of one kv head (G = 1) as the
/// measure, the worst choice in those runs was 1.33x the fastest.
inline constexpr double flash_cached_bytes = 8 * 1024 * 1024;

/// The crossovers of `isa` with K and V stored in 16 bits (half, bfloat16) or not.
inline AutomaticChoice automatic_choice(Isa isa, bool kv_16bit) {
  switch (float_kernels_isa(isa)) {
    case Isa::avx512_vnni:  // (float_kernels_isa gives avx512)
    case Isa::avx512_bf16:
    case Isa::avx512:
      return kv_16bit ? AutomaticChoice{0, 8, 8} : AutomaticChoice{0, 8, 16};
    case Isa::avx2:
      return kv_16bit ? AutomaticChoice{0, 8, 8} : AutomaticChoice{0, 4, 8};
    case Isa::generic:
      break;
  }
  // Eigen's products on all: decode's blocks of G * Lq rows beat flash's tiles to Lq = 64
  // (0.86-0.93 of its time; its partial results grow with Lq * Lk, so no further); naive's
  // matrix-vector products win for one row against float K/V, but it widens 16-bit K/V
  // whole first (1.8x decode's time at Lk = 16384).
  return kv_16bit ? AutomaticChoice{0, 64, 64} : AutomaticChoice{1, 64, 64};
}

/// Algorithm::automatic uses the decode kernel for at most this many queries per head (and
/// naive where G * Lq <= naive_max_rows), flash above; `flash_bytes` = G * Lk * (D + Dv) *
/// sizeof(K/V).
inline Index decode_max_queries(Isa isa, bool kv_16bit, double flash_bytes) {
  const AutomaticChoice choice = automatic_choice(isa, kv_16bit);
  return flash_bytes <= flash_cached_bytes ? choice.decode_max_queries_cached
                                           : choice.decode_max_queries_streamed;
}

/// Algorithm::automatic over quantized K/V (KVCache<BlockQ8_0>, ...): decode, which
/// dequantizes each vector in registers once per kv head for all G * Lq rows, for at most
/// this many queries per head; above, flash, which dequantizes a key tile at a time into its
/// workspace and multiplies tiles. Measured with bench_decode's prefill_formats on Zen 4
/// (AVX-512; Lk = 4096, D = 128, Hq = Hkv = 8 and GQA 32/8, q8_0 and q4_0, docs/performance.md
/// "Chunked prefill from a quantized cache"): decode led up to Lq = 8 (1.5-1.8x at 8), flash
/// from 16 (1.1-1.3x). Decode on int8 products (`int8_products`: ComputePrecision::int8 where
/// the plan would grant them) leads further: on the Xeon 2.0-2.4x flash's speed at 8,
/// 1.02-1.21x at 16, 0.82-0.93x at 32. AVX2 takes the AVX-512 crossover and generic its 16-bit
/// rule, neither measured with blocks.
inline Index quantized_decode_max_queries(Isa isa, bool int8_products = false) {
  switch (float_kernels_isa(isa)) {
    case Isa::avx512_vnni:  // (float_kernels_isa gives avx512)
    case Isa::avx512_bf16:
    case Isa::avx512:
    case Isa::avx2:
      return int8_products ? 16 : 8;
    case Isa::generic:
      break;
  }
  return 64;
}

/// Flash on int8 products (ComputePrecision::int8) quantizes the keys of a kv head once per
/// thread, O(Lk D), and gains on every query row that reads them: it takes calls with at least
/// this many query rows per kv head (G Lq) and leaves the others on fp32 products. Measured
/// on the Xeon (bench_decode's prefill_formats_int8, Lk = 4096, D = 128, q8_0 and q4_0, one
/// thread, against flash on fp32 products; docs/performance.md): with this rule off, 0.36-0.63x
/// at 16 rows, 0.74-0.80x at 32, 0.95-1.37x at 64; with it, 1.07-1.46x at 128 and 1.34-1.59x
/// at 256 and more.
inline constexpr Index int8_flash_min_rows = 128;

/// Flash tiles (query rows, keys) by instruction set, measured with bench_attention's
/// flash_tiles at D = 64 and 128 (docs/performance.md, "Tuning"). Causal attention takes 64
/// query rows: a tile on the diagonal computes every score of its key tiles and masks
/// the hidden ones, so shorter tiles waste less, and the work items (whose costs grow along
/// the diagonal) are finer for the threads to share. On the Xeon and on Zen 4, 64 rows took
/// about 0.93 of 128's time causal and the same time non-causal.
inline Index default_query_tile(Isa /*isa*/, bool causal = false) {
  return causal ? 64 : 128;
}
inline Index default_key_tile(Isa /*isa*/) {
  return 256;
}
/// Query rows per block of the chunked kernel.
inline constexpr Index default_chunk_rows = 64;

/// A call of fewer FLOPs than this runs on the calling thread: opening a parallel region
/// costs more than it saves.
inline constexpr double parallel_flops = 1e6;

namespace detail {
/// Whether a call of `flops` FLOPs over `work_items` independent items opens a parallel
/// region (KernelPlan::parallel): the rule of every kernel's item loop (kernels/item_loop.hpp).
inline bool runs_parallel(Index work_items, double flops) {
  return work_items > 1 && flops > parallel_flops;
}
}  // namespace detail

template <class T>
constexpr const char* scalar_name() {
  if constexpr (std::is_same_v<T, float>)
    return "float";
  else if constexpr (std::is_same_v<T, double>)
    return "double";
  else
    return "long double";
}

/// The instruction set of a call computing in T: active_isa() (attn/cpu.hpp) for float, generic
/// for every other scalar. Read once per call, by its plan: the only reader of active_isa(),
/// so one call never runs two instruction sets, whatever set_isa() does meanwhile.
template <class T>
Isa plan_isa() {
  if constexpr (std::is_same_v<T, float>)
    return active_isa();
  else
    return Isa::generic;
}

namespace detail {

/// The threads of a call over `work_items` items: one unless it runs in parallel, and
/// never more than there are items.
inline int thread_count(bool parallel, Index work_items) {
  return parallel ? static_cast<int>(std::min<Index>(max_threads(), work_items)) : 1;
}

/// plan.parallel and plan.threads for a call of `flops` FLOPs over plan.work_items items.
inline void plan_threads(KernelPlan& plan, double flops) {
  plan.parallel = runs_parallel(plan.work_items, flops);
  plan.threads = thread_count(plan.parallel, plan.work_items);
}

/// 2 Lq Lk (D + Dv) per query head: the FLOPs of attention's two products.
inline double attention_flops(const AttentionShape& shape) {
  return 2.0 * static_cast<double>(shape.q_length) * static_cast<double>(shape.k_length) *
         static_cast<double>(shape.dim + shape.value_dim) *
         static_cast<double>(shape.batch * shape.q_heads);
}

[[noreturn]] inline void throw_negative_tiles(const char* function, Index query_tile,
                                              Index key_tile) {
  throw_invalid_argument(function, "query_tile is " + std::to_string(query_tile) +
                                       " and key_tile is " + std::to_string(key_tile) +
                                       ": tile sizes must be >= 0 (0 = default)");
}
}  // namespace detail

/// The plan for `shape` with compute scalar T. Throws std::invalid_argument (naming
/// `function`) for negative tiles and for weights requested from a kernel that cannot return
/// them. The instruction set is plan_isa<T>().
template <class T>
KernelPlan plan_attention(const AttentionShape& shape, Algorithm requested, Index query_tile,
                          Index key_tile, bool wants_weights, bool dropout = false,
                          const char* function = "plan_attention",
                          ComputePrecision compute = ComputePrecision::fp32) {
  if (query_tile < 0 || key_tile < 0)
    detail::throw_negative_tiles(function, query_tile, key_tile);
  KernelPlan plan;
  plan.scalar = scalar_name<T>();
  const Isa isa = plan_isa<T>();
  plan.isa = isa;
  const Index q_length = shape.q_length, k_length = shape.k_length;
  const Index group = shape.kv_heads > 0 ? shape.q_heads / shape.kv_heads : 1;
  // int8 products (ComputePrecision::int8): float, on the levels that have them; decode reads
  // them for keys stored as blocks of int8 or nibbles whose D is whole blocks.
  const bool int8_allowed =
      compute == ComputePrecision::int8 && std::is_same_v<T, float> && has_int8_products(isa);
  const bool int8_readable = int8_allowed && shape.k_int8_readable && shape.dim % 32 == 0;
  if (requested == Algorithm::automatic) {
    const Index kv_bytes = shape.kv_element_bytes > 0 ? shape.kv_element_bytes : Index(sizeof(T));
    const double flash_bytes = static_cast<double>(group * k_length) *
                               static_cast<double>(shape.dim + shape.value_dim) *
                               static_cast<double>(kv_bytes);
    if (shape.kv_quantized) {  // (naive cannot read blocks; KVCache refuses weights)
      plan.algorithm = !dropout && q_length <= quantized_decode_max_queries(isa, int8_readable)
                           ? Algorithm::decode
                           : Algorithm::flash;
    } else if (shape.kv_paged) {  // (naive cannot read pages; the paged cache refuses weights)
      plan.algorithm = !dropout && q_length <= decode_max_queries(isa, kv_bytes == 2, flash_bytes)
                           ? Algorithm::decode
                           : Algorithm::flash;
    } else if (wants_weights ||
               group * q_length <= automatic_choice(isa, kv_bytes == 2).naive_max_rows) {
      plan.algorithm = Algorithm::naive;
    } else if (!dropout && q_length <= decode_max_queries(isa, kv_bytes == 2, flash_bytes)) {
      plan.algorithm = Algorithm::decode;  // (dropout runs in naive and flash only)
    } else {
      plan.algorithm = Algorithm::flash;
    }
  } else {
    if (dropout && requested != Algorithm::naive && requested != Algorithm::flash) {
      detail::throw_invalid_argument(function, std::string("dropout was asked of Algorithm::") +
                                                   algorithm_name(requested) +
                                                   ": only naive and flash (or automatic) "
                                                   "apply it");
    }
    if (wants_weights && requested != Algorithm::naive) {
      detail::throw_invalid_argument(function,
                                     std::string("weights were requested with Algorithm::") +
                                         algorithm_name(requested) +
                                         ": only Algorithm::naive (or automatic) returns them");
    }
    plan.algorithm = requested;
  }
  const Index heads = shape.batch * shape.q_heads;
  const auto tiles_of = [](Index n, Index tile) {
    return n == 0 ? Index(0) : (n + tile - 1) / tile;
  };
  switch (plan.algorithm) {
    case Algorithm::chunked:
      plan.query_tile = query_tile > 0 ? query_tile : default_chunk_rows;
      plan.work_items = heads * tiles_of(q_length, plan.query_tile);
      break;
    case Algorithm::flash:
      plan.query_tile = query_tile > 0 ? query_tile : default_query_tile(plan.isa, shape.causal);
      plan.key_tile = key_tile > 0 ? key_tile : default_key_tile(plan.isa);
      plan.work_items = heads * tiles_of(q_length, plan.query_tile);
      break;
    case Algorithm::decode:
      plan.split_keys = decode_split_keys;
      plan.key_block = decode_key_block;
      plan.work_items =
          q_length == 0 ? 0 : shape.batch * shape.kv_heads * tiles_of(k_length, plan.split_keys);
      break;
    default:
      plan.work_items = heads;
      break;
  }
  // bf16 products: flash only, on the level that has them, for the storage they read.
  plan.bf16_products = compute == ComputePrecision::bf16 && std::is_same_v<T, float> &&
                       plan.isa == Isa::avx512_bf16 && plan.algorithm == Algorithm::flash &&
                       shape.bf16_readable_kv && !shape.kv_quantized;
  // int8 products in flash: keys (float, 16-bit, or blocks dequantized) quantized per row by
  // the kernel, once per kv head and thread, so only where enough query rows share them.
  const bool int8_flash =
      int8_allowed && plan.algorithm == Algorithm::flash && group * q_length >= int8_flash_min_rows;
  plan.int8_products = (int8_readable && plan.algorithm == Algorithm::decode) || int8_flash;
  detail::plan_threads(plan, detail::attention_flops(shape));
  return plan;
}

/// Flash tiles follow a block mask's blocks, grouped to at least this many rows or keys.
inline constexpr Index smallest_block_tile = 64;

/// The tiles (query rows, keys) `options` ask for: their own, else a block mask's blocks
/// (blocks of fewer than smallest_block_tile grouped), so that a tile never cuts a block and
/// takes as few blocks of different classes as it can; else 0 = the default.
template <class T>
std::array<Index, 2> requested_tiles(const AttentionOptions<T>& options) {
  const BlockMask& blocks = options.block_mask;
  const auto grouped = [](Index block) {
    return block * ((smallest_block_tile + block - 1) / block);
  };
  return {
      options.query_tile != 0 || blocks.empty() ? options.query_tile : grouped(blocks.q_block()),
      options.key_tile != 0 || blocks.empty() ? options.key_tile : grouped(blocks.k_block())};
}

/// The plan for `shape` and `options` (the algorithm and tiles they ask for; shape.causal is
/// taken from options.causal).
template <class T>
KernelPlan plan_attention(const AttentionShape& shape, const AttentionOptions<T>& options,
                          bool wants_weights = false, const char* function = "plan_attention") {
  const auto [query_tile, key_tile] = requested_tiles(options);
  AttentionShape problem = shape;
  problem.causal = options.causal != Causal::none;
  return plan_attention<T>(problem, options.algorithm, query_tile, key_tile, wants_weights,
                           options.dropout_p > T(0), function, options.compute);
}

/// Flash backward tiles (query rows, keys), measured with bench_backward's
/// backward_over_forward (docs/training.md, "Speed"): 64 x 128, and on AVX-512 at D >= 128
/// 128 x 256 (128 x 128 causal, where a longer key tile wastes more on the diagonal): on the
/// Xeon, D = 128, one thread, the backward over forward time went from 2.57-2.60 to 2.44-2.46
/// (L 2048, 4096) not causal and from 2.53-2.58 to 2.49-2.54 causal. On AVX2 (Zen 3) tiles of
/// 48 to 128 by 64 to 192 moved the time by at most 5%, and its L2 is a quarter of the Xeon's:
/// 64 x 128 there.
inline std::array<Index, 2> default_backward_tiles(Isa isa, Index dim, bool causal) {
  if (float_kernels_isa(isa) == Isa::avx512 && dim >= 128)
    return {128, causal ? Index(128) : Index(256)};
  return {64, 128};
}

/// The plan of a backward call (attn/attention_backward.hpp): naive for Algorithm::naive, the
/// flash backward for every other value; the instruction set, tiles and (b, kv head) work
/// items. Throws std::invalid_argument (naming `function`) for negative tiles.
template <class T>
KernelPlan plan_backward(const AttentionShape& shape, const AttentionOptions<T>& options,
                         const char* function = "plan_backward") {
  if (options.query_tile < 0 || options.key_tile < 0)
    detail::throw_negative_tiles(function, options.query_tile, options.key_tile);
  KernelPlan plan;
  plan.scalar = scalar_name<T>();
  plan.algorithm = options.algorithm == Algorithm::naive ? Algorithm::naive : Algorithm::flash;
  plan.isa = plan_isa<T>();
  const auto [query_tile, key_tile] =
      default_backward_tiles(plan.isa, shape.dim, options.causal != Causal::none);
  plan.query_tile = options.query_tile > 0 ? options.query_tile : query_tile;
  plan.key_tile = options.key_tile > 0 ? options.key_tile : key_tile;
  plan.work_items = shape.batch * shape.kv_heads;
  // bf16 products: the flash backward on the level that has them, for the storage they read.
  plan.bf16_products = options.compute == ComputePrecision::bf16 && std::is_same_v<T, float> &&
                       plan.isa == Isa::avx512_bf16 && plan.algorithm == Algorithm::flash &&
                       shape.bf16_readable_kv;
  detail::plan_threads(plan, detail::attention_flops(shape));
  return plan;
}

/// Default rows per chunk of linear attention's causal prefix sums (and of every pass over q
/// and k), the fastest in bench/bench_linear.cpp (docs/performance.md, "Tuning choices");
/// non-causal attention does not depend on it.
inline constexpr Index default_linear_chunk = 16;

/// The shape of one linear attention problem (attn/linear_attention.hpp): q (B, Hq, Lq, D),
/// k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), and M features per row of phi(q) and phi(k).
struct LinearAttentionShape {
  Index batch = 0, q_heads = 0, kv_heads = 0, q_length = 0, k_length = 0, features = 0,
        value_dim = 0;
  bool causal = false;  ///< chunked prefix sums (else one pass of key sums)
};

/// How one linear attention call (forward or backward) runs: its chunk, its (b, kv head)
/// work items and the threads. Each item runs on one thread in one order, so the result
/// does not depend on the thread count.
struct LinearPlan {
  bool backward = false;
  bool causal = false;
  Index chunk = 0;       ///< rows per chunk of every pass over q and k
  Index work_items = 0;  ///< B * Hkv
  double flops = 0;      ///< the call's multiply-adds counted twice (the parallel rule's input)
  bool parallel = false;
  int threads = 1;

  std::string describe() const {
    return std::string("linear ") + (backward ? "backward" : "forward") + " (" +
           (causal ? "causal" : "non-causal") + "): chunks of " + std::to_string(chunk) +
           " rows; " + std::to_string(work_items) + " work items (B * Hkv) on " +
           std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }
};

/// The plan of linear attention's forward (or its backward, about 2.5 times the FLOPs:
/// 10 B Hq max(Lq, Lk) M (Dv + 1) against 4): `chunk` rows per chunk, 0 = default_linear_chunk.
/// Throws std::invalid_argument (naming `function`) for a negative chunk.
inline LinearPlan plan_linear_attention(const LinearAttentionShape& shape, Index chunk,
                                        bool backward = false,
                                        const char* function = "plan_linear_attention") {
  if (chunk < 0) {
    detail::throw_invalid_argument(
        function, "chunk is " + std::to_string(chunk) + ": must be >= 0 (0 = default)");
  }
  LinearPlan plan;
  plan.backward = backward;
  plan.causal = shape.causal;
  plan.chunk = chunk > 0 ? chunk : default_linear_chunk;
  plan.work_items = shape.batch * shape.kv_heads;
  plan.flops = (backward ? 10.0 : 4.0) * static_cast<double>(shape.batch * shape.q_heads) *
               static_cast<double>(std::max(shape.q_length, shape.k_length)) *
               static_cast<double>(shape.features) * static_cast<double>(shape.value_dim + 1);
  plan.parallel = detail::runs_parallel(plan.work_items, plan.flops);
  plan.threads = detail::thread_count(plan.parallel, plan.work_items);
  return plan;
}

/// How a call without tiles runs: the projections' GEMM, the rotation of RoPE.
struct LoopPlan {
  Isa isa = Isa::generic;  ///< the instruction set of its kernel
  bool parallel = false;   ///< whether it opens a parallel region
};

/// The plan of c (M, N) = a (M, K) b (K, N) computing in T (kernels/gemm.hpp): the threads
/// for problems of parallel_flops and more.
template <class T>
LoopPlan plan_gemm(Index m, Index n, Index k) {
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  return {plan_isa<T>(), flops >= parallel_flops};
}

/// The plan of rotating `rows` rows of `rotary_dim` features with a table in T, in `items`
/// independent heads (attn/rope.hpp): in parallel from 65536 rotated features (a rotation is
/// a few FLOPs per feature, so the region pays later than for attention).
template <class T>
LoopPlan plan_rope(Index items, Index rows, Index rotary_dim) {
  return {plan_isa<T>(), items > 1 && items * rows * rotary_dim >= 65536};
}

}  // namespace attn
