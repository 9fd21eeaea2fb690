// The `pith` command line: parsing of subcommands and their dispatch. main() only hands
// over argv, so tests run the CLI in-process.
//
// Thread safety: RunCli may run concurrently with other calls; it shares no state.
#ifndef PITH_CLIENT_CLI_H_
#define PITH_CLIENT_CLI_H_

#include <ostream>
#include <string>
#include <vector>

namespace pith {

// Runs `pith <args...>` (args excludes the program name). Normal output goes to `out`;
// an error is one line "pith: <what went wrong>" on `err`. Returns the exit status:
// 0 on success, 1 on an error, 2 on a usage error.
int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace pith

#endif  // PITH_CLIENT_CLI_H_
