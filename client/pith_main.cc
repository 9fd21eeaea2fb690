// pith: the Pith command line (DESIGN §1).
#include <grpc/support/log.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  // gRPC's own log lines (a failed TLS handshake prints one per attempt) would come before
  // the one line the CLI says: dropped in this process, unless the user asks for them
  // (GRPC_VERBOSITY). The environment is left alone: the processes `pith up` starts log
  // as they would.
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function([](gpr_log_func_args*) {});
  return pith::RunCli(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
