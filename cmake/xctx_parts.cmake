# The parts of xctx as libraries (docs/architecture.md): one static library per part, linking
# exactly the parts it may use, so a symbol reached across a forbidden arrow is an undefined
# reference. xctx_add_link_checks() makes the linker prove it: for each part, an executable that
# links the part's *whole* archive with only its declared parts and external libraries; an
# object of that part calling into a part it does not declare fails that link.

# xctx_add_part(<part> SOURCES <files...> USES <targets...>): the library xctx_<part>.
function(xctx_add_part part)
  cmake_parse_arguments(P "" "" "SOURCES;USES" ${ARGN})
  add_library(xctx_${part} STATIC ${P_SOURCES})
  target_include_directories(xctx_${part} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(xctx_${part} PUBLIC ${P_USES})
  set_property(GLOBAL APPEND PROPERTY XCTX_PARTS ${part})
endfunction()

# One executable per part (built with the tests): main() from link_check_main.cpp, the part's
# whole archive, and what the part declares.
function(xctx_add_link_checks)
  get_property(parts GLOBAL PROPERTY XCTX_PARTS)
  foreach(part ${parts})
    add_executable(link_check_${part} ${PROJECT_SOURCE_DIR}/cmake/link_check_main.cpp)
    target_link_libraries(link_check_${part} PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,xctx_${part}>")
  endforeach()
  # The check of the check: kernels' closure plus an object calling into model/. Not built by
  # default; the CTest arrows_link_check_refuses_a_planted_upward_call builds it and wants it to fail.
  add_executable(link_check_planted EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/tests/link/planted_upward_call.cpp)
  target_link_libraries(link_check_planted PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,xctx_kernels>")
endfunction()
