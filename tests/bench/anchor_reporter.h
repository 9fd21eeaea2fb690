// A Google Benchmark reporter that, after the usual table, prints each benchmark's time
// as a ratio to its anchor measured in the same run: the anchor of "BM_Foo/64" is
// "BM_Anchor<Something>/64" (same argument suffix). Ratios, not absolute times, are what
// Pith's speed targets are stated in, because they hold across machines.
#ifndef PITH_TESTS_BENCH_ANCHOR_REPORTER_H_
#define PITH_TESTS_BENCH_ANCHOR_REPORTER_H_

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"

namespace pith::bench {

class AnchorReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      const std::string name = run.benchmark_name();
      const size_t slash = name.find('/');
      const std::string base = name.substr(0, slash);
      const std::string args = slash == std::string::npos ? "" : name.substr(slash);
      const double t = run.GetAdjustedRealTime();
      if (base.rfind("BM_Anchor", 0) == 0) {
        anchors_[args] = {base, t};
      } else {
        results_.push_back({name, args, t});
      }
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nratios to the anchor of the same run (time / anchor time):\n");
    for (const Result& r : results_) {
      auto it = anchors_.find(r.args);
      if (it == anchors_.end()) continue;
      std::printf("  %-48s %7.2fx  %s%s\n", r.name.c_str(), r.time / it->second.time,
                  it->second.name.c_str(), r.args.c_str());
    }
  }

 private:
  struct Anchor {
    std::string name;
    double time;
  };
  struct Result {
    std::string name;
    std::string args;
    double time;
  };
  std::map<std::string, Anchor> anchors_;
  std::vector<Result> results_;
};

}  // namespace pith::bench

// main() for a benchmark binary that reports ratios to its anchors.
#define PITH_BENCHMARK_MAIN()                                 \
  int main(int argc, char** argv) {                           \
    benchmark::Initialize(&argc, argv);                       \
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) { \
      return 1;                                               \
    }                                                         \
    pith::bench::AnchorReporter reporter;                     \
    benchmark::RunSpecifiedBenchmarks(&reporter);             \
    benchmark::Shutdown();                                    \
    return 0;                                                 \
  }

#endif  // PITH_TESTS_BENCH_ANCHOR_REPORTER_H_
