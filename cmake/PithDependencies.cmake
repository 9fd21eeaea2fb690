# Third-party packages, all from Debian 12 (deploy/install-deps.sh installs them).

find_package(Threads REQUIRED)
find_package(Protobuf REQUIRED)  # module mode: Debian ships no config package
find_package(absl CONFIG REQUIRED)
# pith certs, the data plane's message tags (gRPC links OpenSSL too).
find_package(OpenSSL REQUIRED)

find_package(gRPC CONFIG REQUIRED)
find_package(ucx CONFIG REQUIRED)
find_package(RocksDB CONFIG REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(glog CONFIG REQUIRED)  # glog::glog (Debian's Abseil has no absl/log)

if(PITH_FUZZ_ONLY)
  # The fuzz sub-build runs the servers' handlers, not the compute engine or the tests.
  return()
endif()

find_package(GTest REQUIRED)
find_package(benchmark REQUIRED)

set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(PITH_CBLAS_INCLUDE_DIR cblas.h
          PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas
          REQUIRED)

