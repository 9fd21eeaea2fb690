# pith_add_test(foo_test.cc DEPS lib... [LABELS ...] [TIMEOUT s])
# LABELS gpu marks a test that needs a CUDA device (reported as skipped without one).
# Builds the test beside its code into an executable named after the file and registers
# it with CTest. Every unit test in Pith goes through this one helper.
function(pith_add_test source)
  if(PITH_FUZZ_ONLY)  # the fuzz sub-build builds libraries and fuzz targets only
    return()
  endif()
  cmake_parse_arguments(ARG "" "TIMEOUT" "DEPS;LABELS" ${ARGN})
  get_filename_component(name ${source} NAME_WE)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  pith_target_warnings(${name})
  add_test(NAME ${name} COMMAND ${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}")
  if("gpu" IN_LIST ARG_LABELS)
    # Without a device every GPU test skips itself; CTest then reports it as skipped.
    set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  endif()
endfunction()

# pith_add_library(name SOURCES ... DEPS ... [PUBLIC_DEPS ...])
# A Pith component library with the project's warnings and the repository root on its
# include path (headers are included as "common/status.h").
function(pith_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PUBLIC_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_DEPS})
  pith_target_warnings(${name})
endfunction()

# Tells `target` (a GPU test) that the build carries sm_90a code, so that on an sm_90 device
# it can insist that the code runs there (grouped_gemm_test).
function(pith_mark_sm90a target)
  if(CMAKE_CUDA_ARCHITECTURES MATCHES "90a")
    target_compile_definitions(${target} PRIVATE PITH_BUILT_SM90A)
  endif()
endfunction()
