# Usage: cmake -DPYTHON=<python3> -DTOOL=<extract_snippets.py> -DCXX=<compiler>
#              -DPAGES=<tests/structure/docs> -DOUT=<dir> -P snippets_catch.cmake
# The test of scripts/extract_snippets.py (ctest docs_snippets_catches): a skip marker without
# a reason must be refused, and the unit of a page with a broken snippet must fail to compile
# with the error at the page's own line. Prints what it saw; the test matches that output.
execute_process(COMMAND "${PYTHON}" "${TOOL}" --root "${PAGES}/.." --summary "${PAGES}/bad_marker.md"
  RESULT_VARIABLE marker_status ERROR_VARIABLE marker_error)
message(STATUS "marker: status ${marker_status}: ${marker_error}")
execute_process(COMMAND "${PYTHON}" "${TOOL}" --root "${PAGES}/.."
  --output "${OUT}/snippets.cpp" "${PAGES}/snippets.md" RESULT_VARIABLE extract_status)
if(NOT extract_status EQUAL 0)
  message(FATAL_ERROR "extract_snippets.py failed on ${PAGES}/snippets.md")
endif()
execute_process(COMMAND "${CXX}" -std=c++17 -fsyntax-only "-I${PAGES}" "${OUT}/snippets.cpp"
  RESULT_VARIABLE compile_status ERROR_VARIABLE compile_error OUTPUT_VARIABLE compile_output)
message(STATUS "compile: status ${compile_status}: ${compile_error}${compile_output}")
