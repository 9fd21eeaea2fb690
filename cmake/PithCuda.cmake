# Enables CUDA when nvcc is present (and PITH_CUDA is on); sets PITH_HAVE_CUDA.
# Without nvcc everything else builds and the CPU backend carries every test.

set(PITH_HAVE_CUDA OFF)
if(PITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Without this CMake links the static cudart next to the shared one that cuBLAS pulls in.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    # CMake 3.25 knows no C++20 flag for nvcc; tell it which one to use.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    # NCCL beside the toolkit, or where PITH_NCCL_ROOT says (a Python wheel's nvidia/nccl
    # folder ships only libnccl.so.2; tests/gpu/run.sh passes it on the GPU machine).
    set(PITH_NCCL_ROOT "" CACHE PATH "Folder holding NCCL's include/ and lib/ (optional)")
    find_library(PITH_NCCL_LIBRARY NAMES nccl libnccl.so.2
                 HINTS ${PITH_NCCL_ROOT}/lib ${CUDAToolkit_LIBRARY_DIR} REQUIRED)
    find_path(PITH_NCCL_INCLUDE_DIR nccl.h
              HINTS ${PITH_NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS} REQUIRED)
    get_filename_component(PITH_NCCL_LIBRARY_DIR "${PITH_NCCL_LIBRARY}" DIRECTORY)
    add_library(pith_nccl SHARED IMPORTED)
    set_target_properties(pith_nccl PROPERTIES
      IMPORTED_LOCATION ${PITH_NCCL_LIBRARY}
      INTERFACE_INCLUDE_DIRECTORIES ${PITH_NCCL_INCLUDE_DIR})
    # Binaries find the CUDA libraries through ld.so.conf here; an RPATH finds them elsewhere.
    list(APPEND CMAKE_BUILD_RPATH ${CUDAToolkit_LIBRARY_DIR} ${PITH_NCCL_LIBRARY_DIR})
    list(APPEND CMAKE_INSTALL_RPATH ${CUDAToolkit_LIBRARY_DIR} ${PITH_NCCL_LIBRARY_DIR})
    set(PITH_HAVE_CUDA ON)
    message(STATUS "Pith: CUDA ${CMAKE_CUDA_COMPILER_VERSION} for sm_${CMAKE_CUDA_ARCHITECTURES}")
  else()
    message(STATUS "Pith: no nvcc found; building the CPU backend only")
  endif()
endif()
