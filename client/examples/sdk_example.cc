// A program that uses the Pith SDK and nothing else of Pith: it connects to a coordinator
// and lists its jobs, newest first. Build it against the `pith_client` target alone; that
// target links protos, gRPC and Abseil, no compute engine or model code (sdk_link_test).
//
// Usage: sdk_example [HOST:PORT] [TLS_DIR]
//   HOST:PORT default $PITH_COORDINATOR, else 127.0.0.1:7000; TLS_DIR (a user's or an
//   admin's directory from `pith certs`) default $PITH_TLS_DIR; without one, plaintext
//   to a loopback coordinator started with --insecure.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

int main(int argc, char** argv) {
  std::string address = "127.0.0.1:7000";
  if (const char* env = std::getenv("PITH_COORDINATOR"); env != nullptr && *env != '\0') {
    address = env;
  }
  if (argc > 1) address = argv[1];
  std::string tls_dir;
  if (const char* env = std::getenv("PITH_TLS_DIR"); env != nullptr) tls_dir = env;
  if (argc > 2) tls_dir = argv[2];
  absl::StatusOr<pith::security::TransportSecurity> security =
      tls_dir.empty() ? pith::security::TransportSecurity::Insecure()
                      : pith::security::TransportSecurity::Tls(tls_dir);
  if (!security.ok()) {
    std::fprintf(stderr, "sdk_example: %s\n", std::string(security.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<pith::Client>> client =
      pith::Client::Connect(address, *security, absl::Seconds(5));
  if (!client.ok()) {
    std::fprintf(stderr, "sdk_example: %s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<std::vector<pith::v1::Job>> jobs = (*client)->List();
  if (!jobs.ok()) {
    std::fprintf(stderr, "sdk_example: %s\n", std::string(jobs.status().message()).c_str());
    return 1;
  }
  std::printf("%zu jobs at %s\n", jobs->size(), address.c_str());
  for (const pith::v1::Job& job : *jobs) {
    std::printf("%-24s %-22s step %lld/%lld  loss %.4f\n", job.job_id().c_str(),
                pith::v1::JobState_Name(job.state()).c_str(),
                static_cast<long long>(job.committed_step()),
                static_cast<long long>(job.spec().train().steps()), job.last_loss());
  }
  return 0;
}
