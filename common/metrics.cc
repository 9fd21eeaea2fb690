#include "common/metrics.h"

#include <chrono>
#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/version.h"
#include "prometheus/exposer.h"
#include "prometheus/text_serializer.h"

namespace pith {
namespace {

// prometheus-cpp reports bad names and type clashes by throwing; Pith turns them into a
// Status at this boundary.
template <typename Metric, typename Builder, typename... Args>
absl::StatusOr<Metric*> AddMetric(Builder builder, prometheus::Registry& registry,
                                  const std::string& name, const std::string& help,
                                  const MetricLabels& labels, Args&&... args) {
  try {
    auto& family = builder.Name(name).Help(help).Register(registry);
    return &family.Add(labels, std::forward<Args>(args)...);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": ", e.what()));
  }
}

}  // namespace

MetricsRegistry::MetricsRegistry() : registry_(std::make_shared<prometheus::Registry>()) {}

absl::StatusOr<prometheus::Counter*> MetricsRegistry::Counter(const std::string& name,
                                                              const std::string& help,
                                                              const MetricLabels& labels) {
  return AddMetric<prometheus::Counter>(prometheus::BuildCounter(), *registry_, name, help, labels);
}

absl::StatusOr<prometheus::Gauge*> MetricsRegistry::Gauge(const std::string& name,
                                                          const std::string& help,
                                                          const MetricLabels& labels) {
  return AddMetric<prometheus::Gauge>(prometheus::BuildGauge(), *registry_, name, help, labels);
}

absl::StatusOr<prometheus::Histogram*> MetricsRegistry::Histogram(
    const std::string& name, const std::string& help, const std::vector<double>& buckets,
    const MetricLabels& labels) {
  return AddMetric<prometheus::Histogram>(prometheus::BuildHistogram(), *registry_, name, help,
                                          labels, prometheus::Histogram::BucketBoundaries(buckets));
}

std::vector<double> MetricsRegistry::LatencyBuckets() {
  std::vector<double> buckets;
  for (double b = 10e-6; b < 60; b *= 4) buckets.push_back(b);
  return buckets;
}

std::string MetricsRegistry::Serialize() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

struct MetricsExposer::Impl {
  std::unique_ptr<prometheus::Exposer> exposer;
};

MetricsExposer::MetricsExposer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsExposer::~MetricsExposer() = default;

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(
    const std::string& bind_address, const MetricsRegistry& registry) {
  auto impl = std::make_unique<Impl>();
  try {
    // Two threads are plenty for a scrape every few seconds.
    impl->exposer = std::make_unique<prometheus::Exposer>(bind_address, 2);
    impl->exposer->RegisterCollectable(registry.registry());
    std::vector<int> ports = impl->exposer->GetListeningPorts();
    if (ports.empty()) {
      return absl::UnavailableError(absl::StrCat("metrics: no port bound on ", bind_address));
    }
    const int port = ports.front();
    return std::unique_ptr<MetricsExposer>(new MetricsExposer(std::move(impl), port));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot serve on ", bind_address, ": ", e.what()));
  }
}

absl::Status RegisterProcessMetrics(MetricsRegistry& registry, const std::string& component) {
  ASSIGN_OR_RETURN(prometheus::Gauge * info,
                   registry.Gauge("pith_build_info", "Pith build; the value is always 1",
                                  {{"component", component}, {"version", kPithVersion}}));
  info->Set(1);
  ASSIGN_OR_RETURN(prometheus::Gauge * start,
                   registry.Gauge("pith_process_start_time_seconds",
                                  "Start time of the process since the Unix epoch"));
  start->Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  return absl::OkStatus();
}

}  // namespace pith
