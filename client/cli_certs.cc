// `pith certs`: a cluster's CA and its processes' and people's certificates (mutual TLS,
// security/certs.h).
#include <filesystem>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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
  if (flags["--name"].empty() && !flags["--hosts"].empty()) {
    return UsageError("certs: --hosts names the hosts of --name's certificates (give --name)");
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
  if ((role == security::Role::kUser || role == security::Role::kAdmin) && !options.hosts.empty()) {
    return UsageError(absl::StrCat("certs: --hosts is for certificates that serve; ",
                                   role == security::Role::kAdmin ? "an admin" : "a user",
                                   "'s only dials"));
  }
  for (absl::string_view name : absl::StrSplit(flags["--name"], ',', absl::SkipEmpty())) {
    if (absl::Status valid = security::ValidateName(name); !valid.ok()) {
      return UsageError(absl::StrCat("certs --name: ", valid.message()));
    }
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

namespace {

// A token's lifetime: "90d", "12h", "30m" (days, or any absl duration), at least a minute.
absl::StatusOr<absl::Duration> ParseLifetime(const std::string& text) {
  absl::Duration d;
  int64_t days = 0;
  const bool parsed =
      (absl::EndsWith(text, "d") && absl::SimpleAtoi(text.substr(0, text.size() - 1), &days) &&
       days > 0 && days <= 36500 && (d = absl::Hours(24 * days), true)) ||
      absl::ParseDuration(text, &d);
  if (!parsed || d < absl::Minutes(1) || d > absl::Hours(24 * 36500)) {
    return UsageError(
        absl::StrCat("token --expires_in ", text,
                     ": want a lifetime such as 90d, 12h or 30m (a minute at least)"));
  }
  return d;
}

}  // namespace

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
  std::map<std::string, std::string> flags = {
      {"--file", ""}, {"--name", ""}, {"--role", "user"}, {"--expires_in", ""}};
  RETURN_IF_ERROR(ParseFlags("token", rest, flags));
  if (flags["--file"].empty() || flags["--name"].empty()) {
    return UsageError("token needs --file FILE and --name NAME");
  }
  if (absl::Status name = security::ValidateName(flags["--name"]); !name.ok()) {
    return UsageError(absl::StrCat("token --name: ", name.message()));
  }
  if (revoke && !flags["--expires_in"].empty()) {
    return UsageError("token --revoke takes no --expires_in");
  }
  if (revoke) {
    ASSIGN_OR_RETURN(const int revoked, security::RevokeTokens(flags["--file"], flags["--name"]));
    out << "revoked " << flags["--name"] << "'s token" << (revoked > 1 ? "s" : "")
        << " (the coordinator stops taking it within a second)\n";
    return absl::OkStatus();
  }
  absl::StatusOr<security::Role> role = security::ParseRole(flags["--role"]);
  if (!role.ok()) return UsageError(std::string(role.status().message()));
  absl::Time expires = absl::InfiniteFuture();
  if (!flags["--expires_in"].empty()) {
    ASSIGN_OR_RETURN(const absl::Duration d, ParseLifetime(flags["--expires_in"]));
    expires = absl::FromUnixSeconds(absl::ToUnixSeconds(absl::Now() + d));
  }
  int replaced = 0;
  ASSIGN_OR_RETURN(std::string token, security::AddToken(flags["--file"], {*role, flags["--name"]},
                                                         &replaced, expires));
  out << token << "\n";
  // Beside the token (stdout, for PITH_TOKEN=$(pith token ...)): what it replaced, and
  // when it ends.
  if (replaced > 0) {
    std::cerr << "pith: " << flags["--name"] << "'s earlier token no longer works\n";
  }
  if (expires != absl::InfiniteFuture()) {
    std::cerr << "pith: the token expires at "
              << absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", expires, absl::UTCTimeZone()) << "\n";
  }
  return absl::OkStatus();
}

}  // namespace pith::cli
