# Usage: cmake -DATTN_BUILD_DIR=<build> -DATTN_PREFIX=<prefix> [-DATTN_CONFIG=<cfg>]
#              [-DATTN_EXPECT_SAFETENSORS=1] [-DATTN_EXPECT_COMPILED=1] [-DATTN_EXPECT_MPI=1]
#              -P install_to_prefix.cmake
#
# Wipes <prefix>, then runs `cmake --install <build> --prefix <prefix>`.
# Used as the ctest setup fixture of the find_package() consumer test; the
# prefix lives inside the build tree, so nothing is written outside it.

cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)

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

# What the package installs: the headers, attn.pc under the architecture-independent data
# dir, and its CMake files there too when it is header-only; with attn::compiled, the
# library, attn-compiled.pc and the CMake files under lib/. Nothing else under lib/.
set(expected_files
    "include/attn/attn.hpp"
    "include/attn/viz.hpp"
    "include/attn/safetensors.hpp"
    "share/pkgconfig/attn.pc")
if(ATTN_EXPECT_COMPILED)
  file(GLOB cmake_dirs LIST_DIRECTORIES true "${ATTN_PREFIX}/lib*/cmake/attn")
  list(LENGTH cmake_dirs cmake_dir_count)
  if(NOT cmake_dir_count EQUAL 1)
    message(FATAL_ERROR "install_to_prefix.cmake: no lib*/cmake/attn (${cmake_dirs})")
  endif()
  file(RELATIVE_PATH cmake_dir "${ATTN_PREFIX}" "${cmake_dirs}")
  get_filename_component(lib_dir "${cmake_dir}" DIRECTORY)
  get_filename_component(lib_dir "${lib_dir}" DIRECTORY)
  list(APPEND expected_files "${cmake_dir}/attnCompiledTargets.cmake"
    "${cmake_dir}/attnCompiledDependencies.cmake" "${lib_dir}/pkgconfig/attn-compiled.pc")
else()
  set(cmake_dir "share/cmake/attn")
endif()
list(APPEND expected_files "${cmake_dir}/attnConfig.cmake" "${cmake_dir}/attnConfigVersion.cmake"
  "${cmake_dir}/attnTargets.cmake")
# attn::safetensors (attn/safetensors.hpp with nlohmann_json) when the build had it.
if(ATTN_EXPECT_SAFETENSORS)
  list(APPEND expected_files "${cmake_dir}/attnSafetensorsTargets.cmake")
endif()
# attn::mpi (attn/distributed.hpp with MPI) when the build had it.
if(ATTN_EXPECT_MPI)
  list(APPEND expected_files "${cmake_dir}/attnMpiTargets.cmake" "include/attn/distributed.hpp")
endif()
foreach(expected IN LISTS expected_files)
  if(NOT EXISTS "${ATTN_PREFIX}/${expected}")
    message(FATAL_ERROR "install_to_prefix.cmake: ${ATTN_PREFIX}/${expected} was not installed")
  endif()
endforeach()
file(GLOB_RECURSE lib_files "${ATTN_PREFIX}/lib*/*")
foreach(file IN LISTS lib_files)
  file(RELATIVE_PATH relative "${ATTN_PREFIX}" "${file}")
  # (and the per-configuration file of its export set, attnCompiledTargets-<config>.cmake)
  if(NOT ATTN_EXPECT_COMPILED OR NOT (relative MATCHES "/libattn_compiled\\.(a|so)"
                                      OR relative MATCHES "/attnCompiledTargets-[a-z]+\\.cmake$"
                                      OR relative IN_LIST expected_files))
    message(FATAL_ERROR "install_to_prefix.cmake: the package installed ${relative}")
  endif()
endforeach()
# attn::attn's files carry no decision of the build host: OpenMP and a BLAS are the
# consumer's choices (docs/usage.md). attn::compiled's carry its own (attnCompiled*.cmake,
# attn-compiled.pc: OpenMP when it was built with it).
file(GLOB package_files "${ATTN_PREFIX}/${cmake_dir}/attn*.cmake" "${ATTN_PREFIX}/share/pkgconfig/attn.pc")
list(FILTER package_files EXCLUDE REGEX "attnCompiled")
foreach(file IN LISTS package_files)
  file(STRINGS "${file}" lines)
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^[ \t]*#" AND line MATCHES "OpenMP|openmp|BLAS")
      message(FATAL_ERROR "install_to_prefix.cmake: ${file} decides OpenMP or BLAS: ${line}")
    endif()
  endforeach()
endforeach()
message(STATUS "attn installed into ${ATTN_PREFIX}")
