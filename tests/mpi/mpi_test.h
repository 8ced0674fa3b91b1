#pragma once

#include "comm/communicator.h"

namespace xctx::mpi_test {
communicator& world();  // MPI_COMM_WORLD for the running test process
}
