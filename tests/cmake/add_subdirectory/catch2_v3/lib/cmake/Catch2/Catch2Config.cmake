# A stand-in for an installed Catch2 v3 package (what vcpkg and Conan ship): the targets and
# the header layout of v3, none of its code. The consumer project uses it to prove that a
# project on Catch2 v3 can vendor attn.
if(NOT TARGET Catch2::Catch2)
  add_library(Catch2::Catch2 INTERFACE IMPORTED)
  set_target_properties(Catch2::Catch2 PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_LIST_DIR}/../../../include")
  add_library(Catch2::Catch2WithMain INTERFACE IMPORTED)
  set_target_properties(Catch2::Catch2WithMain PROPERTIES INTERFACE_LINK_LIBRARIES Catch2::Catch2)
endif()
