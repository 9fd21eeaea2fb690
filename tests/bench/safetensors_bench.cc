// safetensors load cost against reading the same bytes raw from the page cache: the
// parse and validation of a checkpoint must cost next to nothing beyond the read.
// Argument: MiB of tensor data, in 64 tensors.
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "anchor_reporter.h"
#include "common/file.h"
#include "common/safetensors.h"

namespace pith {
namespace {

std::string MakeCheckpoint(int mib) {
  const std::string path = "/tmp/pith_safetensors_bench_" + std::to_string(::getpid()) + "_" +
                           std::to_string(mib) + ".safetensors";
  const int64_t per_tensor = int64_t{mib} * (1 << 20) / 4 / 64;
  std::vector<Tensor> tensors;
  SafetensorsWriter writer;
  for (int i = 0; i < 64; ++i) {
    tensors.push_back(*Tensor::Zeros(DType::kF32, {per_tensor}));
    float* p = tensors.back().data<float>();
    for (int64_t j = 0; j < per_tensor; ++j) p[j] = static_cast<float>(i + j);
    if (!writer.Add("h." + std::to_string(i) + ".w", tensors.back().view()).ok()) std::abort();
  }
  if (!writer.Write(path).ok()) std::abort();
  return path;
}

void BM_AnchorReadFile(benchmark::State& state) {
  const std::string path = MakeCheckpoint(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::StatusOr<Buffer> bytes = ReadFile(path);
    if (!bytes.ok()) state.SkipWithError("read failed");
    benchmark::DoNotOptimize(bytes->data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * (1 << 20));
  ::unlink(path.c_str());
}

void BM_SafetensorsRead(benchmark::State& state) {
  const std::string path = MakeCheckpoint(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
    if (!file.ok()) state.SkipWithError("parse failed");
    benchmark::DoNotOptimize(file->Get("h.63.w")->bytes.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * (1 << 20));
  ::unlink(path.c_str());
}

BENCHMARK(BM_AnchorReadFile)->Arg(16)->Arg(256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SafetensorsRead)->Arg(16)->Arg(256)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace pith

PITH_BENCHMARK_MAIN();
