# Compiler settings shared by every Pith target: warnings, sanitizers, ccache.

find_program(PITH_CCACHE ccache)
if(PITH_CCACHE)
  set(CMAKE_C_COMPILER_LAUNCHER "${PITH_CCACHE}")
  set(CMAKE_CXX_COMPILER_LAUNCHER "${PITH_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${PITH_CCACHE}")
endif()

if(PITH_ASAN AND PITH_TSAN)
  message(FATAL_ERROR "PITH_ASAN and PITH_TSAN cannot be combined")
endif()

# Warnings for Pith's own sources. Generated protobuf code gets none (see proto/).
# Designated initializers that leave fields at their defaults are idiomatic here.
set(PITH_WARNING_FLAGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers
                       -Wnon-virtual-dtor)
if(PITH_WERROR)
  list(APPEND PITH_WARNING_FLAGS -Werror)
endif()

set(PITH_SANITIZER_FLAGS "")
if(PITH_ASAN)
  set(PITH_SANITIZER_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer
                           -fno-sanitize-recover=undefined)
elseif(PITH_TSAN)
  set(PITH_SANITIZER_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
endif()
if(PITH_SANITIZER_FLAGS)
  add_compile_options(${PITH_SANITIZER_FLAGS})
  add_link_options(${PITH_SANITIZER_FLAGS})
endif()

# Applies Pith's warning flags to a target (C++ sources only; nvcc has its own set).
function(pith_target_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${PITH_WARNING_FLAGS}>)
endfunction()
