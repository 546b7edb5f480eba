// attn/cpu.hpp: the instruction sets attn's kernels are compiled for, which one runs, and
// how to force one.
//
// Every build of attn on x86-64 with GCC or Clang contains three versions of the float
// kernels, whatever -march the user compiles with: `generic` (Eigen's products and
// Eigen's vectorised exp, compiled for the translation unit's own flags), `avx2` (AVX2 +
// FMA + F16C) and `avx512` (AVX-512F); and two levels above it that run the avx512 kernels
// and add low-precision products for the calls that ask for them (attn/options.hpp,
// ComputePrecision): `avx512_vnni` (AVX512-VNNI, with BW and VL: int8 dot products, the keys
// of a q8_0 or q4_0 cache read as int8 by decode) and `avx512_bf16` (AVX512-BF16 as well:
// bf16 dot products in flash, and everything avx512_vnni has). The vector
// levels are compiled with function target attributes (kernels/simd/target.hpp), so a plain
// `-O2` build runs AVX-512 code on a CPU that has it. The CPU is asked once (cpuid and the
// OS's saved-register mask, xgetbv) and the choice is cached.
//
// Which instruction set runs:
//   1. set_isa(isa), if called (a ScopedIsa restores the previous choice);
//   2. else the environment variable ATTN_ISA=generic|avx2|avx512|avx512_vnni|avx512_bf16,
//      read once;
//   3. else best_isa(): the highest level the CPU has (AVX-512 where it is faster; with
//      int8 and bf16 dot products where the CPU has them), else AVX2, else generic.
// Asking for an instruction set the CPU lacks (or that this build does not contain) throws
// std::invalid_argument. double always runs the generic kernels.
//
// Other compilers (MSVC) and other architectures contain only `generic`.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "attn/config.hpp"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ATTN_NO_DISPATCH)
#define ATTN_X86_DISPATCH 1
#include <cpuid.h>
#else
#define ATTN_X86_DISPATCH 0
#endif

/// ATTN_DISPATCH_OBSERVER(isa), if defined before attn's headers, is evaluated with the
/// instruction set of every lookup of a kernel table or a mod's loop (tests/test_dispatch.cpp
/// checks with it that a call never runs two sets). Every translation unit of a program must
/// agree on it.
#ifndef ATTN_DISPATCH_OBSERVER
#define ATTN_DISPATCH_OBSERVER(isa) static_cast<void>(isa)
#endif

namespace attn {

/// An instruction-set level of the kernels, each a superset of the one before.
enum class Isa : std::uint8_t {
  generic,  ///< Eigen's products, for the translation unit's own -march (any CPU, float and double)
  avx2,     ///< AVX2 + FMA + F16C, 8 floats per vector
  avx512,   ///< AVX-512F, 16 floats per vector
  avx512_vnni,  ///< avx512, plus int8 dot products (AVX512-VNNI, with BW and VL)
  avx512_bf16,  ///< avx512_vnni, plus bf16 dot products (AVX512-BF16)
};

inline constexpr Isa all_isas[] = {Isa::generic, Isa::avx2, Isa::avx512, Isa::avx512_vnni,
                                   Isa::avx512_bf16};

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::generic:
      return "generic";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::avx512_vnni:
      return "avx512_vnni";
    case Isa::avx512_bf16:
      return "avx512_bf16";
  }
  return "unknown";
}

/// The level whose float kernels `isa` runs: avx512_vnni and avx512_bf16 run avx512's, adding
/// only the int8 or bf16 products of calls that ask for them (so that a float call gives the
/// same bits on all three).
constexpr Isa float_kernels_isa(Isa isa) {
  return isa == Isa::avx512_vnni || isa == Isa::avx512_bf16 ? Isa::avx512 : isa;
}

/// Whether `isa` has int8 dot products (VNNI): avx512_vnni and avx512_bf16.
constexpr bool has_int8_products(Isa isa) {
  return isa == Isa::avx512_vnni || isa == Isa::avx512_bf16;
}

/// What the CPU reports about itself (all false off x86-64 or without GCC/Clang).
struct CpuFeatures {
  bool avx2 = false;         ///< AVX2, FMA and F16C, with the OS saving ymm registers
  bool avx512 = false;       ///< AVX-512F as well, with the OS saving zmm and mask registers
  bool avx512_vnni = false;  ///< AVX512-VNNI, -BW and -VL as well
  bool avx512_bf16 = false;  ///< AVX512-BF16 as well (with avx512_vnni)
  bool amd = false;          ///< vendor "AuthenticAMD"
  unsigned family = 0;       ///< display family (0x19: Zen 3 and Zen 4; 0x1a: Zen 5)
};

namespace detail {

#if ATTN_X86_DISPATCH
inline std::uint64_t read_xcr0() {
  std::uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<std::uint64_t>(edx) << 32) | eax;
}
#endif

inline CpuFeatures query_cpu() {
  CpuFeatures cpu;
#if ATTN_X86_DISPATCH
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0)
    return cpu;
  const unsigned max_leaf = eax;
  cpu.amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "AuthenticAMD"
  __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  const unsigned base_family = (eax >> 8) & 0xfu;
  cpu.family = base_family == 0xfu ? base_family + ((eax >> 20) & 0xffu) : base_family;
  const auto bit = [](unsigned word, unsigned n) { return ((word >> n) & 1u) != 0u; };
  const bool fma = bit(ecx, 12), osxsave = bit(ecx, 27), avx = bit(ecx, 28), f16c = bit(ecx, 29);
  if (!osxsave || !avx || max_leaf < 7)
    return cpu;
  const std::uint64_t xcr0 = read_xcr0();
  const bool ymm_saved = (xcr0 & 0x6u) == 0x6u;    // SSE and AVX state
  const bool zmm_saved = (xcr0 & 0xe6u) == 0xe6u;  // and opmask, ZMM_Hi256, Hi16_ZMM
  __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx);
  const bool avx2 = bit(ebx, 5), avx512f = bit(ebx, 16), avx512bw = bit(ebx, 30),
             avx512vl = bit(ebx, 31), avx512vnni = bit(ecx, 11);
  cpu.avx2 = ymm_saved && avx2 && fma && f16c;
  cpu.avx512 = cpu.avx2 && zmm_saved && avx512f;
  __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx);
  const bool avx512bf16 = bit(eax, 5);
  cpu.avx512_vnni = cpu.avx512 && avx512bw && avx512vl && avx512vnni;
  cpu.avx512_bf16 = cpu.avx512_vnni && avx512bf16;
#endif
  return cpu;
}

/// -1: not forced; otherwise the forced Isa.
inline std::atomic<int>& forced_isa_slot() {
  static std::atomic<int> slot{-1};
  return slot;
}

[[noreturn]] inline void throw_unsupported_isa(const char* function, Isa isa) {
  throw_invalid_argument(
      function, std::string("instruction set ") + isa_name(isa) + " is not available: " +
#if ATTN_X86_DISPATCH
                    "this CPU lacks it"
#else
                    "this build contains only the generic kernels"
#endif
  );
}

/// ATTN_ISA, parsed once: nullopt when unset or empty.
inline std::optional<Isa> environment_isa() {
  static const std::optional<Isa> isa = []() -> std::optional<Isa> {
    const char* value = std::getenv("ATTN_ISA");
    if (value == nullptr || *value == '\0')
      return std::nullopt;
    const std::string name(value);
    for (const Isa candidate : all_isas) {
      if (name == isa_name(candidate))
        return candidate;
    }
    throw_invalid_argument("ATTN_ISA", "the environment variable is '" + name +
                                           "': must be generic, avx2, avx512, avx512_vnni or "
                                           "avx512_bf16 (or unset for automatic)");
  }();
  return isa;
}

}  // namespace detail

/// The CPU's features, asked once.
inline const CpuFeatures& cpu_features() {
  static const CpuFeatures cpu = detail::query_cpu();
  return cpu;
}

/// Whether this build contains `isa` and this CPU can run it.
inline bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::generic:
      return true;
    case Isa::avx2:
      return cpu_features().avx2;
    case Isa::avx512:
      return cpu_features().avx512;
    case Isa::avx512_vnni:
      return cpu_features().avx512_vnni;
    case Isa::avx512_bf16:
      return cpu_features().avx512_bf16;
  }
  return false;
}

/// The fastest instruction set this CPU supports, by measurement (docs/performance.md):
/// AVX-512 where it exists (with int8 and bf16 dot products where the CPU has them), AVX2
/// otherwise, generic without either.
inline Isa best_isa() {
  if (isa_supported(Isa::avx512_bf16))
    return Isa::avx512_bf16;
  if (isa_supported(Isa::avx512_vnni))
    return Isa::avx512_vnni;
  if (isa_supported(Isa::avx512))
    return Isa::avx512;
  if (isa_supported(Isa::avx2))
    return Isa::avx2;
  return Isa::generic;
}

/// The instruction set the float kernels use now: set_isa(), else ATTN_ISA, else best_isa().
/// Throws std::invalid_argument when ATTN_ISA is malformed or names one the CPU lacks.
inline Isa active_isa() {
  const int forced = detail::forced_isa_slot().load(std::memory_order_relaxed);
  if (forced >= 0)
    return static_cast<Isa>(forced);
  if (const std::optional<Isa> from_environment = detail::environment_isa()) {
    if (!isa_supported(*from_environment))
      detail::throw_unsupported_isa("ATTN_ISA", *from_environment);
    return *from_environment;
  }
  return best_isa();
}

/// Forces every later call (in every thread) to use `isa`; throws std::invalid_argument if
/// the CPU lacks it. Not meant to change while attention calls run in other threads.
inline void set_isa(Isa isa) {
  if (!isa_supported(isa))
    detail::throw_unsupported_isa("set_isa", isa);
  detail::forced_isa_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
}

/// Undoes set_isa(): back to ATTN_ISA or best_isa().
inline void reset_isa() {
  detail::forced_isa_slot().store(-1, std::memory_order_relaxed);
}

/// Forces `isa` for the lifetime of the object, then restores the previous setting (tests
/// and benchmarks run every instruction set this way).
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa) : previous_(detail::forced_isa_slot().load()) { set_isa(isa); }
  ~ScopedIsa() { detail::forced_isa_slot().store(previous_); }
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;

 private:
  int previous_;
};

}  // namespace attn
