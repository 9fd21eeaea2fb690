// Metrics: a thin wrapper over prometheus-cpp. Every Pith process owns one
// MetricsRegistry, registers its metrics at start-up (DESIGN §7 names: prefix `pith_`,
// units in the name, latency as histograms) and serves them with a MetricsExposer on
// --metrics_port.
//
// Thread safety: MetricsRegistry is thread-safe; the returned metric objects are
// lock-free to update from any thread and live as long as the registry.
#ifndef PITH_COMMON_METRICS_H_
#define PITH_COMMON_METRICS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace pith {

using MetricLabels = std::map<std::string, std::string>;

class MetricsRegistry {
 public:
  MetricsRegistry();

  // The metric `name` with `labels`, registered on first use. INVALID_ARGUMENT for an
  // invalid name or label, or a name already registered as another metric type.
  absl::StatusOr<prometheus::Counter*> Counter(const std::string& name, const std::string& help,
                                               const MetricLabels& labels = {});
  absl::StatusOr<prometheus::Gauge*> Gauge(const std::string& name, const std::string& help,
                                           const MetricLabels& labels = {});
  absl::StatusOr<prometheus::Histogram*> Histogram(const std::string& name, const std::string& help,
                                                   const std::vector<double>& buckets,
                                                   const MetricLabels& labels = {});

  // Drops the gauge `name` with `labels` from the exposition, if there (a series that
  // stopped meaning anything: an ended job's).
  void RemoveGauge(const std::string& name, const MetricLabels& labels);

  // Exponential buckets from 10 us to ~42 s, for `_seconds` histograms.
  static std::vector<double> LatencyBuckets();

  // `refresh` runs before each Serialize (each scrape), to set gauges that are read
  // rather than kept (disk space, counts of members and jobs). It must not call
  // Serialize; it may register metrics.
  void OnScrape(std::function<void()> refresh);

  // The Prometheus text exposition of every metric (what /metrics serves), after running
  // the OnScrape hooks.
  std::string Serialize() const;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  mutable absl::Mutex mu_;
  std::vector<std::function<void()>> refresh_ ABSL_GUARDED_BY(mu_);
};

// Where a server's /metrics binds: `metrics_host` (its --metrics_listen) when given, else
// the host of its gRPC `listen` address ("0.0.0.0:7000" -> "0.0.0.0"), with `port`.
std::string MetricsBindAddress(const std::string& metrics_host, const std::string& listen,
                               int port);

// A page the HTTP port serves beside /metrics (the coordinator's dashboard): its answer
// to a GET of its path, given the request's query string (after '?', still encoded).
struct HttpResponse {
  int status = 200;
  std::string content_type;
  std::string body;
};
using HttpHandler = std::function<HttpResponse(const std::string& query)>;

// Serves a registry on http://<bind>/metrics, and `routes` (path -> handler) beside it,
// until destroyed. One request at a time on one thread; GET only; every answer carries
// no-store, nosniff and a same-origin Content-Security-Policy.
class MetricsExposer {
 public:
  // Binds `bind_address` ("127.0.0.1:9100", "0.0.0.0:0" for an ephemeral port).
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(
      const std::string& bind_address, const MetricsRegistry& registry,
      std::map<std::string, HttpHandler> routes = {});
  ~MetricsExposer();
  MetricsExposer(const MetricsExposer&) = delete;
  MetricsExposer& operator=(const MetricsExposer&) = delete;

  // The bound port (the ephemeral one when 0 was asked for).
  int port() const { return port_; }

 private:
  struct Impl;
  explicit MetricsExposer(std::unique_ptr<Impl> impl, int port);

  std::unique_ptr<Impl> impl_;
  int port_;
};

// Registers the metrics every Pith process exposes: pith_build_info{component,version}
// (always 1) and pith_process_start_time_seconds.
absl::Status RegisterProcessMetrics(MetricsRegistry& registry, const std::string& component);

}  // namespace pith

#endif  // PITH_COMMON_METRICS_H_
