# Usage: cmake -DATTN_BUILD_DIR=<build> -DATTN_PREFIX=<prefix> [-DATTN_CONFIG=<cfg>]
#              [-DATTN_EXPECT_SAFETENSORS=1] -P install_to_prefix.cmake
#
# Wipes <prefix>, then runs `cmake --install <build> --prefix <prefix>`.
# Used as the ctest setup fixture of the find_package() consumer test; the
# prefix lives inside the build tree, so nothing is written outside it.

foreach(var ATTN_BUILD_DIR ATTN_PREFIX)
  if(NOT ${var})
    message(FATAL_ERROR "install_to_prefix.cmake: ${var} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE "${ATTN_PREFIX}")

set(config_args "")
if(ATTN_CONFIG)
  set(config_args --config "${ATTN_CONFIG}")
endif()

execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${ATTN_BUILD_DIR}" --prefix "${ATTN_PREFIX}" ${config_args}
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "install_to_prefix.cmake: cmake --install failed (${result})")
endif()

# What a header-only package installs: the headers, and its CMake and pkg-config files under
# the architecture-independent data dir; nothing under lib/.
set(expected_files
    "include/attn/attn.hpp"
    "include/attn/viz.hpp"
    "include/attn/safetensors.hpp"
    "share/cmake/attn/attnConfig.cmake"
    "share/cmake/attn/attnConfigVersion.cmake"
    "share/cmake/attn/attnTargets.cmake"
    "share/pkgconfig/attn.pc")
# attn::safetensors (attn/safetensors.hpp with nlohmann_json) when the build had it.
if(ATTN_EXPECT_SAFETENSORS)
  list(APPEND expected_files "share/cmake/attn/attnSafetensorsTargets.cmake")
endif()
foreach(expected IN LISTS expected_files)
  if(NOT EXISTS "${ATTN_PREFIX}/${expected}")
    message(FATAL_ERROR "install_to_prefix.cmake: ${ATTN_PREFIX}/${expected} was not installed")
  endif()
endforeach()
file(GLOB_RECURSE lib_files "${ATTN_PREFIX}/lib*/*")
if(lib_files)
  message(FATAL_ERROR "install_to_prefix.cmake: a header-only package installed ${lib_files}")
endif()
# The installed package carries no decision of the build host: OpenMP and a BLAS are the
# consumer's choices (docs/usage.md).
file(GLOB package_files "${ATTN_PREFIX}/share/cmake/attn/*.cmake" "${ATTN_PREFIX}/share/pkgconfig/attn.pc")
foreach(file IN LISTS package_files)
  file(STRINGS "${file}" lines)
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^[ \t]*#" AND line MATCHES "OpenMP|openmp|BLAS")
      message(FATAL_ERROR "install_to_prefix.cmake: ${file} decides OpenMP or BLAS: ${line}")
    endif()
  endforeach()
endforeach()
message(STATUS "attn installed into ${ATTN_PREFIX}")
