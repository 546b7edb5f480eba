// The Catch2 runner for the attn test executables; the test cases live in test_*.cpp.
//
//   --isa generic|avx2|avx512|avx512_vnni|avx512_bf16
//       force the kernels' instruction set (attn::set_isa) for the whole run; exits with 77
//       (ctest: skipped) when this CPU lacks it. ctest runs the [isa] test cases once per
//       instruction set ([int8] on avx512_vnni, [bf16] and [int8] but [sweep] on
//       avx512_bf16 too).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <iostream>
#include <string>

#include <attn/cpu.hpp>

int main(int argc, char* argv[]) {
  Catch::Session session;
  std::string isa_name;
  session.cli(session.cli() |
              Catch::clara::Opt(isa_name, "generic|avx2|avx512|avx512_vnni|avx512_bf16")["--isa"](
                  "force the kernels' instruction set; exit 77 when this CPU lacks it"));
  if (const int status = session.applyCommandLine(argc, argv); status != 0)
    return status;
  if (!isa_name.empty()) {
    bool known = false;
    for (const attn::Isa isa : attn::all_isas) {
      if (isa_name != attn::isa_name(isa))
        continue;
      known = true;
      if (!attn::isa_supported(isa)) {
        std::cout << "skipped: this CPU lacks " << isa_name << "\n";
        return 77;
      }
      attn::set_isa(isa);
    }
    if (!known) {
      std::cerr << "--isa " << isa_name
                << ": must be generic, avx2, avx512, avx512_vnni or "
                   "avx512_bf16\n";
      return 2;
    }
    std::cout << "kernels forced to " << isa_name << "\n";
  }
  return session.run();
}
