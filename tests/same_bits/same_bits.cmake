# Usage: cmake -DCOMPILED=<program> -DHEADER_ONLY=<program> -P same_bits.cmake
# Runs both builds of tests/same_bits/main.cpp and fails unless they print the same hashes,
# one line per instruction set of this CPU.
execute_process(COMMAND "${COMPILED}" OUTPUT_VARIABLE compiled RESULT_VARIABLE a)
execute_process(COMMAND "${HEADER_ONLY}" OUTPUT_VARIABLE header_only RESULT_VARIABLE b)
if(NOT a EQUAL 0 OR NOT b EQUAL 0)
  message(FATAL_ERROR "same_bits: the programs failed (${a}, ${b})")
endif()
message(STATUS "attn::compiled:\n${compiled}header-only:\n${header_only}")
if(compiled STREQUAL "" OR NOT compiled STREQUAL header_only)
  message(FATAL_ERROR "same_bits: attn::compiled and header-only results differ")
endif()
