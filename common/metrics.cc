#include "common/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/version.h"
#include "glog/logging.h"
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

void MetricsRegistry::RemoveGauge(const std::string& name, const MetricLabels& labels) {
  try {
    auto& family = prometheus::BuildGauge().Name(name).Register(*registry_);
    if (family.Has(labels)) family.Remove(&family.Add(labels));
  } catch (const std::exception& e) {
    LOG(WARNING) << "metric " << name << ": " << e.what();
  }
}

std::vector<double> MetricsRegistry::LatencyBuckets() {
  std::vector<double> buckets;
  for (double b = 10e-6; b < 60; b *= 4) buckets.push_back(b);
  return buckets;
}

void MetricsRegistry::OnScrape(std::function<void()> refresh) {
  absl::MutexLock lock(&mu_);
  refresh_.push_back(std::move(refresh));
}

std::string MetricsRegistry::Serialize() const {
  std::vector<std::function<void()>> refresh;
  {
    absl::MutexLock lock(&mu_);
    refresh = refresh_;
  }
  for (const std::function<void()>& r : refresh) r();
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

// A small HTTP/1.1 server of its own, on one thread with a normal stack: GET /metrics
// answers the registry's text exposition, a route's path its handler, anything else 404. (civetweb,
// under prometheus-cpp's Exposer, starts threads with a small fixed stack, which a process whose
// libraries carry large thread-local storage — OpenBLAS — overflows.)
struct MetricsExposer::Impl {
  const MetricsRegistry* registry = nullptr;
  std::map<std::string, HttpHandler> routes;
  int listen_fd = -1;
  int wake[2] = {-1, -1};  // a pipe: the destructor writes to stop the loop
  std::thread thread;

  ~Impl() {
    if (wake[1] >= 0) (void)!::write(wake[1], "x", 1);
    if (thread.joinable()) thread.join();
    for (int fd : {listen_fd, wake[0], wake[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }

  // The whole HTTP response to `request` (its head, at least the request line).
  std::string Answer(const std::string& request) const {
    HttpResponse r{404, "text/plain; charset=utf-8", "not found\n"};
    const size_t line_end = request.find("\r\n");
    const std::vector<std::string> line =
        absl::StrSplit(request.substr(0, line_end == std::string::npos ? 0 : line_end), ' ');
    if (line.size() != 3 || !absl::StartsWith(line[2], "HTTP/1.")) {
      r = {400, "text/plain; charset=utf-8", "bad request\n"};
    } else if (line[0] != "GET") {
      r = {405, "text/plain; charset=utf-8", "GET only\n"};
    } else {
      const size_t q = line[1].find('?');
      const std::string path = line[1].substr(0, q);
      const std::string query = q == std::string::npos ? "" : line[1].substr(q + 1);
      if (path == "/metrics") {
        r = {200, "text/plain; version=0.0.4; charset=utf-8", registry->Serialize()};
      } else if (auto it = routes.find(path); it != routes.end()) {
        r = it->second(query);
      }
    }
    const char* reason = r.status == 200   ? "OK"
                         : r.status == 400 ? "Bad Request"
                         : r.status == 404 ? "Not Found"
                         : r.status == 405 ? "Method Not Allowed"
                                           : "Error";
    return absl::StrCat("HTTP/1.1 ", r.status, " ", reason, "\r\nContent-Type: ", r.content_type,
                        "\r\nContent-Length: ", r.body.size(),
                        "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                        "Content-Security-Policy: default-src 'self'; style-src 'self' "
                        "'unsafe-inline'\r\nConnection: close\r\n\r\n",
                        r.body);
  }

  // Waits until `fd` is ready for `events` (POLLIN, POLLOUT) before `deadline`, a signal
  // (SIGHUP reloads) retried: false when the deadline passed or the stop pipe woke up.
  bool WaitFor(int fd, short events, std::chrono::steady_clock::time_point deadline) {
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) return false;
      pollfd fds[2] = {{fd, events, 0}, {wake[0], POLLIN, 0}};
      const int ready = ::poll(fds, 2, static_cast<int>(left));
      if (ready < 0 && errno == EINTR) continue;
      return ready > 0 && fds[1].revents == 0;
    }
  }

  void Serve(int fd) {
    timeval timeout{2, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    // One overall deadline per request, and the stop pipe watched meanwhile: a slow or
    // silent client cannot hold the thread (or shutdown) up.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    std::string request;
    char buf[2048];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 16384) {
      if (!WaitFor(fd, POLLIN, deadline)) break;
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
    }
    const std::string response = Answer(request);
    // The answer goes out under a deadline of its own, the stop pipe watched: a client
    // that reads slowly (or not at all) cannot hold the thread either.
    const auto send_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    size_t sent = 0;
    while (sent < response.size()) {
      if (!WaitFor(fd, POLLOUT, send_deadline)) break;
      const ssize_t n =
          ::send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::close(fd);
  }

  void Loop() {
    while (true) {
      pollfd fds[2] = {{listen_fd, POLLIN, 0}, {wake[0], POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents != 0) return;
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) Serve(fd);
      }
    }
  }
};

MetricsExposer::MetricsExposer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsExposer::~MetricsExposer() = default;

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(
    const std::string& bind_address, const MetricsRegistry& registry,
    std::map<std::string, HttpHandler> routes) {
  const size_t colon = bind_address.rfind(':');
  int port = 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(bind_address.substr(colon + 1), &port) ||
      port < 0 || port > 65535 ||
      ::inet_pton(AF_INET, bind_address.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: bad address ", bind_address, " (want IPv4:port)"));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  auto impl = std::make_unique<Impl>();
  impl->registry = &registry;
  impl->routes = std::move(routes);
  // Non-blocking: a connection reset between poll and accept must not block the thread.
  impl->listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int one = 1;
  if (impl->listen_fd < 0 ||
      ::setsockopt(impl->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      ::bind(impl->listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(impl->listen_fd, 16) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot serve on ", bind_address, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(impl->listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (::pipe2(impl->wake, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("metrics: pipe: ", std::strerror(errno)));
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<MetricsExposer>(new MetricsExposer(std::move(impl), ntohs(addr.sin_port)));
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

std::string MetricsBindAddress(const std::string& metrics_host, const std::string& listen,
                               int port) {
  std::string host = metrics_host;
  if (host.empty()) {
    const size_t colon = listen.rfind(':');
    host = colon == std::string::npos ? listen : listen.substr(0, colon);
  }
  if (host.empty()) host = "127.0.0.1";
  return absl::StrCat(host, ":", port);
}

}  // namespace pith
