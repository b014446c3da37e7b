// Options of the memtier engine (the tiered memory manager and the ZeRO-3
// style fetch/release engine): where each role rests, budgets, staging
// buffers, prefetch, the NVMe tier's I/O settings, mixed precision and the
// offloaded optimizer. Filled in C++, or from a JSON config
// (ParseEngineConfig, strata/engine_config.h) that also accepts a DeepSpeed
// config; docs/config.md maps every JSON key to a field here.
//
// Sizes are bytes. Where DeepSpeed counts elements, the JSON reader converts
// with the working dtype's size; the defaults below are DeepSpeed's defaults
// converted at 2 bytes per element (bf16, the default working dtype).
//
// An EngineOptions is a plain value (thread-compatible).
#ifndef STRATA_ENGINE_OPTIONS_H_
#define STRATA_ENGINE_OPTIONS_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/async_io.h"
#include "strata/comm.h"
#include "strata/cpu_adam.h"
#include "strata/export.h"
#include "strata/io_engine.h"
#include "strata/status.h"

namespace strata {

// A tier where a role's data rests between uses.
enum class Residence : uint8_t { kDevice, kHost, kNvme };

// "device", "host", "nvme".
STRATA_EXPORT std::string_view ResidenceName(Residence residence);

// Where the engine's collectives over ranks run (EngineOptions::comm_memory).
enum class CommMemory : uint8_t {
  kAuto,    // device memory for NCCL, host memory otherwise
  kHost,    // host memory: the single-rank or MPI backend
  kDevice,  // device memory, stream-ordered on the engine's device
};

// "auto", "host", "device".
STRATA_EXPORT std::string_view CommMemoryName(CommMemory memory);

// How fp16 gradients are scaled against underflow.
enum class LossScaleMode : uint8_t {
  kNone,     // scale 1 (bf16, fp32)
  kStatic,   // initial_scale throughout
  kDynamic,  // halved on overflow (after hysteresis), doubled after window
};

// "none", "static", "dynamic".
STRATA_EXPORT std::string_view LossScaleModeName(LossScaleMode mode);

struct LossScaleOptions {
  // Default kNone because the default working dtype is bf16; a JSON config
  // with fp16 enabled selects kDynamic unless it gives a static scale.
  LossScaleMode mode = LossScaleMode::kNone;
  // kStatic: the scale. kDynamic: the first scale. Finite, > 0.
  // Default 65536 (2^16, DeepSpeed's initial_scale_power 16).
  double initial_scale = 65536.0;
  // kDynamic: steps without overflow after which the scale doubles. >= 1.
  uint32_t window = 1000;
  // kDynamic: overflows absorbed before the scale halves. >= 1.
  uint32_t hysteresis = 2;
  // kDynamic: restore the hysteresis after each step without overflow
  // (DeepSpeed's consecutive_hysteresis). Default off.
  bool consecutive_hysteresis = false;
  // kDynamic: the scale never goes below this. Finite, > 0, and at most
  // initial_scale. Default 1.
  double min_scale = 1.0;
};

struct OptimizerOptions {
  // Algorithm and hyper-parameters, handed as they are to NewCpuOptimizer.
  // Default AdamW with betas (0.9, 0.999), eps 1e-8, weight decay 0, bias
  // correction on: a DeepSpeed optimizer of type "Adam" is AdamW unless
  // adam_w_mode is false.
  CpuOptimizerOptions cpu;
  // The learning rate of the first step; a schedule is the caller's (it
  // passes the rate of each step). Finite, >= 0. Default 1e-3.
  double lr = 1e-3;
  // The format the two moments rest in (host, NVMe, checkpoints): kFloat32
  // (4 bytes per element each), kBFloat16 (2) or kBlock8 (8-bit
  // block-quantized, CpuStateBytes(kBlock8, n): about 1 byte per element
  // plus a fp32 scale per kCpuBlock8Elems). kBFloat16 and kBlock8 only with
  // Adam, AdamW and Lion. The master weights stay fp32. Default kFloat32.
  CpuDType moment_dtype = CpuDType::kFloat32;
};

// "fp32", "bf16", "int8" (kBlock8): the names of the moment formats.
STRATA_EXPORT std::string_view MomentDTypeName(CpuDType dtype);
// The inverse of MomentDTypeName (case-insensitive); kInvalidArgument naming
// the accepted names otherwise.
STRATA_EXPORT StatusOr<CpuDType> ParseMomentDType(std::string_view name);

struct EngineOptions {
  // Marks a size without a limit (max_persistent_bytes).
  static constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

  // ---- Ranks (data parallelism; docs/memtier.md, "Data-parallel ranks") ----
  int rank = 0;        // 0 <= rank < world_size
  int world_size = 1;  // 1 .. 65536
  // What is partitioned across ranks (ZeRO stage): 0 nothing, 1 optimizer
  // states, 2 also gradients, 3 also parameters. With world_size 1 every
  // stage keeps the same data on the one rank; only stage 3 lets parameters
  // rest off the device (as in DeepSpeed). 0 .. 3, default 3. With
  // world_size above 1 the engine runs stages 1, 2 and 3 (0 is refused,
  // kNotSupported); stage 3 then keeps each rank's shard of the parameters
  // on host or nvme (params), and Fetch gathers the shards.
  int zero_stage = 3;
  // The data-parallel group the engine reduces gradients and gathers
  // parameters over, made by the trainer (a Communicator over its own
  // MPI_Comm composes with the groups it runs elsewhere; the engine never
  // creates one). Required when world_size is above 1; its size and rank
  // must equal world_size and rank. The single-rank, MPI or NCCL backend
  // (NCCL on a CUDA device; see comm_memory). Every rank must make the engine
  // calls
  // that issue collectives (AddGrad with zero_stage 2 and 3, Step,
  // ReadMaster, and with zero_stage 3 Start and Fetch) in the same order,
  // and nothing else may use this communicator meanwhile: give the engine
  // one of its own. Kept alive by the engine; not part of a
  // JSON config. Null (the default): one rank, no collectives.
  std::shared_ptr<Communicator> comm;
  // Where the collectives over comm run. kHost: on host memory, where the
  // gradient shards and the optimizer's data are (MPI, single rank). kDevice:
  // stream-ordered on the device, as NCCL needs: stage 3's fetches and
  // stages 1 and 2's gather after the step gather in place in the unit's
  // device block; gradients, agreements and checkpoint pieces go through a
  // device buffer of the engine's (staging_buffer_bytes, taken from the
  // device budget; stage 3 adds 64 KiB for its gathers' own communicator).
  // On the host-emulated device kDevice runs the NCCL path's logic over MPI
  // on CPU ranks. kAuto (the default): kDevice for an NCCL communicator,
  // else kHost. MPI takes no CUDA stream: kDevice with MPI on a GPU is
  // kNotSupported, as is kHost with NCCL.
  CommMemory comm_memory = CommMemory::kAuto;
  // Bytes of working-precision gradient per reduction bucket with
  // zero_stage 2 and 3 (DeepSpeed's reduce_bucket_size, which counts
  // elements): a bucket is reduce-scattered once the tensors it covers are
  // in. The engine keeps two, in fp32 (twice this with a 2-byte working
  // dtype), rounded up to whole shard blocks and at most a unit. 0 (the
  // default): a packed unit (partition_bytes of fp32). At most 1 PiB.
  uint64_t reduce_bucket_bytes = 0;
  // Bytes of working-precision parameters one all-gather moves at most
  // (DeepSpeed's allgather_bucket_size, in elements): zero_stage 3's
  // fetches and stages 1 and 2's steps gather in rounds of at most this
  // (and of a staging buffer), at least one element per rank. 0 (the
  // default): a staging buffer. At most 1 PiB.
  uint64_t allgather_bucket_bytes = 0;

  // ---- Where each role rests ----
  Residence params = Residence::kDevice;  // working-precision copy; any tier
  // fp32 master weights and the moments (optimizer.moment_dtype): kHost or
  // kNvme (the optimizer runs on the CPU). Default kHost.
  Residence optimizer_states = Residence::kHost;
  // fp32 gradients accumulated across micro-batches: kHost or kNvme.
  // Default kHost.
  Residence grads = Residence::kHost;
  // Directories of the NVMe tier, striped in this order; required (and each
  // non-empty, no duplicates) when any role rests on NVMe. Default none.
  std::vector<std::string> nvme_paths;

  // ---- Budgets (bytes; 0 = automatic, at most 1 PiB) ----
  // The device arena, one allocation at start; >= partition_bytes.
  // Automatic: half of the device memory free at start.
  uint64_t device_budget_bytes = 0;
  uint64_t host_budget_bytes = 0;  // pinned host memory for resident data
  // Page-lock host memory (continues unpinned, with one warning, where the
  // OS refuses). Default on.
  bool pin_memory = true;

  // ---- Partitions and staging buffers ----
  // Large tensors are split into partitions of at most this many bytes; small
  // ones are packed into partitions of this size. A multiple of 4096,
  // 4 KiB .. 1 TiB. Default 64 MiB.
  uint64_t partition_bytes = uint64_t{64} << 20;
  // Pinned staging buffers carrying all traffic between tiers: count x bytes.
  // 0 = sized from partition_bytes. Count 0 or 1 .. 4096; bytes 0 or a
  // multiple of 4096, 4 KiB .. 1 TiB.
  uint32_t staging_buffer_count = 0;
  uint64_t staging_buffer_bytes = 0;

  // ---- Prefetch, caching and persistence (DeepSpeed's stage3_* knobs) ----
  // Bytes of parameters fetched ahead of compute, at most; 0 = no prefetch.
  // Default 100,000,000 (5e7 elements). At most 1 PiB.
  uint64_t prefetch_bytes = 100'000'000;
  // Bytes of parameters fetched and not yet released, at most. 1 .. 1 PiB.
  // Default 2,000,000,000 (1e9 elements).
  uint64_t max_live_bytes = 2'000'000'000;
  // Tensors of at most this many bytes stay on the device (0 = none).
  // Default 200,000 (1e5 elements). At most 1 PiB.
  uint64_t persistence_threshold_bytes = 200'000;
  // Total bytes of such persistent tensors, at most. Default kUnlimited.
  uint64_t max_persistent_bytes = kUnlimited;
  // A released partition whose next use comes within this many bytes of
  // fetches stays on the device. Default 2,000,000,000 (1e9 elements).
  // At most 1 PiB.
  uint64_t max_reuse_distance_bytes = 2'000'000'000;
  // Optimizer step pipeline granularity, in bytes of working-precision
  // parameters per sub-group. 1 .. 1 PiB. Default 2,000,000,000 (1e9
  // elements).
  uint64_t sub_group_bytes = 2'000'000'000;
  // Bytes of optimizer state (the fp32 master and the two moments: 12 per
  // element with fp32 moments, 8 with bf16, about 6 with int8) that may be
  // updated while backward still runs, after Engine::BeginStep.
  // Their values before the update are kept in a host buffer of this size,
  // allocated at start, so that a non-finite gradient found later can undo
  // them. 0 = off: no unit is updated early (BeginStep still has each
  // unit's gradient statistics taken during backward). At most 1 PiB.
  // Default 0.
  uint64_t step_overlap_bytes = 0;

  // ---- NVMe I/O ----
  IoEngineOptions io;  // backend, queue depth (1 .. 32768), O_DIRECT
  // Largest single I/O request. A multiple of 4096, 4 KiB .. 1 GiB.
  // Default 1 MiB.
  uint64_t io_block_bytes = uint64_t{1} << 20;
  // The AsyncIo (one ring and its completion thread) the NVMe tier submits
  // to, shared with other users of the same drives (a checkpoint writer, a
  // data loader, or an AsyncIo over an IoEngine of the caller's own) so
  // that one ring carries all their I/O. Null (the default): the engine
  // opens its own from `io`, which is ignored when this is set. Kept alive
  // by the engine until it is destroyed; not part of a JSON config.
  std::shared_ptr<AsyncIo> shared_io;

  // ---- Training ----
  // Element type of parameters on the device and of the gradients the
  // trainer hands over: kFloat16, kBFloat16 or kFloat32. Default kBFloat16.
  CpuDType working_dtype = CpuDType::kBFloat16;
  LossScaleOptions loss_scale;
  // Global-norm gradient clipping: the largest norm; 0 = off. Finite, >= 0.
  double gradient_clipping = 0.0;
  // Micro-batches accumulated per optimizer step. 1 .. 1048576. Default 1.
  uint32_t gradient_accumulation_steps = 1;
  OptimizerOptions optimizer;
};

// OK, or kInvalidArgument naming every field out of its accepted range (and
// the range), e.g. a role on NVMe with no nvme_paths, rank >= world_size,
// sizes that are zero where required, unaligned or beyond 1 PiB.
STRATA_EXPORT Status ValidateEngineOptions(const EngineOptions& options);

}  // namespace strata

#endif  // STRATA_ENGINE_OPTIONS_H_
