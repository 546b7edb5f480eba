// Stand-in for Catch2 v3's header (tests/cmake/add_subdirectory): only its name and one macro.
#pragma once
#define CATCH2_V3_STAND_IN 3
