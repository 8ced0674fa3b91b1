#pragma once
// One-process references of the MPI suites, computed once per build and test run.
//
// Every sequence-parallel case compares its ranks against one process running the same case; a
// CTest run checks the same cases on up to five rank counts, and rank 0 computing the reference
// in every mpirun (while the other ranks wait) was about half of the MPI suites' time. CTest's
// `mpi_references` entry runs the suites on one rank with XCTX_MPI_REFERENCES_ONLY=1 beside the
// unit tests: each case computes its reference, stores it and returns. The suites that follow
// find the stored file and compare against it (tests/CMakeLists.txt).
//
// Where: XCTX_MPI_REFERENCE_DIR (CTest sets the build's tests/mpi-references). Unset: every
// reference is computed where it is needed, as before. A file is named by the key and by a stamp
// of the test binary (its size and modification time), so a rebuild never reads a reference an
// older build wrote; the key is stored in the file and compared, so a hash collision recomputes.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace xctx::mpi_test {

struct reference_run {
  std::vector<float> logits;   // every step's logits, one after another
  std::vector<int32_t> tokens;  // the greedy tokens, where the case has them
};

// True under XCTX_MPI_REFERENCES_ONLY=1: cases store their references and return.
bool references_only();

// The reference for `key` on every rank of the world: rank 0 reads it from the store or runs
// `make` (on rank 0 only) and stores it; then every rank receives it. Collective.
reference_run stored_reference(const std::string& key, const std::function<reference_run()>& make);

// A file made once per store and key by rank 0's `make(path)` (written to a temporary name and
// renamed into place), for every rank to read: the path, valid once this returns. Without a
// store: a fresh temporary path, made anew by each call. Collective.
std::string stored_file(const std::string& key, const std::function<void(const std::string& path)>& make);

bool has_store();

std::string fingerprint(const std::vector<int32_t>& ids);  // of a prompt, for keys (length and hash)  // XCTX_MPI_REFERENCE_DIR is set: stored files stay for the next mpirun

}  // namespace xctx::mpi_test
