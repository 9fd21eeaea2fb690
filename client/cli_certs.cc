// `pith certs`: a cluster's CA and its processes' and people's certificates (mutual TLS,
// security/certs.h).
#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli_commands.h"
#include "common/status.h"
#include "security/certs.h"
#include "security/tokens.h"

namespace pith::cli {

absl::Status Certs(const CliContext& ctx, const Args& args, std::ostream& out) {
  std::map<std::string, std::string> flags = {
      {"--dir", ""}, {"--name", ""}, {"--role", ""}, {"--hosts", ""}};
  RETURN_IF_ERROR(ParseFlags("certs", args, flags));
  const std::string dir = flags["--dir"];
  if (dir.empty()) return UsageError("certs needs --dir DIR");
  if (flags["--name"].empty() != flags["--role"].empty()) {
    return UsageError("certs: --name and --role go together");
  }
  security::CertOptions options;
  for (absl::string_view host : absl::StrSplit(flags["--hosts"], ',', absl::SkipEmpty())) {
    options.hosts.emplace_back(host);
  }
  security::Role role = security::Role::kUser;
  if (!flags["--role"].empty()) {
    absl::StatusOr<security::Role> parsed = security::ParseRole(flags["--role"]);
    if (!parsed.ok()) return UsageError(std::string(parsed.status().message()));
    role = *parsed;
  }
  ASSIGN_OR_RETURN(bool made, security::EnsureCa(dir));
  out << (made ? "made the cluster CA " : "using the cluster CA ") << dir << "/"
      << security::kCaCertFile
      << (made ? " (its key, ca.key, signs every certificate: keep it safe)" : "") << "\n";
  for (absl::string_view name : absl::StrSplit(flags["--name"], ',', absl::SkipEmpty())) {
    const security::Identity identity{role, std::string(name)};
    RETURN_IF_ERROR(security::Issue(dir, identity, options));
    out << "issued " << security::DebugString(identity) << " in " << dir << "/" << name
        << " (give the process --tls_dir=" << dir << "/" << name << ")\n";
  }
  return absl::OkStatus();
}

absl::Status Token(const CliContext& ctx, const Args& args, std::ostream& out) {
  Args rest;
  bool revoke = false;
  for (const std::string& a : args) {
    if (a == "--revoke") {
      revoke = true;
    } else {
      rest.push_back(a);
    }
  }
  std::map<std::string, std::string> flags = {{"--file", ""}, {"--name", ""}, {"--role", "user"}};
  RETURN_IF_ERROR(ParseFlags("token", rest, flags));
  if (flags["--file"].empty() || flags["--name"].empty()) {
    return UsageError("token needs --file FILE and --name NAME");
  }
  if (revoke) {
    ASSIGN_OR_RETURN(const int revoked, security::RevokeTokens(flags["--file"], flags["--name"]));
    out << "revoked " << flags["--name"] << "'s token" << (revoked > 1 ? "s" : "")
        << " (the coordinator stops taking it within a second)\n";
    return absl::OkStatus();
  }
  absl::StatusOr<security::Role> role = security::ParseRole(flags["--role"]);
  if (!role.ok()) return UsageError(std::string(role.status().message()));
  int replaced = 0;
  ASSIGN_OR_RETURN(std::string token,
                   security::AddToken(flags["--file"], {*role, flags["--name"]}, &replaced));
  out << token << "\n";
  // Beside the token (stdout, for PITH_TOKEN=$(pith token ...)): what it replaced.
  if (replaced > 0) {
    std::cerr << "pith: " << flags["--name"] << "'s earlier token no longer works\n";
  }
  return absl::OkStatus();
}

}  // namespace pith::cli
