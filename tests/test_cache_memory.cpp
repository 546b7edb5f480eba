// The caches' memory (attn/cache/huge_pages.hpp), read back from the kernel's own account of
// the process (/proc/self/smaps): a buffer of 2 MiB or more is a mapping of its own on a 2 MiB
// boundary, advised as huge-page memory ("hg" in its VmFlags) while the switch is on and not
// while it is off; smaller buffers are never advised; the three caches (KVCache,
// PagedKVCache, LatentCache) all allocate so; attention reads the same bits either way.
// Whether the kernel then backs the advice with huge pages depends on its settings and free
// memory, so that is measured (bench_decode, docs/performance.md), not asserted.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <attn/cache/huge_pages.hpp>
#include <attn/kv_cache.hpp>
#include <attn/latent_cache.hpp>
#include <attn/paged_kv_cache.hpp>

#if defined(__linux__)
#include <fstream>
#include <sstream>

namespace {

using attn::Index;
constexpr std::uintptr_t huge_page = std::uintptr_t{2} << 20;

/// One mapping of /proc/self/smaps: its address range and VmFlags.
struct Mapping {
  std::uintptr_t start = 0, end = 0;
  std::vector<std::string> flags;
  bool advised() const {  // "hg": VM_HUGEPAGE, set by madvise(MADV_HUGEPAGE)
    return std::find(flags.begin(), flags.end(), "hg") != flags.end();
  }
};

std::vector<Mapping> mappings() {
  std::vector<Mapping> all;
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  while (std::getline(smaps, line)) {
    const std::size_t dash = line.find('-'), space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        line.compare(0, 8, "VmFlags:") != 0 &&
        std::isxdigit(static_cast<unsigned char>(line[0])) != 0) {
      Mapping m;
      m.start = std::stoull(line.substr(0, dash), nullptr, 16);
      m.end = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
      all.push_back(m);
    } else if (line.compare(0, 8, "VmFlags:") == 0 && !all.empty()) {
      std::istringstream words(line.substr(8));
      for (std::string flag; words >> flag;)
        all.back().flags.push_back(flag);
    }
  }
  return all;
}

/// The mapping holding `address` (start = end = 0 if none does).
Mapping mapping_of(const void* address) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  for (const Mapping& m : mappings()) {
    if (m.start <= at && at < m.end)
      return m;
  }
  return {};
}

/// Bytes of all the mappings advised as huge-page memory.
std::uintptr_t advised_bytes() {
  std::uintptr_t total = 0;
  for (const Mapping& m : mappings()) {
    if (m.advised())
      total += m.end - m.start;
  }
  return total;
}

/// madvise(MADV_HUGEPAGE) exists only in kernels built with transparent huge pages.
bool kernel_has_thp() {
  return std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good();
}

bool on_huge_page_boundary(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % huge_page == 0;
}

/// (B, Hkv, L, D) random values in [-1, 1).
std::vector<float> random_values(Index count, unsigned seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& x : values)
    x = uniform(generator);
  return values;
}

}  // namespace

TEST_CASE("cache buffers of 2 MiB or more are mappings of their own, advised as huge pages",
          "[cache_memory]") {
  REQUIRE(kernel_has_thp());  // (Debian's kernels have them: a machine without is news)
  const attn::CacheHugePagesScope on(true);

  SECTION("KVCache: keys and values, as allocated and as grown") {
    // 2 kv heads x 2048 rows x 128 floats = 2 MiB each, q8_0 rows 136 bytes: 4.25 MiB each
    attn::KVCache<float> floats(1, 2, 128, 128, 2048);
    attn::KVCache<attn::BlockQ8_0, attn::BlockQ4_0> blocks(2, 4, 128, 128, 4096);
    for (const void* p : {static_cast<const void*>(floats.keys_view().data),
                          static_cast<const void*>(floats.values_view().data),
                          static_cast<const void*>(blocks.keys_view().data),
                          static_cast<const void*>(blocks.values_view().data)}) {
      CHECK(on_huge_page_boundary(p));
      CHECK(mapping_of(p).advised());
    }
    attn::KVCache<Eigen::half> grown(1, 4, 128, 128, 16);  // 16 KiB: small
    CHECK_FALSE(mapping_of(grown.keys_view().data).advised());
    const std::vector<float> rows = random_values(Index{4} * 4096 * 128, 1);
    const auto view = attn::bhld_view(rows.data(), Index(1), Index(4), Index(4096), Index(128));
    grown.append(view, view);  // 4 MiB of half per buffer
    CHECK(on_huge_page_boundary(grown.keys_view().data));
    CHECK(mapping_of(grown.keys_view().data).advised());
    CHECK(mapping_of(grown.values_view().data).advised());
  }
  SECTION("PagedKVCache and LatentCache pools") {
    const std::uintptr_t before = advised_bytes();
    // 64 pages x 8 kv heads x 16 rows x 128 halves: 2 MiB for K and for V
    const attn::PagedKVCache<Eigen::half> paged(8, 128, 128, 16, 64);
    const std::uintptr_t with_paged = advised_bytes();
    CHECK(with_paged - before >= 2 * huge_page);
    // 64 pages x 16 rows x (512 + 64) floats: 2.25 MiB
    const attn::LatentCache<float> latent(512, 64, 16, 64);
    CHECK(advised_bytes() - with_paged >= std::uintptr_t{64} * 16 * 576 * 4);
  }
}

TEST_CASE("CacheHugePagesScope sets the switch for its scope and restores it after",
          "[cache_memory]") {
  const bool initial = attn::cache_huge_pages();
  for (const bool outer : {false, true}) {
    const attn::CacheHugePagesScope first(outer);
    CHECK(attn::cache_huge_pages() == outer);
    {
      const attn::CacheHugePagesScope second(!outer);
      CHECK(attn::cache_huge_pages() == !outer);
    }
    CHECK(attn::cache_huge_pages() == outer);
  }
  CHECK(attn::cache_huge_pages() == initial);
}

TEST_CASE("cache buffers are not advised while the switch is off, nor when small",
          "[cache_memory]") {
  SECTION("switch off") {
    const attn::CacheHugePagesScope off(false);
    CHECK_FALSE(attn::cache_huge_pages());
    const std::uintptr_t before = advised_bytes();
    const attn::KVCache<float> cache(1, 2, 128, 128, 2048);
    CHECK(on_huge_page_boundary(cache.keys_view().data));  // still a mapping of its own
    CHECK_FALSE(mapping_of(cache.keys_view().data).advised());
    CHECK_FALSE(mapping_of(cache.values_view().data).advised());
    const attn::PagedKVCache<Eigen::half> paged(8, 128, 128, 16, 64);
    CHECK(advised_bytes() == before);
  }
  SECTION("small buffers, switch on") {
    const attn::CacheHugePagesScope on(true);
    const std::uintptr_t before = advised_bytes();
    // 1 x 2 x 2047 x 128 floats: 4 KiB short of 2 MiB
    const attn::KVCache<float> cache(1, 2, 128, 128, 2047);
    const attn::PagedKVCache<float> paged(2, 64, 64, 16, 8);
    CHECK_FALSE(mapping_of(cache.keys_view().data).advised());
    CHECK(advised_bytes() == before);
  }
}

// Hidden: ctest's cache_huge_pages_environment runs it with ATTN_CACHE_HUGE_PAGES=0 set.
TEST_CASE("ATTN_CACHE_HUGE_PAGES=0 in the environment turns the switch off",
          "[.cache_environment]") {
  CHECK_FALSE(attn::cache_huge_pages());
  const attn::KVCache<float> cache(1, 2, 128, 128, 2048);
  CHECK(on_huge_page_boundary(cache.keys_view().data));
  CHECK_FALSE(mapping_of(cache.keys_view().data).advised());
}

TEST_CASE("attention over a cache reads the same bits on huge and on small pages",
          "[cache_memory]") {
  const Index heads = 4, q_heads = 8, length = 4096, dim = 128;
  const std::vector<float> keys = random_values(heads * length * dim, 2);
  const std::vector<float> values = random_values(heads * length * dim, 3);
  const std::vector<float> queries = random_values(q_heads * dim, 4);
  const auto k = attn::bhld_view(keys.data(), Index(1), heads, length, dim);
  const auto v = attn::bhld_view(values.data(), Index(1), heads, length, dim);
  const auto q = attn::bhld_view(queries.data(), Index(1), q_heads, Index(1), dim);
  const auto attend = [&](bool huge) {
    const attn::CacheHugePagesScope setting(huge);
    attn::KVCache<attn::BlockQ8_0> cache(1, heads, dim, dim, length);  // 2.1 MiB each
    cache.append(k, v);
    CHECK(mapping_of(cache.keys_view().data).advised() == huge);
    std::vector<float> out(static_cast<std::size_t>(q_heads * dim));
    cache.attend_into(q, attn::bhld_view(out.data(), Index(1), q_heads, Index(1), dim));
    return out;
  };
  const std::vector<float> on_huge = attend(true);
  const std::vector<float> on_small = attend(false);
  CHECK(on_huge == on_small);
}

#endif  // __linux__
