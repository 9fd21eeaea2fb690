// pith: the Pith command line (DESIGN §1).
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  // gRPC's own log lines (a failed TLS handshake prints one per attempt) would come before
  // the one line the CLI says: off, unless the user asks for them (GRPC_VERBOSITY=ERROR).
  // Read once, when gRPC starts, which is after this.
  ::setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);
  return pith::RunCli(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
