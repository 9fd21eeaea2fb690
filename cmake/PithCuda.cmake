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

# The CUDA backend as a module that `select` (the backend selection library) loads with
# dlopen only when a worker trains on a GPU (worker/backend/cuda_plugin.h): pith-worker
# itself links none of CUDA's libraries. Both sides get PITH_BACKEND_ABI, a hash of the
# compute interface the module is called through, and the loader refuses a module whose
# hash differs.
function(pith_add_cuda_plugin select)
  set(interface worker/compute/backend.h common/compute_dtype.h)
  set(abi "")
  foreach(f ${interface})
    file(SHA256 "${PROJECT_SOURCE_DIR}/${f}" h)
    string(APPEND abi "${h}")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${f}")
  endforeach()
  string(SHA256 abi "${abi}")
  string(SUBSTRING "${abi}" 0 16 abi)
  add_library(pith_cuda_backend MODULE "${PROJECT_SOURCE_DIR}/worker/cuda/cuda_plugin.cc")
  target_link_libraries(pith_cuda_backend PRIVATE pith_cuda)
  # Only the two entry points leave the module: the Pith code it carries (its own copy of
  # the compute engine) binds to itself, never to the loading binary's.
  target_link_options(pith_cuda_backend PRIVATE LINKER:--exclude-libs,ALL LINKER:-Bsymbolic
                      LINKER:--no-undefined)
  set_target_properties(pith_cuda_backend PROPERTIES CXX_VISIBILITY_PRESET hidden
                        VISIBILITY_INLINES_HIDDEN ON)
  target_compile_definitions(pith_cuda_backend PRIVATE PITH_BACKEND_ABI="${abi}")
  pith_target_warnings(pith_cuda_backend)
  target_compile_definitions(${select} PRIVATE PITH_WITH_CUDA PITH_BACKEND_ABI="${abi}")
  target_link_libraries(${select} PRIVATE ${CMAKE_DL_LIBS})
  add_dependencies(${select} pith_cuda_backend)
endfunction()
