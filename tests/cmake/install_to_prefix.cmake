# Usage: cmake -DATTN_BUILD_DIR=<build> -DATTN_PREFIX=<prefix> [-DATTN_CONFIG=<cfg>]
#              -P install_to_prefix.cmake
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

foreach(expected
    "include/attn/attn.hpp")
  if(NOT EXISTS "${ATTN_PREFIX}/${expected}")
    message(FATAL_ERROR "install_to_prefix.cmake: ${ATTN_PREFIX}/${expected} was not installed")
  endif()
endforeach()
file(GLOB_RECURSE config_files "${ATTN_PREFIX}/*/attnConfig.cmake")
if(NOT config_files)
  message(FATAL_ERROR "install_to_prefix.cmake: no attnConfig.cmake under ${ATTN_PREFIX}")
endif()
message(STATUS "attn installed into ${ATTN_PREFIX}")
