// The xctx binary: parses the command line (coordinator/cli/commands.h declares every
// subcommand and its options) and runs the chosen job, turning errors into a message and an
// exit code on every rank.
#include <CLI/CLI.hpp>

#include <omp.h>

#include <cstdio>
#include <memory>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/cli/commands.h"

int main(int argc, char** argv) {
  xctx::init_logging(argv[0]);
  // Loading and every job's threads: the node's cores shared among its ranks (common/sys.h), so a
  // plain `mpirun -np 4` on 4 cores runs 4 x 1 threads, not 4 x 4.
  omp_set_num_threads(xctx::default_threads());
  CLI::App app{"xctx: long-context LLM inference over compressed, sequence-parallel caches"};
  app.require_subcommand(1);
  const std::vector<xctx::cli::command> commands = xctx::cli::add_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Jobs that may run under mpirun get the world communicator (local without mpirun). A bad
  // input on any rank ends every rank at once instead of leaving the others in a collective.
  std::unique_ptr<xctx::communicator> comm;
  try {
    for (const xctx::cli::command& c : commands) {
      if (!*c.app) continue;
      if (c.collective) comm = xctx::make_default_communicator();
      return c.run(comm.get());
    }
  } catch (const xctx::Error& e) {
    if (comm && comm->size() > 1) comm->abort(std::string("error: ") + e.what());
    std::fprintf(stderr, "xctx: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    if (comm && comm->size() > 1) comm->abort(std::string("unexpected error: ") + e.what());
    std::fprintf(stderr, "xctx: unexpected error: %s\n", e.what());
    return 2;
  }
  return 0;
}
