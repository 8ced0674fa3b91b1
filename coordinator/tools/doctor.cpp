// `xctx doctor`: what this build and this machine (or every rank of an mpirun job) offer: the
// backends compiled in, the CPU kernels chosen, BLAS, MPI and NCCL versions, the CUDA devices,
// and per rank its host, node-local rank, threads, memory share and the GPU it would bind to.
// Nothing here fails on a machine that lacks something; the report says what is missing.
#include <cblas.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/env_vars.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/jobs.h"
#include "kernels/device.h"
#include "kernels/host_cpu.h"
#include "kernels/ops.h"
#include "registry/registry.h"
#include "worker/memory_plan.h"

#ifndef XCTX_BUILD_TYPE
#define XCTX_BUILD_TYPE "unknown"
#endif

namespace xctx {
namespace {

using nlohmann::json;

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    return line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return "unknown CPU";
}

// CUDA's codes: 1000 * major + 10 * minor.
std::string cuda_version(int v) {
  if (v <= 0) return "unknown";
  return std::to_string(v / 1000) + "." + std::to_string(v / 10 % 100);
}
// NCCL's (from 2.9): 10000 * major + 100 * minor + patch.
std::string nccl_version_text(int v) {
  if (v <= 0) return "unknown";
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

json rank_report(const communicator& comm) {
  json r;
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  r["rank"] = comm.rank();
  r["host"] = host[0] ? host : "?";
  r["pid"] = (long long)getpid();
  std::string source;
  try {
    r["local_rank"] = node_local_rank(&source);
    r["local_rank_source"] = source;
  } catch (const Error& e) {
    r["local_rank"] = -1;
    r["local_rank_source"] = e.what();
  }
  r["local_ranks"] = node_local_ranks();
  cpu_set_t set;
  r["cpus_usable"] = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : -1;
  r["cpus_online"] = (long long)sysconf(_SC_NPROCESSORS_ONLN);
  r["threads"] = default_threads();
  r["threads_source"] = std::getenv("OMP_NUM_THREADS") ? "OMP_NUM_THREADS" : "node cores / node-local ranks";
  const size_t avail = available_memory_bytes();
  r["memory_available_bytes"] = avail;
  r["memory_share_bytes"] = avail / (size_t)std::max(1, node_local_ranks());

  const cuda_probe p = probe_cuda();
  json c;
  c["compiled"] = p.compiled;
  c["error"] = p.error;
  c["runtime"] = p.runtime_version;
  c["driver"] = p.driver_version;
  c["nccl"] = p.nccl_version;
  c["devices"] = json::array();
  for (const auto& d : p.devices)
    c["devices"].push_back({{"name", d.name}, {"sm", std::to_string(d.cc_major) + std::to_string(d.cc_minor)},
                            {"multiprocessors", d.sm_count}, {"total_bytes", d.total_bytes}});
  c["bound"] = p.bound;
  c["bound_why"] = p.bound_why;
  c["bound_free_bytes"] = p.bound_free_bytes;
  r["cuda"] = c;
  return r;
}

// Rank 0 receives every rank's report (the others return an empty array).
json gather_reports(communicator& comm, const json& mine) {
  const std::string text = mine.dump();
  const uint64_t len = text.size();
  std::vector<uint64_t> lens((size_t)comm.size());
  comm.all_gather(&len, lens.data(), sizeof len);
  json all = json::array();
  if (comm.rank() != 0) {
    comm.send(text.data(), text.size(), 0, /*tag=*/71);
    return all;
  }
  all.push_back(mine);
  for (int r = 1; r < comm.size(); ++r) {
    std::string buf(lens[(size_t)r], '\0');
    comm.recv(buf.data(), buf.size(), r, /*tag=*/71);
    all.push_back(json::parse(buf));
  }
  return all;
}

std::string device_column(const json& c) {
  if (!c["compiled"].get<bool>()) return "-";
  const int bound = c["bound"].get<int>();
  if (bound < 0) return "none: " + c["bound_why"].get<std::string>() + c["error"].get<std::string>();
  std::string s = std::to_string(bound) + " (" + c["bound_why"].get<std::string>() + ")";
  if (!c["error"].get<std::string>().empty()) s += ", unusable: " + c["error"].get<std::string>();
  return s;
}

void print_report(const json& rep) {
  const json& b = rep["build"];
  std::printf("xctx doctor: %d rank(s) over communicator %s\n", rep["ranks"].get<int>(),
              rep["communicator"].get<std::string>().c_str());
  std::printf("build         %s, %s; backends: ref, cpu%s\n", b["type"].get<std::string>().c_str(),
              b["compiler"].get<std::string>().c_str(), b["cuda"].get<bool>() ? ", cuda" : " (CUDA not compiled in)");
  const char* env_backend = std::getenv("XCTX_BACKEND");
  std::printf("jobs run on   --backend cpu or cuda (every cache format on both; cuda never run on a GPU so far: "
              "README); default %s\n",
              env_backend != nullptr && *env_backend != '\0' ? (std::string("XCTX_BACKEND=") + env_backend).c_str() : "cpu");
  std::printf("cpu           %s; kernels: %s\n", rep["cpu"]["model"].get<std::string>().c_str(),
              rep["cpu"]["kernels"].get<std::string>().c_str());
  std::printf("blas          %s\n", rep["blas"].get<std::string>().c_str());
  std::printf("mpi           %s\n", rep["mpi"].get<std::string>().c_str());
  const json& c0 = rep["per_rank"][0]["cuda"];
  if (!c0["compiled"].get<bool>()) {
    std::printf("cuda          not compiled in (configure with -DXCTX_CUDA=ON)\n");
    std::printf("nccl          not compiled in\n");
  } else {
    std::printf("cuda          runtime %s, driver supports %s%s%s\n", cuda_version(c0["runtime"].get<int>()).c_str(),
                c0["driver"].get<int>() > 0 ? cuda_version(c0["driver"].get<int>()).c_str() : "(no driver)",
                c0["error"].get<std::string>().empty() ? "" : "; ", c0["error"].get<std::string>().c_str());
    std::printf("nccl          %s\n", nccl_version_text(c0["nccl"].get<int>()).c_str());
  }
  // Devices once per host: ranks on one node see the same ones.
  std::vector<std::string> hosts_done;
  for (const json& r : rep["per_rank"]) {
    const std::string host = r["host"].get<std::string>();
    if (std::find(hosts_done.begin(), hosts_done.end(), host) != hosts_done.end()) continue;
    hosts_done.push_back(host);
    int d = 0;
    for (const json& dev : r["cuda"]["devices"])
      std::printf("gpu           %s #%d: %s, sm_%s, %d SMs, %s\n", host.c_str(), d++,
                  dev["name"].get<std::string>().c_str(), dev["sm"].get<std::string>().c_str(),
                  dev["multiprocessors"].get<int>(), format_bytes((double)dev["total_bytes"].get<size_t>()).c_str());
  }
  std::printf("%-5s %-16s %-36s %-8s %-22s %s\n", "rank", "host", "node-local rank", "threads", "memory share",
              "cuda device it would bind");
  for (const json& r : rep["per_rank"]) {
    const int local = r["local_rank"].get<int>();
    const std::string local_text =
        local < 0 ? (r["local_rank_source"].get<std::string>().empty() ? "- (no launcher)" : r["local_rank_source"].get<std::string>())
                  : std::to_string(local) + " of " + std::to_string(r["local_ranks"].get<int>()) + " (" +
                        r["local_rank_source"].get<std::string>() + ")";
    const std::string mem = format_bytes((double)r["memory_share_bytes"].get<size_t>()) + " of " +
                            format_bytes((double)r["memory_available_bytes"].get<size_t>());
    std::printf("%-5d %-16s %-36s %-8d %-22s %s\n", r["rank"].get<int>(), r["host"].get<std::string>().c_str(),
                local_text.c_str(), r["threads"].get<int>(), mem.c_str(), device_column(r["cuda"]).c_str());
  }
  const json& r0 = rep["per_rank"][0];
  if (r0["threads"].get<int>() * r0["local_ranks"].get<int>() > r0["cpus_online"].get<int>())
    std::printf("warning: %d rank(s) x %d thread(s) on host %s exceed its %d online cores\n",
                r0["local_ranks"].get<int>(), r0["threads"].get<int>(), r0["host"].get<std::string>().c_str(),
                r0["cpus_online"].get<int>());
}

// Rank 0's environment against the table of every variable xctx reads (common/env_vars.h).
json environment_report() {
  json out = json::array();
  size_t n = 0;
  const env_var* vars = env_vars(&n);
  for (size_t i = 0; i < n; ++i) {
    const char* v = std::getenv(vars[i].name);
    out.push_back({{"name", vars[i].name},
                   {"value", v != nullptr ? json(v) : json(nullptr)},
                   {"default", vars[i].default_value},
                   {"meaning", vars[i].meaning}});
  }
  return out;
}

void print_environment(const json& env) {
  std::printf("environment   (every variable xctx reads; rank 0's values, docs/env_vars.md)\n");
  for (const json& e : env) {
    const std::string value =
        e["value"].is_null() ? "unset: " + e["default"].get<std::string>() : "= " + e["value"].get<std::string>();
    std::printf("  %-20s %s -- %s\n", e["name"].get<std::string>().c_str(), value.c_str(),
                e["meaning"].get<std::string>().c_str());
  }
}

}  // namespace

int run_doctor(const doctor_options& opt, communicator& comm) {
  const json all = gather_reports(comm, rank_report(comm));
  if (comm.rank() != 0) return 0;
  json rep;
  rep["ranks"] = comm.size();
  rep["communicator"] = comm.name();
#if defined(__clang__)
  const std::string compiler = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  const std::string compiler = std::string("gcc ") + __VERSION__;
#else
  const std::string compiler = "unknown compiler";
#endif
  rep["build"] = {{"type", XCTX_BUILD_TYPE}, {"compiler", compiler}, {"cuda", XCTX_USE_CUDA != 0}};
  rep["cpu"] = {{"model", cpu_model_name()}, {"kernels", host_cpu_kernels()}};
  rep["blas"] = std::string(openblas_get_config()) + ", " + std::to_string(openblas_get_num_threads()) + " thread(s)";
  const std::string mpi = mpi_library_version();
  rep["mpi"] = mpi.empty() ? std::string("unknown") : mpi;
  rep["per_rank"] = all;
  rep["environment"] = environment_report();
  print_report(rep);
  print_environment(rep["environment"]);
  if (opt.probe) {
    // Rank 0 alone, on its threads (the other ranks have returned).
    const host_roofline r = measure_host_roofline();
    rep["roofline"] = {{"threads", r.threads},          {"read_bytes", r.read_bytes},
                       {"read_gbs_1", r.read_gbs_1},     {"read_gbs_all", r.read_gbs_all},
                       {"fma_gflops_1", r.fma_gflops_1}, {"fma_gflops_all", r.fma_gflops_all},
                       {"int8_gops_1", r.int8_gops_1},   {"int8_gops_all", r.int8_gops_all},
                       {"read_isa", r.read_isa},         {"fma_isa", r.fma_isa},
                       {"int8_isa", r.int8_isa}};
    std::printf("roofline    read %.1f GB/s on 1 thread, %.1f on %d (%s loads, %zu MiB)\n"
                "            fp32 FMA %.1f GFLOP/s on 1 thread, %.1f on %d (%s)\n"
                "            int8 dot %.1f GOP/s on 1 thread, %.1f on %d (%s)\n",
                r.read_gbs_1, r.read_gbs_all, r.threads, r.read_isa.c_str(), r.read_bytes >> 20, r.fma_gflops_1,
                r.fma_gflops_all, r.threads, r.fma_isa.c_str(), r.int8_gops_1, r.int8_gops_all, r.threads,
                r.int8_isa.c_str());
  }
  if (!opt.json_path.empty()) {
    std::ofstream out(opt.json_path);
    XCTX_CHECK(out.good(), "cannot write ", opt.json_path);
    out << rep.dump(2) << "\n";
    XCTX_CHECK(out.good(), "write error on ", opt.json_path);
  }
  return 0;
}

}  // namespace xctx
