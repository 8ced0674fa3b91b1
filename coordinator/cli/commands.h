// The xctx subcommands: each declares its options (the shared bundles from cli/options.h once,
// its own beside them) and how it runs once parsed. main() only parses and dispatches.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <vector>

#include "comm/communicator.h"

namespace xctx::cli {

struct command {
  CLI::App* app = nullptr;  // the subcommand, owned by the parent app
  // Runs under mpirun: gets the world communicator (local without mpirun) and every rank runs it.
  bool collective = false;
  std::function<int(communicator* comm)> run;  // comm: null unless collective
};

// Adds every subcommand to `app`; the options' storage lives in the returned commands.
std::vector<command> add_commands(CLI::App& app);

}  // namespace xctx::cli
