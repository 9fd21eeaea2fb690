# PITH_GPU_ONLY: the compute engine, the model, the CUDA backend and their GPU tests and
# benchmark, and nothing else. For a GPU machine that has nvcc, CMake and a compiler but
# none of Pith's other dependencies: Abseil and GoogleTest are built from the sources that
# tests/gpu/vendor.sh puts in .gpu-deps/ (ignored by git; the device run carries it), and
# the CPU backend (the reference the GPU tests compare against) uses the portable sgemm
# instead of OpenBLAS. tests/gpu/run.sh drives it.

set(PITH_GPU_DEPS "${PROJECT_SOURCE_DIR}/.gpu-deps" CACHE PATH
    "Abseil and GoogleTest sources for the GPU-only build (tests/gpu/vendor.sh)")
foreach(dep abseil-cpp googletest)
  if(NOT EXISTS "${PITH_GPU_DEPS}/${dep}/CMakeLists.txt")
    message(FATAL_ERROR "PITH_GPU_ONLY needs ${PITH_GPU_DEPS}/${dep}: run tests/gpu/vendor.sh")
  endif()
endforeach()

find_package(Threads REQUIRED)
set(ABSL_PROPAGATE_CXX_STD ON)
set(ABSL_BUILD_TESTING OFF)
set(BUILD_TESTING OFF)
# This Abseil (Debian 12's, 20220623) predates GCC 13, which no longer brings <cstdint>
# in through other headers; force it in for Abseil's own sources.
set(pith_saved_cxx_flags "${CMAKE_CXX_FLAGS}")
string(APPEND CMAKE_CXX_FLAGS " -include cstdint")
add_subdirectory("${PITH_GPU_DEPS}/abseil-cpp" "${CMAKE_BINARY_DIR}/abseil" EXCLUDE_FROM_ALL SYSTEM)
set(CMAKE_CXX_FLAGS "${pith_saved_cxx_flags}")
set(INSTALL_GTEST OFF)
set(BUILD_GMOCK ON)
add_subdirectory("${PITH_GPU_DEPS}/googletest" "${CMAKE_BINARY_DIR}/googletest" EXCLUDE_FROM_ALL
                 SYSTEM)
foreach(t gtest gtest_main gmock)
  if(NOT TARGET GTest::${t})
    add_library(GTest::${t} ALIAS ${t})
  endif()
endforeach()

include(PithCuda)
if(NOT PITH_HAVE_CUDA)
  message(FATAL_ERROR "PITH_GPU_ONLY needs nvcc")
endif()

pith_add_library(pith_compute
  SOURCES worker/compute/backend.cc worker/compute/thread_pool.cc worker/compute/cpu_backend.cc
          worker/compute/cpu_backend_moe.cc worker/compute/cpu_kernels.cc
          worker/compute/cpu_kernels_avx2.cc worker/compute/portable_blas.cc
  PUBLIC_DEPS absl::status absl::statusor absl::strings absl::span Threads::Threads)
target_compile_definitions(pith_compute PUBLIC PITH_PORTABLE_BLAS)
set_source_files_properties(worker/compute/cpu_kernels.cc PROPERTIES
                            COMPILE_OPTIONS "-fno-trapping-math;-fno-math-errno")
set_source_files_properties(worker/compute/cpu_kernels_avx2.cc PROPERTIES
                            COMPILE_OPTIONS "-fno-trapping-math;-fno-math-errno;-mavx2;-mfma")

pith_add_library(pith_model
  SOURCES common/param_layout.cc worker/model/moe_gpt.cc worker/model/optimizer.cc
          worker/model/param_init.cc
  PUBLIC_DEPS pith_compute absl::strings)

pith_add_library(pith_batch_plan SOURCES worker/cuda/batch_plan.cc)
pith_add_test(worker/cuda/batch_plan_test.cc DEPS pith_batch_plan)

pith_add_library(pith_cuda
  SOURCES worker/cuda/device_probe.cu worker/cuda/cuda_backend.cu worker/cuda/cuda_dense.cu
          worker/cuda/cuda_moe.cu worker/cuda/cuda_bf16.cu worker/cuda/cuda_grouped.cu
          worker/cuda/cuda_wgmma.cu worker/cuda/device_slots.cu worker/cuda/nccl_group.cc
  PUBLIC_DEPS pith_compute CUDA::cudart absl::time
  DEPS CUDA::cublas pith_nccl pith_batch_plan)

pith_add_library(pith_backend_select
  SOURCES worker/backend/backend_select.cc
  PUBLIC_DEPS pith_compute)
pith_add_cuda_plugin(pith_backend_select)

pith_add_test(worker/cuda/device_probe_test.cc DEPS pith_cuda LABELS gpu)
pith_add_test(worker/cuda/cuda_backend_test.cc DEPS pith_cuda LABELS gpu)
pith_add_test(worker/cuda/device_slots_test.cc DEPS pith_cuda LABELS gpu)
pith_add_test(worker/cuda/nccl_group_test.cc DEPS pith_cuda LABELS gpu)
pith_add_test(worker/cuda/grouped_gemm_test.cc DEPS pith_cuda LABELS gpu)
pith_mark_sm90a(grouped_gemm_test)
pith_add_test(worker/cuda/cuda_training_test.cc DEPS pith_cuda pith_model LABELS gpu TIMEOUT 300)
pith_add_test(worker/backend/backend_select_test.cc DEPS pith_backend_select LABELS gpu)

add_executable(gpu_bench worker/cuda/gpu_bench.cc)
target_link_libraries(gpu_bench PRIVATE pith_cuda)
pith_target_warnings(gpu_bench)

# The CPU backend's own checks, here on the portable sgemm the GPU tests compare against.
pith_add_test(worker/compute/cpu_backend_test.cc DEPS pith_compute)
