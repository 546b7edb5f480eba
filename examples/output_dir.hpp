// examples/output_dir.hpp: where the examples write their pictures.
//
//   example                  next to the executable (its directory, from /proc/self/exe
//                            or argv[0]); ctest runs it in the build tree's examples/
//   example --out DIR        into DIR (created if missing)
//
// Not part of the library: examples only.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>

namespace attn_examples {

/// The directory to write pictures into, from the command line (`--out DIR`) or the
/// executable's location. Throws std::invalid_argument on any other argument.
inline std::filesystem::path output_dir(int argc, char** argv) {
  namespace fs = std::filesystem;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--out" && i + 1 < argc) {
      const fs::path dir = argv[i + 1];
      fs::create_directories(dir);
      return dir;
    }
    throw std::invalid_argument("unknown argument '" + arg + "' (usage: " + std::string(argv[0]) +
                                " [--out DIR])");
  }
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error && exe.has_parent_path())
    return exe.parent_path();
  if (argc > 0) {
    const fs::path from_argv = fs::absolute(argv[0], error);
    if (!error && from_argv.has_parent_path())
      return from_argv.parent_path();
  }
  return fs::current_path();
}

}  // namespace attn_examples
