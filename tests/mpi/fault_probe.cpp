// Simulates a rank that dies or hangs during a collective (run under mpirun by
// check_fault.sh). The surviving ranks must end the whole job with a clear error within the
// communicator timeout instead of waiting forever.
//   fault_probe die   rank 1 exits abruptly before the collective
//   fault_probe hang  rank 1 never enters the collective
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/communicator.h"

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "hang";
  auto comm = xctx::make_mpi_communicator(0);
  std::vector<float> buf(16, 1.0f);
  comm->all_reduce_sum(buf.data(), buf.size());  // everyone is alive here
  std::printf("rank %d: alive after the first collective\n", comm->rank());
  std::fflush(stdout);
  if (comm->rank() == 1) {
    if (std::strcmp(mode, "die") == 0) _exit(3);
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  std::vector<uint8_t> out(1024 * comm->size());
  comm->all_gather(out.data(), out.data(), 1024);
  std::printf("rank %d: all_gather returned although rank 1 is gone\n", comm->rank());
  return 0;
}
