# Usage: cmake -DPKG_CONFIG=<pkg-config> -DCXX=<compiler> -DPREFIX=<attn install prefix>
#              -DSOURCE=<main.cpp> -DOUTPUT=<executable> -P pkg_config.cmake
#
# Builds SOURCE the way a Makefile would, with nothing but what `pkg-config --cflags attn`
# prints (attn.pc requires eigen3, whose flags come with it) and -std=c++17, then runs it.
foreach(var PKG_CONFIG CXX PREFIX SOURCE OUTPUT)
  if(NOT ${var})
    message(FATAL_ERROR "pkg_config.cmake: ${var} is not set")
  endif()
endforeach()

set(ENV{PKG_CONFIG_PATH} "${PREFIX}/share/pkgconfig")
execute_process(COMMAND "${PKG_CONFIG}" --modversion attn
  OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "pkg_config.cmake: pkg-config finds no attn under ${PREFIX}/share/pkgconfig")
endif()
execute_process(COMMAND "${PKG_CONFIG}" --cflags attn
  OUTPUT_VARIABLE cflags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "pkg_config.cmake: pkg-config --cflags attn failed")
endif()
message(STATUS "pkg-config: attn ${version}, --cflags: ${cflags}")
separate_arguments(cflags UNIX_COMMAND "${cflags}")
get_filename_component(expected_include "${PREFIX}/include" REALPATH)
set(found_include OFF)
foreach(flag IN LISTS cflags)
  if(flag MATCHES "^-I(.+)$")
    get_filename_component(dir "${CMAKE_MATCH_1}" REALPATH)
    if(dir STREQUAL expected_include)
      set(found_include ON)
    endif()
  endif()
endforeach()
if(NOT found_include)
  message(FATAL_ERROR "pkg_config.cmake: ${PREFIX}/include is not among the -I flags")
endif()
get_filename_component(output_dir "${OUTPUT}" DIRECTORY)
file(MAKE_DIRECTORY "${output_dir}")
execute_process(COMMAND "${CXX}" -std=c++17 ${cflags} "${SOURCE}" -o "${OUTPUT}"
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "pkg_config.cmake: compiling ${SOURCE} with those flags failed")
endif()
execute_process(COMMAND "${OUTPUT}" RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "pkg_config.cmake: ${OUTPUT} failed (${result})")
endif()
