// pith: the Pith command line (DESIGN §1).
#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  return pith::RunCli(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
