// Options of the memtier engine (the tiered memory manager and the ZeRO-3
// style fetch/release engine): where each role rests, budgets, staging
// buffers, prefetch, and the NVMe tier's I/O settings. Filled in C++, or from
// a JSON config (ParseEngineConfig, strata/engine_config.h) that also accepts
// a DeepSpeed config's `zero_optimization` and `aio` sections.
#ifndef STRATA_ENGINE_OPTIONS_H_
#define STRATA_ENGINE_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "strata/cpu_adam.h"
#include "strata/io_engine.h"

namespace strata {

// A tier where a role's data rests between uses.
enum class Residence : uint8_t { kDevice, kHost, kNvme };

struct EngineOptions {
  // ---- Ranks (one today; the layout carries them from the start) ----
  int rank = 0;
  int world_size = 1;

  // ---- Where each role rests ----
  Residence params = Residence::kDevice;          // working-precision copy
  Residence optimizer_states = Residence::kHost;  // fp32 master + moments
  Residence grads = Residence::kHost;             // fp32 accumulated grads
  // Directories for the NVMe tier (striped); required when any role rests on
  // NVMe.
  std::vector<std::string> nvme_paths;

  // ---- Budgets (bytes; 0 = automatic) ----
  uint64_t device_budget_bytes = 0;  // the device arena
  uint64_t host_budget_bytes = 0;    // pinned host memory for resident data
  bool pin_memory = true;            // page-lock host memory

  // ---- Partitions and staging buffers ----
  // Large tensors are split into partitions of at most this many bytes; small
  // ones are packed into partitions of this size.
  uint64_t partition_bytes = 64ull << 20;
  // Pinned staging buffers carrying all traffic between tiers: count x bytes.
  // 0 = sized from partition_bytes.
  uint32_t staging_buffer_count = 0;
  uint64_t staging_buffer_bytes = 0;

  // ---- Prefetch and caching (DeepSpeed's stage3_* knobs, in bytes) ----
  uint64_t prefetch_bytes = 0;  // in flight ahead of compute
  uint64_t max_live_bytes = 0;  // fetched and not released, at most
  uint64_t persistence_threshold_bytes = 0;  // smaller tensors stay on device
  uint64_t sub_group_bytes = 0;  // optimizer step pipeline granularity

  // ---- Optimizer ----
  // Algorithm and hyper-parameters of the CPU optimizer (threads: 0 = all
  // cores but the engine's own threads).
  CpuOptimizerOptions optimizer;

  // ---- NVMe I/O ----
  IoEngineOptions io;  // backend, queue depth, O_DIRECT
  uint32_t io_block_bytes = 1u << 20;
};

}  // namespace strata

#endif  // STRATA_ENGINE_OPTIONS_H_
