// Cache snapshots: every rank's shard of a prefilled sequence saved to a directory, so a long
// document is prefilled once and questioned many times (`xctx generate --save-cache DIR`, then
// `--load-cache DIR`). One file per rank plus a manifest rank 0 writes last:
//
//   DIR/manifest.json                 format, ranks, tokens, model: what a reader checks first
//   DIR/rank-R-of-P.xsnap             "XCTXSNAP" | u32 version | u32 0 | u64 header bytes |
//                                     header JSON | [rank 0: int32 token ids] | layer 0 snapshot |
//                                     u64 layer 0 checksum | ... | layer L-1 | its checksum |
//                                     u64 checksum (common/hash.h) of all before
//
// Every part starts 8-byte aligned (zero padding). The header carries what must match for the
// bytes to mean the same thing in the restoring run: the model's fingerprint, the cache format and
// the digest of its options (calibration tables and X factors included), the geometry, the rank
// count, and, for formats that store keys after RoPE (fp16/fp32), the RoPE frequencies. Layers are
// read one at a time (one layer's bytes of temporaries), each checked against its own checksum
// before the cache parses it, and the file's checksum is verified as they stream; any mismatch
// or damage throws xctx::Error naming the file and what differs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/cache.h"

namespace xctx {

struct model_weights;

// 2: nuq outlier entries hold δ (kvq_outlier_delta), not the element; a version-1 file of a -1%
// format would decode wrongly, so version 1 is refused like any other.
inline constexpr uint32_t kSnapshotVersion = 2;

// What the saving and the restoring run must agree on.
struct snapshot_identity {
  std::string model_name;
  uint64_t model_fingerprint = 0;  // model_fingerprint() of cache/calibration.h
  std::string format;              // cache format name
  uint64_t spec_digest = 0;        // cache_spec_digest
  int n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_embd = 0;
  bool post_rope_keys = false;     // fp16/fp32: keys stored rotated, so RoPE's frequencies must match
  int n_rot = 0;
  float freq_base = 0, rope_scaling_factor = 1;
  int rope_scaling = 0;            // rope_scaling as an integer
};
snapshot_identity make_snapshot_identity(const model_weights& w, const cache_spec& spec, const cache_geometry& g);
// A digest of what decides the bytes a cache of this spec stores: the format, its options, the
// nuq calibration's tables and the X factors' projections (not the ring mode: snapshots of
// xquant-cl hold the codes in either).
uint64_t cache_spec_digest(const cache_spec& spec);

// The sequence around one rank's shard.
struct snapshot_state {
  int rank = 0, n_rank = 1;
  int tail_rank = 0;                   // the rank that stores new tokens
  int64_t next_position = 0;           // tokens of the sequence so far
  std::vector<int64_t> held_per_rank;  // tokens each rank's cache holds (every layer alike)
  std::string prefill;                 // how the context was prefilled ("exact", "star")
  std::vector<int32_t> tokens;         // the sequence's token ids: rank 0's file only (else empty)
};

std::string snapshot_file(const std::string& dir, int rank, int n_rank);

// Writes this rank's file (through a temporary name, flushed and renamed into place).
// Throws naming the path when it cannot.
void write_cache_snapshot(const std::string& dir, const snapshot_identity& id, const snapshot_state& st,
                          const kv_cache& cache);
// Rank 0, once every rank's file is in place: the manifest.
void write_snapshot_manifest(const std::string& dir, const snapshot_identity& id, const snapshot_state& st,
                             double seconds, uint64_t bytes_all_ranks);

// What a directory's manifest says (rank 0 writes it once every rank's file is in place).
// Throws naming the directory when it has none or it is damaged.
struct snapshot_manifest {
  int ranks = 0;
  int64_t tokens = 0;
  std::string format, model;
};
snapshot_manifest read_snapshot_manifest(const std::string& dir);

// The state a rank's file records, its identity checked against `expect` and its rank count
// against n_rank (the manifest, when present, names the saved count in the error). Reads the
// header only.
snapshot_state read_snapshot_state(const std::string& dir, int rank, int n_rank, const snapshot_identity& expect);
// Restores every layer into `cache` (empty, with room for the file's tokens), verifying the
// checksums. On any error the cache is cleared and the error thrown. Returns the file's bytes.
uint64_t restore_cache_snapshot(const std::string& dir, int rank, int n_rank, kv_cache& cache);

}  // namespace xctx
