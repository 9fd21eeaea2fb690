// TestTls: the certificates of an e2e test's cluster, made in its own folder the way
// `pith certs` makes them, so every test process runs mutual TLS as users run Pith. The
// test's own calls use an admin's (or the coordinator's, for store control) certificate.
#ifndef PITH_TESTS_E2E_TEST_TLS_H_
#define PITH_TESTS_E2E_TEST_TLS_H_

#include <memory>
#include <string>
#include <vector>

#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "security/certs.h"
#include "security/tls.h"

namespace pith::testing {

class TestTls {
 public:
  // Makes the CA in `dir` (once). Servers' certificates name this machine and `extra_hosts`.
  explicit TestTls(std::string dir, const std::vector<std::string>& extra_hosts = {})
      : dir_(std::move(dir)) {
    options_.hosts = extra_hosts;
    auto made = security::EnsureCa(dir_);
    if (!made.ok()) ok_ = false;
  }
  bool ok() const { return ok_; }

  // The directory of `name`'s certificate (issued on first use).
  std::string Dir(security::Role role, const std::string& name) {
    // People's certificates name no hosts (they serve nothing).
    const bool person = role == security::Role::kUser || role == security::Role::kAdmin;
    absl::Status s =
        security::Issue(dir_, {role, name}, person ? security::CertOptions{} : options_);
    if (!s.ok() && !absl::IsAlreadyExists(s)) ok_ = false;
    return dir_ + "/" + name;
  }
  std::string Flag(security::Role role, const std::string& name) {
    return "--tls_dir=" + Dir(role, name);
  }
  // The flags of a member process (store or worker) and of the coordinator.
  std::string MemberFlag(const std::string& name) { return Flag(security::Role::kMember, name); }
  std::string CoordinatorFlag() { return Flag(security::Role::kCoordinator, "coordinator"); }

  // Credentials of `name` for a test's own channels.
  // (`server`: the role the server's certificate must name, TransportSecurity.)
  std::shared_ptr<grpc::ChannelCredentials> Credentials(
      security::Role role, const std::string& name,
      security::Role server = security::Role::kCoordinator) {
    auto security = security::TransportSecurity::Tls(Dir(role, name));
    if (!security.ok()) {
      ok_ = false;
      return grpc::InsecureChannelCredentials();
    }
    return security->ChannelCredentials(server);
  }
  // A channel to `address` as an admin (job API, drains, store reads) or as the
  // coordinator (store control).
  std::shared_ptr<grpc::Channel> AdminChannel(
      const std::string& address, security::Role server = security::Role::kCoordinator) {
    return NewChannel(address, Credentials(security::Role::kAdmin, "admin", server));
  }
  std::shared_ptr<grpc::Channel> CoordinatorChannel(const std::string& address) {  // to a store
    return NewChannel(
        address, Credentials(security::Role::kCoordinator, "coordinator", security::Role::kMember));
  }

 private:
  std::string dir_;
  security::CertOptions options_;
  bool ok_ = true;
};

}  // namespace pith::testing

#endif  // PITH_TESTS_E2E_TEST_TLS_H_
