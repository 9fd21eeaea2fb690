// CudaBackend: the bf16 products (tensor cores, fp32 accumulation), fanned out over side
// streams or as one cuBLAS grouped call, and the fp32 -> bf16 rounding. The backend's own
// handle runs in pedantic math mode (exact fp32, no TF32); the calls on it here switch it
// to the default mode for their own launch, since the pedantic mode may keep bf16
// products off the tensor cores, and back afterwards (the mode is read when a call is
// issued). The side streams' handles stay in the default mode.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <utility>
#include <vector>

#include "worker/cuda/batch_plan.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda {
namespace {

cudaStream_t S(CUstream_st* s) { return s; }
cublasHandle_t H(cublasContext* h) { return h; }
cublasOperation_t Op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

__global__ void ToBf16Kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  PITH_GRID_STRIDE(i, n) out[i] = __float2bfloat16_rn(in[i]);
}

// Sets the handle's math mode for the lifetime of the object, then restores pedantic.
class DefaultMath {
 public:
  explicit DefaultMath(cublasHandle_t h) : h_(h) { cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH); }
  ~DefaultMath() { cublasSetMathMode(h_, CUBLAS_PEDANTIC_MATH); }
  DefaultMath(const DefaultMath&) = delete;
  DefaultMath& operator=(const DefaultMath&) = delete;

 private:
  cublasHandle_t h_;
};

// A range of fp32 inputs and where its bf16 rounding goes.
struct Bf16Range {
  const float* src;
  __nv_bfloat16* dst;
  int64_t n;
};

// Rounds every range: blocks stride over the ranges in y and over each range's elements
// in x.
__global__ void RoundRangesKernel(const Bf16Range* ranges, int64_t count) {
  for (int64_t r = blockIdx.y; r < count; r += gridDim.y) {
    const Bf16Range range = ranges[r];
    for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < range.n;
         i += int64_t{gridDim.x} * blockDim.x) {
      range.dst[i] = __float2bfloat16_rn(range.src[i]);
    }
  }
}

// Elements an operand of `rows` x `cols` (as stored) with leading dimension `ld` spans.
int64_t Span(int rows, int cols, int ld) { return (int64_t{rows} - 1) * ld + cols; }

__global__ void AccumulateBf16Kernel(float* out, const __nv_bfloat16* in, int64_t n) {
  PITH_GRID_STRIDE(i, n) out[i] += __bfloat162float(in[i]);
}

// Whether no problem asks for an epilogue: then "its epilogues ran" holds whatever ran.
template <typename P>
bool NoEpilogue(const std::vector<P>& problems) {
  return std::none_of(problems.begin(), problems.end(),
                      [](const P& p) { return p.epilogue.any(); });
}

}  // namespace

void CudaBackend::AccumulateBf16(float* out, const void* in, int64_t n) {
  if (n == 0 || !Ready()) return;
  AccumulateBf16Kernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(
      out, static_cast<const __nv_bfloat16*>(in), n);
  CheckLaunch("AccumulateBf16");
}

void CudaBackend::ToBf16(void* out, const float* in, int64_t n) {
  if (n == 0 || !Ready()) return;
  ToBf16Kernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(static_cast<__nv_bfloat16*>(out), in, n);
  CheckLaunch("ToBf16");
}

namespace {

cublasStatus_t GemmEx(cublasHandle_t h, const CudaBackend::Bf16Gemm& p) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  return cublasGemmEx(h, Op(p.trans_b), Op(p.trans_a), p.n, p.m, p.k, &p.alpha, p.b, CUDA_R_16BF,
                      p.ldb, p.a, CUDA_R_16BF, p.lda, &p.beta, p.c,
                      p.c_fp32 ? CUDA_R_32F : CUDA_R_16BF, p.ldc, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

}  // namespace

bool CudaBackend::EmptyProductBf16(const Bf16Gemm& p, const char* op) {
  if (p.m != 0 && p.n != 0 && p.k != 0) return false;
  if (p.m == 0 || p.n == 0 || p.beta == 1.0f) return true;  // nothing to write
  if (p.beta != 0.0f) {
    Fail(op, "a bf16 product with k = 0 takes beta 0 or 1");
    return true;
  }
  // k = 0, beta 0: C is written with zeros, as Gemm does.
  const size_t elem = p.c_fp32 ? sizeof(float) : 2;
  CheckCuda(cudaMemset2DAsync(p.c, elem * p.ldc, 0, elem * p.n, p.m, S(stream_)), op);
  return true;
}

void CudaBackend::GemmBf16(const Bf16Gemm& p, const char* op) {
  if (p.epilogue.any()) {
    Fail(op, "an epilogue needs the grouped kernel");
    return;
  }
  if (!Ready() || EmptyProductBf16(p, op)) return;
  DefaultMath math(H(blas_));
  CheckBlas(GemmEx(H(blas_), p), op);
}

// Made on first use; a failure leaves none (FanOutGemmBf16 then runs on the backend's own
// stream, and they are not tried again) and does not fail the backend.
bool CudaBackend::MakeSideStreams() {
  if (!side_.streams.empty()) return true;
  if (side_failed_) return false;
  bool ok = true;
  for (int i = 0; ok && i < kMaxSideStreams; ++i) {
    cudaStream_t stream = nullptr;
    ok = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess;
    if (ok) side_.streams.push_back(stream);
    cublasHandle_t handle = nullptr;
    ok = ok && cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS;
    if (ok) side_.handles.push_back(handle);
    ok = ok && cublasSetStream(handle, stream) == CUBLAS_STATUS_SUCCESS;
  }
  for (int i = 0; ok && i <= kMaxSideStreams; ++i) {
    cudaEvent_t event = nullptr;
    ok = cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess;
    if (ok) side_.events.push_back(event);
  }
  if (!ok) {
    cudaGetLastError();  // not sticky: the backend goes on without side streams
    DestroySideStreams();
    side_failed_ = true;
  }
  return ok;
}

void CudaBackend::DestroySideStreams() {
  for (CUstream_st* s : side_.streams) cudaStreamSynchronize(S(s));
  for (cublasContext* h : side_.handles) cublasDestroy(H(h));
  for (CUstream_st* s : side_.streams) cudaStreamDestroy(S(s));
  for (CUevent_st* e : side_.events) cudaEventDestroy(e);
  side_ = {};
}

void CudaBackend::FanOutGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op) {
  FanOutBf16(problems, op, nullptr);
}

void CudaBackend::FanOutBf16(const std::vector<Bf16Gemm>& problems, const char* op,
                             const std::function<void()>& alongside) {
  if (problems.empty() || !Ready()) return;
  std::vector<const Bf16Gemm*> work;
  for (const Bf16Gemm& p : problems) {
    if (p.epilogue.any()) {
      Fail(op, "an epilogue needs the grouped kernel");
      return;
    }
    if (!EmptyProductBf16(p, op)) work.push_back(&p);
  }
  if (work.empty() || !Ready()) return;
  if (!MakeSideStreams()) {
    {
      DefaultMath math(H(blas_));
      for (const Bf16Gemm* p : work) {
        if (!CheckBlas(GemmEx(H(blas_), *p), op)) return;
      }
    }
    if (alongside) alongside();
    return;
  }
  const int used = std::min<int>(side_streams_, static_cast<int>(work.size()));
  cudaEvent_t fork = side_.events[kMaxSideStreams];
  if (!CheckCuda(cudaEventRecord(fork, S(stream_)), op)) return;
  for (int i = 0; i < used; ++i) {
    if (!CheckCuda(cudaStreamWaitEvent(S(side_.streams[i]), fork, 0), op)) return;
  }
  // Side stream i takes problems i, i + used, ...; its launches come from one thread,
  // which keeps its own first failure (error_ is the caller's alone).
  std::vector<int> failed(used, CUBLAS_STATUS_SUCCESS);
  auto launch = [&](int64_t begin, int64_t end) {
    // Pool threads bind the device here; a thread that cannot launches nothing.
    const bool bound = launch_pool_ == nullptr || cudaSetDevice(device_) == cudaSuccess;
    for (int64_t s = begin; s < end; ++s) {
      if (!bound) failed[s] = CUBLAS_STATUS_NOT_INITIALIZED;
      for (size_t i = s; i < work.size() && failed[s] == CUBLAS_STATUS_SUCCESS; i += used) {
        failed[s] = GemmEx(H(side_.handles[s]), *work[i]);
      }
    }
  };
  if (launch_pool_ != nullptr && used > 1) {
    launch_pool_->ParallelFor(used, 1, launch);
  } else {
    launch(0, used);
  }
  bool launched = true;
  for (int i = 0; i < used && launched; ++i) launched = CheckBlas(failed[i], op);
  if (launched && alongside) alongside();  // on the backend's stream, beside the side streams
  // The join: the backend's stream goes on once every side stream is done (after a failed
  // launch too, so that nothing later overtakes what the side streams still run).
  for (int i = 0; i < used; ++i) {
    if (!CheckCuda(cudaEventRecord(side_.events[i], S(side_.streams[i])), op) ||
        !CheckCuda(cudaStreamWaitEvent(S(stream_), side_.events[i], 0), op)) {
      return;
    }
  }
}

void CudaBackend::GroupedGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op) {
  if (problems.empty() || !Ready()) return;
  for (const Bf16Gemm& p : problems) {
    if (p.c_fp32 || p.m == 0 || p.n == 0 || p.k == 0 || p.epilogue.any()) {
      Fail(op, "cuBLAS's grouped bf16 product takes bf16 outputs, no empty problem, no epilogue");
      return;
    }
  }
  const GroupedArrays<Bf16Gemm> g(problems);
  const void* const* dev = UploadPointers(g.pointers, op);
  if (dev == nullptr) return;
  const int count = g.count;
  DefaultMath math(H(blas_));
  CheckBlas(cublasGemmGroupedBatchedEx(H(blas_), g.ta.data(), g.tb.data(), g.m.data(), g.n.data(),
                                       g.k.data(), g.alpha.data(), dev, CUDA_R_16BF, g.lda.data(),
                                       dev + count, CUDA_R_16BF, g.ldb.data(), g.beta.data(),
                                       const_cast<void* const*>(dev + 2 * count), CUDA_R_16BF,
                                       g.ldc.data(), count, g.size.data(), CUBLAS_COMPUTE_32F),
            op);
}

namespace {

PlanProduct ToPlan(const CudaBackend::Bf16Gemm& p) {
  return {p.trans_a,
          p.trans_b,
          p.m,
          p.n,
          p.k,
          p.lda,
          p.ldb,
          p.ldc,
          p.alpha,
          p.beta,
          p.c_fp32,
          reinterpret_cast<uintptr_t>(p.a),
          reinterpret_cast<uintptr_t>(p.b),
          reinterpret_cast<uintptr_t>(p.c)};
}

CudaBackend::Bf16Gemm FromPlan(const PlanProduct& p) {
  return {p.trans_a,
          p.trans_b,
          p.m,
          p.n,
          p.k,
          reinterpret_cast<const void*>(p.a),
          p.lda,
          reinterpret_cast<const void*>(p.b),
          p.ldb,
          p.beta,
          reinterpret_cast<void*>(p.c),
          p.ldc,
          p.c_fp32,
          p.alpha};
}

cublasStatus_t GemmBatchedEx(cublasHandle_t h, const BatchedCall& call, const void* const* dev) {
  const PlanProduct& s = call.shape;
  const int count = call.count();
  // As GemmEx: operands swapped; the entries' A's, then B's, then C's at `dev`.
  return cublasGemmBatchedEx(
      h, Op(s.trans_b), Op(s.trans_a), s.n, s.m, s.k, &s.alpha, dev + count, CUDA_R_16BF, s.ldb,
      dev, CUDA_R_16BF, s.lda, &s.beta, const_cast<void* const*>(dev + 2 * count),
      s.c_fp32 ? CUDA_R_32F : CUDA_R_16BF, s.ldc, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace

void CudaBackend::BatchedGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op) {
  if (batched_unsupported_) {  // cuBLAS refused a batched call's types before
    FanOutGemmBf16(problems, op);
    return;
  }
  if (problems.empty() || !Ready()) return;
  std::vector<PlanProduct> work;
  for (const Bf16Gemm& p : problems) {
    if (p.epilogue.any()) {
      Fail(op, "an epilogue needs the grouped kernel");
      return;
    }
    if (!EmptyProductBf16(p, op)) work.push_back(ToPlan(p));
  }
  if (work.empty() || !Ready()) return;
  const BatchPlan plan = PlanBatches(work);
  std::vector<const void*> pointers;  // per call: its A's, B's, C's
  for (const BatchedCall& call : plan.calls) {
    for (const auto* list : {&call.a, &call.b, &call.c}) {
      for (uintptr_t p : *list) pointers.push_back(reinterpret_cast<const void*>(p));
    }
  }
  const void* const* dev = pointers.empty() ? nullptr : UploadPointers(pointers, op);
  if (!pointers.empty() && dev == nullptr) return;
  // Launches the calls; `refused` becomes the first one cuBLAS refused for its types (it
  // and those after it launched nothing), or stays past the last.
  size_t refused = plan.calls.size();
  auto calls = [&] {
    DefaultMath math(H(blas_));
    for (size_t i = 0; i < plan.calls.size(); ++i) {
      const cublasStatus_t status = GemmBatchedEx(H(blas_), plan.calls[i], dev);
      if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
        refused = i;
        return;
      }
      if (!CheckBlas(status, op)) return;
      ++batched_calls_;
      dev += 3 * plan.calls[i].count();
    }
  };
  std::vector<Bf16Gemm> single;
  for (const PlanProduct& p : plan.single) single.push_back(FromPlan(p));
  if (single.empty()) {
    calls();
  } else {  // the singles' outputs are disjoint from the calls': run side by side
    FanOutBf16(single, op, calls);
  }
  if (refused == plan.calls.size()) return;
  // The refused calls' entries as products of their own, each call's after the one
  // before, as a tail must follow its full chunks; every later phase fans out at once.
  // No glog in the GPU-only build: one line on stderr, as glog's warnings go there too.
  batched_unsupported_ = true;
  std::fprintf(stderr,
               "W %s: cuBLAS refused a batched bf16 call (%s C, %d x %d x %d): this backend "
               "fans its bf16 products out from now on\n",
               op, plan.calls[refused].shape.c_fp32 ? "fp32" : "bf16", plan.calls[refused].shape.m,
               plan.calls[refused].shape.n, plan.calls[refused].shape.k);
  for (size_t c = refused; c < plan.calls.size(); ++c) {
    const BatchedCall& call = plan.calls[c];
    std::vector<Bf16Gemm> entries;
    for (int i = 0; i < call.count(); ++i) {
      PlanProduct p = call.shape;
      p.a = call.a[i];
      p.b = call.b[i];
      p.c = call.c[i];
      entries.push_back(FromPlan(p));
    }
    FanOutGemmBf16(entries, op);
  }
}

void CudaBackend::set_launch_threads(int n) {
  n = std::clamp(n, 1, kMaxSideStreams);
  if (n == launch_threads_) return;
  launch_threads_ = n;
  launch_pool_ = n > 1 ? std::make_unique<compute::ThreadPool>(n) : nullptr;
}

absl::Status CudaBackend::SetComputeDtype(ComputeDtype dtype) {
  dtype_ = dtype;
  return absl::OkStatus();
}

bool CudaBackend::Products(const std::vector<GemmProblem>& problems, const char* op) {
  if (dtype_ == ComputeDtype::kBf16) return ProductsBf16(problems, op);
  for (const GemmProblem& p : problems) {
    if (p.b_bf16 != nullptr || p.a_bf16 != nullptr) {
      Fail(op, "bf16 operands need the bf16 compute dtype");
      return false;
    }
  }
  GroupedGemm(problems, op);
  return NoEpilogue(problems);
}

bool CudaBackend::ProductsBf16(const std::vector<GemmProblem>& problems, const char* op) {
  const bool plain = NoEpilogue(problems);
  if (problems.empty() || !Ready()) return plain;
  // The element ranges the operands read, as [begin, end) addresses, merged; operands
  // already in bf16 are read as they are.
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const GemmProblem& p : problems) {
    if (p.m == 0 || p.n == 0 || p.k == 0) continue;
    const int64_t a = p.trans_a ? Span(p.k, p.m, p.lda) : Span(p.m, p.k, p.lda);
    const int64_t b = p.trans_b ? Span(p.n, p.k, p.ldb) : Span(p.k, p.n, p.ldb);
    if (p.a_bf16 == nullptr) {
      spans.emplace_back(reinterpret_cast<uintptr_t>(p.a), reinterpret_cast<uintptr_t>(p.a + a));
    }
    if (p.b_bf16 == nullptr) {
      spans.emplace_back(reinterpret_cast<uintptr_t>(p.b), reinterpret_cast<uintptr_t>(p.b + b));
    }
  }
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& span : spans) {
    if (!merged.empty() && span.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, span.second);
    } else {
      merged.push_back(span);
    }
  }
  if (merged.empty()) {  // every operand in bf16 already, or every problem empty
    return RunBf16Products(problems, {}, {}, nullptr, op);
  }
  // Each range's rounding starts 256-byte aligned in the scratch.
  std::vector<Bf16Range> ranges;
  std::vector<int64_t> starts;  // element offsets in the scratch
  int64_t total = 0, longest = 0;
  for (const auto& [begin, end] : merged) {
    const int64_t n = static_cast<int64_t>((end - begin) / sizeof(float));
    starts.push_back(total);
    ranges.push_back({reinterpret_cast<const float*>(begin), nullptr, n});
    total += (n + 127) / 128 * 128;
    longest = std::max(longest, n);
  }
  auto* rounded = static_cast<__nv_bfloat16*>(Scratch(kBf16, sizeof(__nv_bfloat16) * total));
  void* table = Scratch(kBf16Ranges, sizeof(Bf16Range) * ranges.size());
  if (rounded == nullptr || table == nullptr) return plain;
  for (size_t i = 0; i < ranges.size(); ++i) ranges[i].dst = rounded + starts[i];
  // Pageable source: the copy returns once `ranges` is staged (see UploadPointers).
  if (!CheckCuda(cudaMemcpyAsync(table, ranges.data(), sizeof(Bf16Range) * ranges.size(),
                                 cudaMemcpyHostToDevice, S(stream_)),
                 op)) {
    return plain;
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(1024, (longest + 4095) / 4096)),
                  static_cast<unsigned>(std::min<size_t>(ranges.size(), 65535)));
  RoundRangesKernel<<<grid, kThreads, 0, S(stream_)>>>(static_cast<const Bf16Range*>(table),
                                                       static_cast<int64_t>(ranges.size()));
  if (!CheckLaunch(op)) return plain;
  return RunBf16Products(problems, merged, starts, rounded, op);
}

bool CudaBackend::RunBf16Products(const std::vector<GemmProblem>& problems,
                                  const std::vector<std::pair<uintptr_t, uintptr_t>>& merged,
                                  const std::vector<int64_t>& starts, const void* rounded,
                                  const char* op) {
  // An input's bf16 copy: the merged range that holds it, at the same element offset.
  auto in_bf16 = [&](const float* p) -> const void* {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    const size_t i =
        std::upper_bound(merged.begin(), merged.end(), std::make_pair(at, UINTPTR_MAX)) -
        merged.begin() - 1;
    return static_cast<const __nv_bfloat16*>(rounded) + starts[i] +
           (at - merged[i].first) / sizeof(float);
  };
  std::vector<Bf16Gemm> bf16;
  bf16.reserve(problems.size());
  for (const GemmProblem& p : problems) {
    const bool empty = p.m == 0 || p.n == 0 || p.k == 0;
    const void* a = p.a_bf16 != nullptr ? p.a_bf16 : empty ? nullptr : in_bf16(p.a);
    const void* b = p.b_bf16 != nullptr ? p.b_bf16 : empty ? nullptr : in_bf16(p.b);
    bf16.push_back({p.trans_a, p.trans_b, p.m, p.n, p.k, a, p.lda, b, p.ldb, p.beta, p.c, p.ldc,
                    true, p.alpha, p.epilogue});
  }
  if (bf16_products_ == Bf16Products::kKernel && KernelGemmBf16(bf16, op)) return true;
  for (Bf16Gemm& p : bf16) p.epilogue = {};  // the caller runs them as passes of their own
  if (bf16.size() == 1) {
    GemmBf16(bf16[0], op);
  } else if (bf16_products_ == Bf16Products::kBatched) {
    BatchedGemmBf16(bf16, op);
  } else {
    FanOutGemmBf16(bf16, op);
  }
  return NoEpilogue(problems);
}

}  // namespace pith::cuda
