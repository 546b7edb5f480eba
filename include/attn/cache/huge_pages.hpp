// attn/cache/huge_pages.hpp: the memory of the caches (KVCache, PagedKVCache, LatentCache) on
// transparent huge pages where Linux offers them.
//
// Decode streams the whole cache once per token. On 4 KiB pages each page of that stream
// costs a TLB miss (in a VM a two-level page walk), and the hardware prefetchers stop at
// every page boundary; on 2 MiB pages neither happens. A buffer of at least 2 MiB is therefore
// allocated 2 MiB-aligned and given madvise(MADV_HUGEPAGE) before its first touch, which the
// kernel honours when /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise" (as
// on the machines of docs/performance.md) and ignores when it is "never". PyTorch 2.x's CPU
// allocator asks for the same when THP_MEM_ALLOC_ENABLE=1. Measured in docs/performance.md,
// "The caches' pages". Smaller buffers, and every buffer off Linux, come from the ordinary
// allocator.
//
// No extra memory: a cache writes every unit of its buffers when it allocates them (they are
// value-initialised), so their pages are resident either way; the tail of a buffer past its
// last whole 2 MiB stays on small pages. A buffer of 2 MiB or more is a mapping of its own,
// returned to the system when the cache frees it.
//
// On by default; ATTN_CACHE_HUGE_PAGES=0 in the environment, or set_cache_huge_pages(false)
// (CacheHugePagesScope for one scope), turns it off for the buffers allocated afterwards
// (for instance where the kernel's "defrag" setting makes a huge-page fault wait for
// compaction).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace attn {

namespace detail {

/// The switch of set_cache_huge_pages: on unless ATTN_CACHE_HUGE_PAGES is "0" at first use.
inline std::atomic<bool>& cache_huge_pages_switch() {
  static std::atomic<bool> on{[] {
    const char* setting = std::getenv("ATTN_CACHE_HUGE_PAGES");  // NOLINT(concurrency-mt-unsafe)
    return setting == nullptr || std::strcmp(setting, "0") != 0;
  }()};
  return on;
}

}  // namespace detail

/// Whether cache buffers allocated from now on ask for transparent huge pages.
inline bool cache_huge_pages() {
  return detail::cache_huge_pages_switch().load(std::memory_order_relaxed);
}

/// Turns the huge-page request of cache buffers on or off (buffers already allocated keep
/// their pages). Thread-safe.
inline void set_cache_huge_pages(bool on) {
  detail::cache_huge_pages_switch().store(on, std::memory_order_relaxed);
}

/// Sets the huge-page request of cache buffers for one scope and restores the previous
/// setting when the scope ends, however it ends: the buffers allocated inside ask for huge
/// pages if `on`.
class CacheHugePagesScope {
 public:
  explicit CacheHugePagesScope(bool on) : was_on_(cache_huge_pages()) { set_cache_huge_pages(on); }
  ~CacheHugePagesScope() { set_cache_huge_pages(was_on_); }
  CacheHugePagesScope(const CacheHugePagesScope&) = delete;
  CacheHugePagesScope& operator=(const CacheHugePagesScope&) = delete;
  CacheHugePagesScope(CacheHugePagesScope&&) = delete;
  CacheHugePagesScope& operator=(CacheHugePagesScope&&) = delete;

 private:
  bool was_on_;
};

namespace detail {

/// The allocator of cache buffers: a block of at least `huge_page` bytes is a mapping of its
/// own, 2 MiB-aligned and, while cache_huge_pages() is on, advised to the kernel as huge-page
/// memory; smaller ones come from std::allocator. Stateless (every instance equal): the size
/// of a block decides how it is freed, so turning the switch in between is safe.
template <class T>
struct CacheAllocator {
  using value_type = T;
  static constexpr std::size_t huge_page = std::size_t{2} << 20;

  CacheAllocator() = default;
  template <class U>
  // NOLINTNEXTLINE(google-explicit-constructor): allocators convert implicitly
  CacheAllocator(const CacheAllocator<U>& /*other*/) noexcept {}

  static bool large(std::size_t n) {
#if defined(__linux__)
    return n >= huge_page / sizeof(T);
#else
    (void)n;
    return false;
#endif
  }

  T* allocate(std::size_t n) {
#if defined(__linux__)
    if (large(n)) {
      if (n > (static_cast<std::size_t>(-1) - 2 * huge_page) / sizeof(T))
        throw std::bad_array_new_length();
      // A mapping of its own, cut to a 2 MiB boundary: freed at once by munmap, and no other
      // block ever shares its pages or its advice.
      const std::size_t bytes = mapped_bytes(n), spare = huge_page;
      void* raw =
          mmap(nullptr, bytes + spare, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED)  // NOLINT(cppcoreguidelines-pro-type-cstyle-cast): the macro
        throw std::bad_alloc();
      char* const first = static_cast<char*>(raw);
      const std::size_t lead =
          (huge_page - reinterpret_cast<std::uintptr_t>(first) % huge_page) % huge_page;
      if (lead > 0)
        munmap(first, lead);
      munmap(first + lead + bytes, spare - lead);
      auto* block = reinterpret_cast<T*>(first + lead);
      // (the advice may be refused, by a kernel without THP: the block stays on small pages
      // and works the same)
      if (cache_huge_pages())
        madvise(block, bytes, MADV_HUGEPAGE);
      return block;
    }
#endif
    return std::allocator<T>().allocate(n);
  }

  void deallocate(T* block, std::size_t n) noexcept {
#if defined(__linux__)
    if (large(n)) {
      munmap(block, mapped_bytes(n));
      return;
    }
#endif
    std::allocator<T>().deallocate(block, n);
  }

 private:
  /// n units rounded up to whole pages of the system's size.
  static std::size_t mapped_bytes(std::size_t n) {
#if defined(__linux__)
    static const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
#else
    constexpr std::size_t page = 4096;
#endif
    return (n * sizeof(T) + page - 1) / page * page;
  }
};

template <class T, class U>
constexpr bool operator==(const CacheAllocator<T>& /*a*/, const CacheAllocator<U>& /*b*/) {
  return true;
}
template <class T, class U>
constexpr bool operator!=(const CacheAllocator<T>& /*a*/, const CacheAllocator<U>& /*b*/) {
  return false;
}

/// A cache's buffer of stored units.
template <class T>
using CacheBuffer = std::vector<T, CacheAllocator<T>>;

}  // namespace detail
}  // namespace attn
