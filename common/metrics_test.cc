#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith {
namespace {

using ::testing::HasSubstr;

// GET http://<host>:port/path over a plain socket (host: 127.0.0.1 unless given, as a
// 32-bit address); returns the whole response, empty when it cannot connect.
std::string HttpGet(int port, const std::string& path, uint32_t host = INADDR_LOOPBACK) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(host);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (::send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return "";
  }
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return response;
}

TEST(MetricsTest, ExposerServesTheRegistryOverHttp) {
  MetricsRegistry registry;
  ASSERT_TRUE(RegisterProcessMetrics(registry, "test").ok());
  absl::StatusOr<prometheus::Counter*> tokens =
      registry.Counter("pith_worker_tokens_total", "Tokens trained on");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  (*tokens)->Increment(1234);
  absl::StatusOr<prometheus::Histogram*> step = registry.Histogram(
      "pith_worker_step_seconds", "Step wall time", MetricsRegistry::LatencyBuckets());
  ASSERT_TRUE(step.ok());
  (*step)->Observe(0.25);
  absl::StatusOr<prometheus::Gauge*> heat = registry.Gauge(
      "pith_coordinator_expert_heat", "Decayed expert heat", {{"layer", "1"}, {"expert", "7"}});
  ASSERT_TRUE(heat.ok());
  (*heat)->Set(3.5);

  absl::StatusOr<std::unique_ptr<MetricsExposer>> exposer =
      MetricsExposer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  ASSERT_GT((*exposer)->port(), 0);

  const std::string response = HttpGet((*exposer)->port(), "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response, HasSubstr("pith_worker_tokens_total 1234"));
  EXPECT_THAT(response, HasSubstr("pith_worker_step_seconds_count 1"));
  EXPECT_THAT(response, HasSubstr("pith_coordinator_expert_heat{expert=\"7\",layer=\"1\"} 3.5"));
  EXPECT_THAT(response, HasSubstr("pith_build_info{component=\"test\",version=\""));

  // Updates show on the next scrape.
  (*tokens)->Increment(1);
  EXPECT_THAT(HttpGet((*exposer)->port(), "/metrics"), HasSubstr("pith_worker_tokens_total 1235"));
}

TEST(MetricsTest, ExposerServesRoutesBesideTheMetrics) {
  MetricsRegistry registry;
  std::string seen_query;
  std::map<std::string, HttpHandler> routes;
  routes["/page"] = [&](const std::string& query) {
    seen_query = query;
    return HttpResponse{200, "text/html; charset=utf-8", "<p>hello</p>"};
  };
  absl::StatusOr<std::unique_ptr<MetricsExposer>> exposer =
      MetricsExposer::Start("127.0.0.1:0", registry, std::move(routes));
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  const std::string page = HttpGet((*exposer)->port(), "/page?job=a%20b");
  EXPECT_THAT(page, HasSubstr("200 OK"));
  EXPECT_THAT(page, HasSubstr("Content-Type: text/html; charset=utf-8"));
  EXPECT_THAT(page, HasSubstr("Content-Security-Policy: default-src 'self'"));
  EXPECT_THAT(page, HasSubstr("\r\n\r\n<p>hello</p>"));
  EXPECT_EQ(seen_query, "job=a%20b");
  EXPECT_THAT(HttpGet((*exposer)->port(), "/metrics"), HasSubstr("200 OK"));
  EXPECT_THAT(HttpGet((*exposer)->port(), "/other"), HasSubstr("404 Not Found"));
  EXPECT_THAT(HttpGet((*exposer)->port(), "/page/x"), HasSubstr("404 Not Found"));
}

// /metrics binds the interface asked for (--metrics_listen), else --listen's host: a
// server listening on loopback does not serve its metrics on every interface.
TEST(MetricsTest, TheExposerBindsOnlyTheHostAskedFor) {
  EXPECT_EQ(MetricsBindAddress("", "127.0.0.1:7000", 9100), "127.0.0.1:9100");
  EXPECT_EQ(MetricsBindAddress("", "0.0.0.0:7000", 0), "0.0.0.0:0");
  EXPECT_EQ(MetricsBindAddress("10.1.2.3", "127.0.0.1:7000", 9100), "10.1.2.3:9100");
  MetricsRegistry registry;
  auto exposer = MetricsExposer::Start(MetricsBindAddress("", "127.0.0.1:0", 0), registry);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  EXPECT_THAT(HttpGet((*exposer)->port(), "/metrics"), HasSubstr("200 OK"));
  // 127.0.0.2 is loopback too, but not the address bound.
  EXPECT_EQ(HttpGet((*exposer)->port(), "/metrics", 0x7f000002), "");
}

TEST(MetricsTest, ScrapeHooksSetGaugesBeforeEachScrape) {
  MetricsRegistry registry;
  int scrapes = 0;
  registry.OnScrape([&] {
    auto g = registry.Gauge("pith_test_scrapes", "Scrapes so far");
    if (g.ok()) (*g)->Set(++scrapes);
  });
  EXPECT_THAT(registry.Serialize(), HasSubstr("pith_test_scrapes 1"));
  EXPECT_THAT(registry.Serialize(), HasSubstr("pith_test_scrapes 2"));
}

TEST(MetricsTest, SameNameAndLabelsIsTheSameMetric) {
  MetricsRegistry registry;
  auto a = registry.Counter("pith_store_gets_total", "Gets", {{"tier", "ram"}});
  auto b = registry.Counter("pith_store_gets_total", "Gets", {{"tier", "ram"}});
  auto c = registry.Counter("pith_store_gets_total", "Gets", {{"tier", "rocksdb"}});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
}

TEST(MetricsTest, BadNamesAndTypeClashesAreErrors) {
  MetricsRegistry registry;
  EXPECT_EQ(registry.Counter("bad name", "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Gauge("pith_x", "x", {{"bad-label", "v"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.Counter("pith_clash_total", "x").ok());
  EXPECT_EQ(registry.Gauge("pith_clash_total", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsTest, BusyPortIsUnavailable) {
  MetricsRegistry registry;
  auto first = MetricsExposer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(first.ok());
  auto second = MetricsExposer::Start("127.0.0.1:" + std::to_string((*first)->port()), registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pith
