// The engine's JSON config: real DeepSpeed configs (ZeRO-3 NVMe offload,
// ZeRO-Offload to CPU) read as the expected options, strata's own keys, every
// kind of bad config with its JSON path in the error, EngineOptions
// validation, files, and a deterministic fuzz of the reader.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "strata/engine_config.h"
#include "strata/engine_options.h"

namespace strata {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// As the DeepSpeed documentation's ZeRO-Infinity example, with the knobs a
// tuned config usually carries (ds_nvme_tune's aio section, with its string
// booleans).
constexpr const char* kZero3Nvme = R"({
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 100,
  "wall_clock_breakdown": false,
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8,
               "weight_decay": 0.01}
  },
  "bf16": {"enabled": true},
  "zero_optimization": {
    "stage": 3,
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    },
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 4,
      "pipeline_read": false,
      "pipeline_write": false,
      "fast_init": false
    },
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": 1e6,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "aio": {
    "block_size": 1048576,
    "queue_depth": 16,
    "intra_op_parallelism": 1,
    "single_submit": "false",
    "overlap_events": "true",
    "use_gds": false
  }
})";

constexpr const char* kZeroOffloadCpu = R"({
  "train_micro_batch_size_per_gpu": 8,
  "train_batch_size": 16,
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "initial_scale_power": 12,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0}},
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "allgather_partitions": true,
    "allgather_bucket_size": 2e8,
    "reduce_scatter": true,
    "reduce_bucket_size": 2e8,
    "overlap_comm": true,
    "contiguous_gradients": true
  },
  "zero_allow_untested_optimizer": false
})";

EngineConfig ParseOk(const std::string& json) {
  StatusOr<EngineConfig> c = ParseEngineConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : EngineConfig{};
}

// The error message of a config that must be refused.
std::string ParseError(const std::string& json) {
  StatusOr<EngineConfig> c = ParseEngineConfig(json);
  EXPECT_FALSE(c.ok()) << json;
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}

// Whether a warning starts with `path: `.
bool Warned(const EngineConfig& c, const std::string& path) {
  for (const std::string& w : c.warnings) {
    if (w.rfind(path + ": ", 0) == 0) return true;
  }
  return false;
}

TEST(EngineConfigTest, DeepSpeedZero3NvmeOffload) {
  const EngineConfig c = ParseOk(kZero3Nvme);
  const EngineOptions& o = c.options;
  EXPECT_EQ(o.zero_stage, 3);
  EXPECT_EQ(o.params, Residence::kNvme);
  EXPECT_EQ(o.optimizer_states, Residence::kNvme);
  EXPECT_EQ(o.grads, Residence::kHost);
  EXPECT_THAT(o.nvme_paths, ElementsAre("/local_nvme"));
  EXPECT_TRUE(o.pin_memory);
  EXPECT_EQ(o.working_dtype, CpuDType::kBFloat16);
  EXPECT_EQ(o.loss_scale.mode, LossScaleMode::kNone);
  // Element counts at 2 bytes (bf16); buffer_size rounded up to 4 KiB.
  EXPECT_EQ(o.staging_buffer_count, 5u);
  EXPECT_EQ(o.staging_buffer_bytes, 48829u * 4096u);  // >= 2e8
  EXPECT_EQ(o.prefetch_bytes, 100'000'000u);
  EXPECT_EQ(o.persistence_threshold_bytes, 200'000u);
  EXPECT_EQ(o.max_live_bytes, 2'000'000'000u);
  EXPECT_EQ(o.max_reuse_distance_bytes, 2'000'000'000u);
  EXPECT_EQ(o.sub_group_bytes, 2'000'000'000u);
  EXPECT_EQ(o.reduce_bucket_bytes, 2'000'000u);
  EXPECT_EQ(o.allgather_bucket_bytes, 0u);
  EXPECT_EQ(o.step_overlap_bytes, 0u);
  EXPECT_EQ(o.max_persistent_bytes, EngineOptions::kUnlimited);
  EXPECT_EQ(o.io_block_bytes, 1u << 20);
  EXPECT_EQ(o.io.queue_depth, 16u);
  EXPECT_EQ(o.gradient_accumulation_steps, 4u);
  EXPECT_DOUBLE_EQ(o.gradient_clipping, 1.0);
  EXPECT_EQ(o.optimizer.cpu.algo, CpuOptimizerAlgo::kAdamW);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 3e-5);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.beta1, 0.9);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.beta2, 0.95);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.eps, 1e-8);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.weight_decay, 0.01);
  EXPECT_TRUE(o.optimizer.cpu.bias_correction);
  EXPECT_TRUE(ValidateEngineOptions(o).ok());

  // Known, not acted on: reported by path.
  for (const char* path :
       {"steps_per_print", "wall_clock_breakdown",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"}) {
    EXPECT_TRUE(Warned(c, path)) << path;
  }
  // What strata does with several ranks anyway (true), and the buckets
  // (read): not reported.
  for (const char* path : {"zero_optimization.overlap_comm",
                           "zero_optimization.contiguous_gradients",
                           "zero_optimization.reduce_bucket_size"}) {
    EXPECT_FALSE(Warned(c, path)) << path;
  }
  // ds_nvme_tune's string booleans: coerced, with a warning.
  EXPECT_THAT(c.warnings,
              Contains("aio.single_submit: the string \"false\" is read as "
                       "the boolean false"));
  EXPECT_TRUE(Warned(c, "aio.overlap_events"));
  // Values that are what strata does anyway are not reported.
  EXPECT_FALSE(Warned(c, "aio.intra_op_parallelism"));
  EXPECT_FALSE(Warned(c, "aio.use_gds"));
  EXPECT_FALSE(Warned(c, "zero_optimization.offload_optimizer.fast_init"));
}

TEST(EngineConfigTest, DeepSpeedZeroOffloadCpu) {
  const EngineConfig c = ParseOk(kZeroOffloadCpu);
  const EngineOptions& o = c.options;
  EXPECT_EQ(o.zero_stage, 2);
  EXPECT_EQ(o.params, Residence::kDevice);
  EXPECT_EQ(o.optimizer_states, Residence::kHost);
  EXPECT_EQ(o.grads, Residence::kHost);
  EXPECT_THAT(o.nvme_paths, IsEmpty());
  EXPECT_EQ(o.working_dtype, CpuDType::kFloat16);
  EXPECT_EQ(o.loss_scale.mode, LossScaleMode::kDynamic);
  EXPECT_DOUBLE_EQ(o.loss_scale.initial_scale, 4096.0);
  EXPECT_EQ(o.loss_scale.window, 500u);
  EXPECT_EQ(o.loss_scale.hysteresis, 2u);
  EXPECT_DOUBLE_EQ(o.loss_scale.min_scale, 1.0);
  // 16 = 8 x accumulation x 1 rank.
  EXPECT_EQ(o.gradient_accumulation_steps, 2u);
  // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
  EXPECT_EQ(o.optimizer.cpu.algo, CpuOptimizerAlgo::kAdamW);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 1e-4);
  // Buckets over ranks: elements at 2 bytes (fp16).
  EXPECT_EQ(o.reduce_bucket_bytes, 400'000'000u);
  EXPECT_EQ(o.allgather_bucket_bytes, 400'000'000u);
  for (const char* path :
       {"zero_optimization.allgather_bucket_size",
        "zero_optimization.allgather_partitions",
        "zero_optimization.reduce_scatter", "zero_optimization.overlap_comm"}) {
    EXPECT_FALSE(Warned(c, path)) << path;
  }
  // Turned off, they are reported: strata always does them.
  const EngineConfig off = ParseOk(
      R"({"zero_optimization": {"stage": 2, "overlap_comm": false,
                                "contiguous_gradients": false}})");
  EXPECT_TRUE(Warned(off, "zero_optimization.overlap_comm"));
  EXPECT_TRUE(Warned(off, "zero_optimization.contiguous_gradients"));
  // strata's own keys, in bytes.
  const EngineConfig own = ParseOk(
      R"({"strata": {"reduce_bucket_bytes": 8192,
                     "allgather_bucket_bytes": 4096}})");
  EXPECT_EQ(own.options.reduce_bucket_bytes, 8192u);
  EXPECT_EQ(own.options.allgather_bucket_bytes, 4096u);
  // Where the collectives run.
  EXPECT_EQ(c.options.comm_memory, CommMemory::kAuto);
  EXPECT_EQ(
      ParseOk(R"({"strata": {"comm_memory": "device"}})").options.comm_memory,
      CommMemory::kDevice);
  EXPECT_EQ(
      ParseOk(R"({"strata": {"comm_memory": "host"}})").options.comm_memory,
      CommMemory::kHost);
  EXPECT_THAT(ParseError(R"({"strata": {"comm_memory": "gpu"}})"),
              HasSubstr("strata.comm_memory"));
  EngineOptions bad;
  bad.comm_memory = static_cast<CommMemory>(7);
  EXPECT_THAT(std::string(ValidateEngineOptions(bad).message()),
              HasSubstr("comm_memory"));
  EXPECT_FALSE(Warned(c, "zero_allow_untested_optimizer"));
}

TEST(EngineConfigTest, DeepSpeedPrecisionAndOptimizerVariants) {
  EngineConfig c = ParseOk(
      R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": false}},
          "fp16": {"enabled": true, "loss_scale": 128}})");
  EXPECT_EQ(c.options.optimizer.cpu.algo, CpuOptimizerAlgo::kAdam);
  EXPECT_EQ(c.options.loss_scale.mode, LossScaleMode::kStatic);
  EXPECT_DOUBLE_EQ(c.options.loss_scale.initial_scale, 128.0);

  // No fp16/bf16 in a DeepSpeed config: fp32, so elements are 4 bytes.
  c = ParseOk(R"({"zero_optimization": {"stage": 3,
                   "stage3_prefetch_bucket_size": 1000}})");
  EXPECT_EQ(c.options.working_dtype, CpuDType::kFloat32);
  EXPECT_EQ(c.options.prefetch_bytes, 4000u);
  // Optimizer states cannot stay on the device: host, with a warning.
  EXPECT_EQ(c.options.optimizer_states, Residence::kHost);
  EXPECT_TRUE(Warned(c, "zero_optimization.offload_optimizer.device"));

  // The other spellings of the stage3 knobs and of the bf16 section.
  c = ParseOk(R"({"bfloat16": {"enabled": true},
                  "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7,
                    "max_live_parameters": 9, "model_persistence_threshold": 5},
                  "aio": {"thread_count": 4}})");
  EXPECT_EQ(c.options.working_dtype, CpuDType::kBFloat16);
  EXPECT_EQ(c.options.prefetch_bytes, 14u);
  EXPECT_EQ(c.options.max_live_bytes, 18u);
  EXPECT_EQ(c.options.max_persistent_bytes, 10u);
  EXPECT_TRUE(Warned(c, "aio.thread_count"));

  c = ParseOk(R"({"optimizer": {"type": "Adagrad", "params": {}}})");
  EXPECT_EQ(c.options.optimizer.cpu.algo, CpuOptimizerAlgo::kAdagrad);
  EXPECT_DOUBLE_EQ(c.options.optimizer.lr, 1e-2);

  // The factored optimizers, with their own params (HF transformers' names
  // for Adafactor).
  c = ParseOk(R"({"optimizer": {"type": "Adafactor", "params": {
      "lr": 1e-3, "eps": [1e-30, 2e-3], "clip_threshold": 2.0,
      "decay_rate": -0.7, "beta1": 0.9, "weight_decay": 0.01,
      "scale_parameter": false, "relative_step": false,
      "warmup_init": false}}})");
  EXPECT_EQ(c.options.optimizer.cpu.algo, CpuOptimizerAlgo::kAdafactor);
  EXPECT_DOUBLE_EQ(c.options.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.options.optimizer.cpu.adafactor.eps2, 2e-3);
  EXPECT_DOUBLE_EQ(c.options.optimizer.cpu.adafactor.clip_threshold, 2.0);
  EXPECT_DOUBLE_EQ(c.options.optimizer.cpu.adafactor.decay_rate, -0.7);
  EXPECT_DOUBLE_EQ(c.options.optimizer.cpu.adafactor.beta1, 0.9);
  EXPECT_FALSE(c.options.optimizer.cpu.adafactor.relative_step);
  EXPECT_DOUBLE_EQ(c.options.optimizer.cpu.weight_decay, 0.01);
  c = ParseOk(R"({"optimizer": {"type": "SM3", "params": {
      "lr": 0.1, "momentum": 0.5}}})");
  EXPECT_EQ(c.options.optimizer.cpu.algo, CpuOptimizerAlgo::kSm3);
  EXPECT_DOUBLE_EQ(c.options.optimizer.cpu.beta1, 0.5);
  c = ParseOk(R"({"strata": {"optimizer": {"algo": "adafactor",
      "moment_dtype": "bf16"}}})");
  EXPECT_EQ(c.options.optimizer.cpu.algo, CpuOptimizerAlgo::kAdafactor);
  // Their gradients may rest on NVMe (the passes before the update read
  // them back).
  for (const char* algo : {"adafactor", "sm3"}) {
    SCOPED_TRACE(algo);
    c = ParseOk(std::string(R"({"strata": {"grads": "nvme",
        "nvme_paths": ["/x"], "optimizer": {"algo": ")") +
                algo + R"("}}})");
    EXPECT_EQ(c.options.grads, Residence::kNvme);
  }

  // Deprecated cpu_offload reads as offload_optimizer.device "cpu".
  c = ParseOk(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})");
  EXPECT_EQ(c.options.optimizer_states, Residence::kHost);
  EXPECT_TRUE(Warned(c, "zero_optimization.cpu_offload"));

  // Different nvme paths join the striped set; pin_memory false anywhere
  // turns pinning off.
  c = ParseOk(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/a",
                        "pin_memory": false},
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/b", "/a"]}}})");
  EXPECT_THAT(c.options.nvme_paths, ElementsAre("/a", "/b"));
  EXPECT_FALSE(c.options.pin_memory);
}

TEST(EngineConfigTest, StrataKeys) {
  const EngineConfig c = ParseOk(R"({"strata": {
      "rank": 1, "world_size": 2, "zero_stage": 3,
      "params": "nvme", "optimizer_states": "nvme", "grads": "nvme",
      "nvme_paths": ["/nvme0", "/nvme1"],
      "device_budget_bytes": 8589934592, "host_budget_bytes": 3.2e10,
      "pin_memory": false,
      "partition_bytes": 33554432,
      "staging_buffer_count": 6, "staging_buffer_bytes": 16777216,
      "prefetch_bytes": 0, "max_live_bytes": 1e9,
      "persistence_threshold_bytes": 65536, "max_persistent_bytes": 1048576,
      "max_reuse_distance_bytes": 0, "sub_group_bytes": 268435456,
      "step_overlap_bytes": 1073741824,
      "io_block_bytes": 2097152,
      "io": {"backend": "psync", "queue_depth": 64, "direct_io": false,
             "register_buffers": false, "register_files": false,
             "threads": 8, "max_retries": 3},
      "working_dtype": "fp16",
      "loss_scale": {"mode": "dynamic", "initial_scale": 1024,
                     "window": 200, "hysteresis": 3,
                     "consecutive_hysteresis": true, "min_scale": 0.5},
      "gradient_clipping": 0.5, "gradient_accumulation_steps": 8,
      "optimizer": {"algo": "lion", "lr": 1e-4, "beta1": 0.95,
                    "beta2": 0.98, "eps": 0, "weight_decay": 0.1,
                    "bias_correction": false, "threads": 12,
                    "variant": "scalar", "block8_sweeps": 2}}})");
  const EngineOptions& o = c.options;
  EXPECT_THAT(c.warnings, IsEmpty());
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 2);
  EXPECT_EQ(o.params, Residence::kNvme);
  EXPECT_EQ(o.optimizer_states, Residence::kNvme);
  EXPECT_EQ(o.grads, Residence::kNvme);
  EXPECT_THAT(o.nvme_paths, ElementsAre("/nvme0", "/nvme1"));
  EXPECT_EQ(o.device_budget_bytes, uint64_t{8} << 30);
  EXPECT_EQ(o.host_budget_bytes, 32'000'000'000u);
  EXPECT_FALSE(o.pin_memory);
  EXPECT_EQ(o.partition_bytes, 32u << 20);
  EXPECT_EQ(o.staging_buffer_count, 6u);
  EXPECT_EQ(o.staging_buffer_bytes, 16u << 20);
  EXPECT_EQ(o.prefetch_bytes, 0u);
  EXPECT_EQ(o.max_live_bytes, 1'000'000'000u);
  EXPECT_EQ(o.persistence_threshold_bytes, 65536u);
  EXPECT_EQ(o.max_persistent_bytes, 1u << 20);
  EXPECT_EQ(o.max_reuse_distance_bytes, 0u);
  EXPECT_EQ(o.sub_group_bytes, 256u << 20);
  EXPECT_EQ(o.step_overlap_bytes, 1u << 30);
  EXPECT_EQ(o.io_block_bytes, 2u << 20);
  EXPECT_EQ(o.io.backend, IoBackend::kThreads);
  EXPECT_EQ(o.io.queue_depth, 64u);
  EXPECT_FALSE(o.io.direct_io);
  EXPECT_FALSE(o.io.register_buffers);
  EXPECT_FALSE(o.io.register_files);
  EXPECT_EQ(o.io.threads, 8u);
  EXPECT_EQ(o.io.max_retries, 3u);
  EXPECT_EQ(o.working_dtype, CpuDType::kFloat16);
  EXPECT_EQ(o.loss_scale.mode, LossScaleMode::kDynamic);
  EXPECT_DOUBLE_EQ(o.loss_scale.initial_scale, 1024);
  EXPECT_EQ(o.loss_scale.window, 200u);
  EXPECT_EQ(o.loss_scale.hysteresis, 3u);
  EXPECT_TRUE(o.loss_scale.consecutive_hysteresis);
  EXPECT_DOUBLE_EQ(o.loss_scale.min_scale, 0.5);
  EXPECT_DOUBLE_EQ(o.gradient_clipping, 0.5);
  EXPECT_EQ(o.gradient_accumulation_steps, 8u);
  EXPECT_EQ(o.optimizer.cpu.algo, CpuOptimizerAlgo::kLion);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 1e-4);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.beta1, 0.95);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.beta2, 0.98);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.eps, 0);
  EXPECT_DOUBLE_EQ(o.optimizer.cpu.weight_decay, 0.1);
  EXPECT_FALSE(o.optimizer.cpu.bias_correction);
  EXPECT_EQ(o.optimizer.cpu.threads, 12);
  EXPECT_EQ(o.optimizer.cpu.variant, CpuKernelVariant::kScalar);
  EXPECT_EQ(o.optimizer.cpu.block8_sweeps, 2);
}

TEST(EngineConfigTest, EmptyObjectGivesDefaults) {
  const EngineConfig c = ParseOk("{}");
  const EngineOptions d;
  EXPECT_THAT(c.warnings, IsEmpty());
  EXPECT_EQ(c.options.zero_stage, d.zero_stage);
  EXPECT_EQ(c.options.working_dtype, d.working_dtype);
  EXPECT_EQ(c.options.partition_bytes, d.partition_bytes);
  EXPECT_EQ(c.options.params, d.params);
}

TEST(EngineConfigTest, StrataOverridesDeepSpeed) {
  const EngineConfig c = ParseOk(R"({
      "fp16": {"enabled": true},
      "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 100,
        "offload_param": {"device": "nvme", "nvme_path": "/ds"}},
      "strata": {"working_dtype": "fp32", "nvme_paths": ["/mine"],
                 "prefetch_bytes": 12288}})");
  EXPECT_EQ(c.options.working_dtype, CpuDType::kFloat32);
  EXPECT_EQ(c.options.prefetch_bytes, 12288u);
  EXPECT_THAT(c.options.nvme_paths, ElementsAre("/mine"));

  // pin_memory and the accumulation steps (whose batch check it skips).
  const EngineConfig d = ParseOk(R"({
      "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2,
      "zero_optimization": {"stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": false}},
      "strata": {"pin_memory": true, "gradient_accumulation_steps": 3}})");
  EXPECT_TRUE(d.options.pin_memory);
  EXPECT_EQ(d.options.gradient_accumulation_steps, 3u);
}

struct BadCase {
  const char* name;
  const char* json;
  std::vector<const char*> expected;  // substrings of the message
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadConfigTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfigTest, IsRefusedNamingThePath) {
  const std::string message = ParseError(GetParam().json);
  EXPECT_THAT(message, ::testing::StartsWith("engine config: "));
  for (const char* want : GetParam().expected) {
    EXPECT_THAT(message, HasSubstr(want));
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, BadConfigTest,
    ::testing::Values(
        // Unknown keys at several depths, with a suggestion.
        BadCase{"UnknownTopLevel",
                R"({"zero_optimisation": {"stage": 3}})",
                {"zero_optimisation: unknown key; did you mean "
                 "zero_optimization?"}},
        BadCase{"UnknownDepth3",
                R"({"zero_optimization": {"stage": 3, "offload_param":
                    {"device": "nvme", "nvme_pth": "/x"}}})",
                {"zero_optimization.offload_param.nvme_pth: unknown key; did "
                 "you mean nvme_path?",
                 "zero_optimization.offload_param.nvme_path: required when "
                 "device is \"nvme\""}},
        BadCase{"UnknownStrataIo",
                R"({"strata": {"io": {"queue_dpth": 4}}})",
                {"strata.io.queue_dpth: unknown key; did you mean "
                 "queue_depth?"}},
        BadCase{"UnknownOptimizerParam",
                R"({"optimizer": {"type": "AdamW", "params": {"lrr": 1}}})",
                {"optimizer.params.lrr: unknown key; did you mean lr?"}},
        BadCase{"UnknownAioListsKnownKeys",
                R"({"aio": {"zzzzzzzz": 1}})",
                {"aio.zzzzzzzz: unknown key; known keys: block_size, "
                 "queue_depth"}},
        BadCase{"UnknownOddKey",
                R"({"zero_optimization": {"a b": 1}})",
                {"zero_optimization[\"a b\"]: unknown key"}},
        BadCase{"SeveralErrorsAtOnce",
                R"({"zero_optimization": {"stagee": 3},
                    "aio": {"queue_depth": -1}})",
                {"zero_optimization.stagee: unknown key; did you mean stage?",
                 "aio.queue_depth: must not be negative, got -1"}},
        // Wrong types.
        BadCase{"StageAsString",
                R"({"zero_optimization": {"stage": "3"}})",
                {"zero_optimization.stage: expected a non-negative integer, "
                 "got string \"3\""}},
        BadCase{"EnabledAsNumber",
                R"({"fp16": {"enabled": 1}})",
                {"fp16.enabled: expected a boolean, got number 1"}},
        BadCase{"SectionAsArray",
                R"({"zero_optimization": []})",
                {"zero_optimization: expected an object, got an array"}},
        BadCase{"BetasAsNumber",
                R"({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}})",
                {"optimizer.params.betas: expected an array of two numbers"}},
        BadCase{"PathAsNumber",
                R"({"strata": {"nvme_paths": [1]}})",
                {"strata.nvme_paths[0]: expected a string, got number 1"}},
        BadCase{"DeviceUnknown",
                R"({"zero_optimization": {"stage": 3,
                    "offload_param": {"device": "disk"}}})",
                {"zero_optimization.offload_param.device: expected one of "
                 "none, cpu, nvme, got string \"disk\""}},
        BadCase{"OptimizerNotOurs",
                R"({"optimizer": {"type": "Lamb"}})",
                {"optimizer.type: expected one of Adam, AdamW, Adagrad, "
                 "Lion, Adafactor, SM3, got string \"Lamb\""}},
        BadCase{"OptimizerFactoredParam",
                R"({"optimizer": {"type": "Adafactor",
                    "params": {"decay_rate": 0.5}}})",
                {"optimizer.params.decay_rate"}},
        // "auto" must be resolved by the caller.
        BadCase{"AutoSize",
                R"({"zero_optimization": {"stage": 3,
                    "stage3_prefetch_bucket_size": "auto"}})",
                {"zero_optimization.stage3_prefetch_bucket_size: \"auto\" "
                 "must be resolved by the caller"}},
        BadCase{"AutoBatch",
                R"({"train_batch_size": "auto"})",
                {"train_batch_size: \"auto\" must be resolved"}},
        BadCase{
            "AutoBool",
            R"({"fp16": {"enabled": "auto"}})",
            {"fp16.enabled: \"auto\" must be resolved", "expected a boolean"}},
        // String booleans outside aio.
        BadCase{"StringBoolStrata",
                R"({"strata": {"pin_memory": "true"}})",
                {"strata.pin_memory: expected a boolean, got string "
                 "\"true\" (strings are read as booleans only in the aio "
                 "section)"}},
        BadCase{"StringBoolOffload",
                R"({"zero_optimization": {"stage": 3, "offload_param":
                    {"device": "cpu", "pin_memory": "false"}}})",
                {"zero_optimization.offload_param.pin_memory: expected a "
                 "boolean"}},
        BadCase{"AioNonBoolString",
                R"({"aio": {"use_gds": "yes"}})",
                {"aio.use_gds: expected a boolean, got string \"yes\""}},
        // Negative, zero, fractional, unaligned and absurd sizes.
        BadCase{"NegativeBlock",
                R"({"aio": {"block_size": -4096}})",
                {"aio.block_size: must not be negative, got -4096"}},
        BadCase{"NegativeFloat",
                R"({"zero_optimization": {"sub_group_size": -1e9}})",
                {"zero_optimization.sub_group_size: must not be negative"}},
        BadCase{"ZeroPartition",
                R"({"strata": {"partition_bytes": 0}})",
                {"strata.partition_bytes: 0 bytes is out of range; "
                 "accepted: 4 KiB .. 1 TiB in multiples of 4096"}},
        BadCase{"UnalignedBlock",
                R"({"aio": {"block_size": 5000}})",
                {"aio.block_size (io_block_bytes): 5000 bytes is not a "
                 "multiple of 4096"}},
        BadCase{"FractionalCount",
                R"({"zero_optimization": {"sub_group_size": 1.5}})",
                {"zero_optimization.sub_group_size: expected an integer, "
                 "got 1.5"}},
        BadCase{"AbsurdBudget",
                R"({"strata": {"device_budget_bytes": 1e18}})",
                {"strata.device_budget_bytes: 1000000000000000000 bytes is "
                 "out of range; accepted: 0 (automatic) or 1 .. 1 PiB"}},
        BadCase{
            "AbsurdElements",
            R"({"zero_optimization": {"stage3_max_live_parameters": 1e30}})",
            {"zero_optimization.stage3_max_live_parameters: 1e+30 is too "
             "large"}},
        BadCase{"ZeroQueueDepth",
                R"({"aio": {"queue_depth": 0}})",
                {"aio.queue_depth: 0 is out of range; accepted: 1 .. 32768"}},
        BadCase{"ThreeSweeps",
                R"({"strata": {"optimizer": {"block8_sweeps": 3}}})",
                {"strata.optimizer.block8_sweeps: 3 is out of range; "
                 "accepted: 0 (automatic) or 1 .. 2"}},
        BadCase{"ZeroMicroBatch",
                R"({"train_micro_batch_size_per_gpu": 0})",
                {"train_micro_batch_size_per_gpu: 0 is out of range"}},
        BadCase{"BudgetBelowPartition",
                R"({"strata": {"device_budget_bytes": 4096}})",
                {"strata.device_budget_bytes: 4096 bytes cannot hold one "
                 "partition"}},
        // Missing or inconsistent settings.
        BadCase{"NvmeWithoutPath",
                R"({"zero_optimization": {"stage": 3,
                    "offload_optimizer": {"device": "nvme"}}})",
                {"zero_optimization.offload_optimizer.nvme_path: required "
                 "when device is \"nvme\""}},
        BadCase{"StrataNvmeWithoutPaths",
                R"({"strata": {"params": "nvme"}})",
                {"nvme_paths: empty, but params rest on nvme"}},
        BadCase{"Stage4",
                R"({"zero_optimization": {"stage": 4}})",
                {"zero_optimization.stage (zero_stage): 4 is out of range; "
                 "accepted: 0 .. 3"}},
        BadCase{"ParamOffloadBelowStage3",
                R"({"zero_optimization": {"stage": 2,
                    "offload_param": {"device": "cpu"}}})",
                {"zero_optimization.offload_param.device (params): resting "
                 "on host needs zero_stage 3 (zero_stage is 2)"}},
        BadCase{"OptimizerOffloadStage0",
                R"({"zero_optimization": {"stage": 0,
                    "offload_optimizer": {"device": "cpu"}}})",
                {"zero_optimization.offload_optimizer.device: offloading the "
                 "optimizer needs stage 1 or more"}},
        BadCase{"OptimizerStatesOnDevice",
                R"({"strata": {"optimizer_states": "device"}})",
                {"strata.optimizer_states: device is not supported"}},
        BadCase{"RankOutOfRange",
                R"({"strata": {"rank": 2, "world_size": 2}})",
                {"strata.rank: 2 is out of range; accepted: 0 .. "
                 "world_size - 1 (1)"}},
        BadCase{"BothPrecisions",
                R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})",
                {"bf16.enabled: fp16 and bf16 are both enabled"}},
        BadCase{"SpellingsDisagree",
                R"({"zero_optimization": {"stage3_prefetch_bucket_size": 1,
                    "prefetch_bucket_size": 2}})",
                {"zero_optimization.prefetch_bucket_size: disagrees with "
                 "zero_optimization.stage3_prefetch_bucket_size"}},
        BadCase{"BatchMismatch",
                R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2})",
                {"train_batch_size: 10 is not train_micro_batch_size_per_gpu "
                 "(4) x gradient_accumulation_steps (2) x world size (1)"}},
        BadCase{"BetaOutOfRange",
                R"({"optimizer": {"type": "AdamW",
                    "params": {"betas": [0.9, 1.0]}}})",
                {"optimizer.params.betas[1] (optimizer.cpu.beta2): 1 is out "
                 "of range; accepted: [0, 1)"}},
        BadCase{
            "Amsgrad",
            R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})",
            {"optimizer.params.amsgrad: true is not supported"}},
        BadCase{"MinScaleAboveInitial",
                R"({"fp16": {"enabled": true, "initial_scale_power": 2,
                    "min_loss_scale": 8}})",
                {"fp16.min_loss_scale (loss_scale.min_scale): 8 is above "
                 "initial_scale (4)"}},
        BadCase{"DuplicateKey",
                R"({"zero_optimization": {"stage": 3, "stage": 2}})",
                {"zero_optimization.stage: key given twice in one object"}},
        BadCase{"DuplicateKeyInArray",
                R"({"strata": {"nvme_paths": ["/a"]},
                    "x": [{"a": 1}, {"b": 1, "b": 2}]})",
                {"x[1].b: key given twice in one object"}},
        // Not a config at all.
        BadCase{"Empty", "", {"empty input; expected a JSON object"}},
        BadCase{"Blank", " \n\t ", {"empty input"}},
        BadCase{"InvalidJson",
                "{\n  \"aio\": {\"block_size\": 1,}\n}",
                {"invalid JSON: parse error at line 2, column"}},
        // Beyond a double: nlohmann throws out_of_range, not parse_error
        // (found by fuzz/engine_config_fuzz.cc).
        BadCase{"NumberOverflow",
                R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e400}}})",
                {"optimizer.params.lr: number overflow parsing '1e400'"}},
        BadCase{"NumberOverflowInArray",
                R"({"x": [1, -2e999]})",
                {"x[1]: number overflow parsing '-2e999'"}},
        BadCase{"NumberOverflowTopLevel",
                "1e400",
                {"(top level): number overflow"}},
        BadCase{"TopLevelArray",
                "[1, 2]",
                {"(top level): expected a JSON object, got an array"}},
        BadCase{"TopLevelString",
                "\"zero\"",
                {"(top level): expected a JSON object, got string"}}),
    [](const ::testing::TestParamInfo<BadCase>& param) {
      return std::string(param.param.name);
    });

TEST(EngineConfigTest, ValidateDefaultsAndEachBadField) {
  EXPECT_TRUE(ValidateEngineOptions(EngineOptions{}).ok());

  auto message = [](const EngineOptions& o) {
    Status s = ValidateEngineOptions(o);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  EngineOptions o;
  o.rank = 1;
  EXPECT_THAT(message(o), HasSubstr("rank: 1 is out of range"));
  o = {};
  o.world_size = 0;
  EXPECT_THAT(message(o), HasSubstr("world_size: 0 is out of range"));
  o = {};
  o.optimizer_states = Residence::kNvme;
  EXPECT_THAT(message(o),
              HasSubstr("nvme_paths: empty, but optimizer_states rest on "
                        "nvme"));
  o.nvme_paths = {"/a", "/a", ""};
  EXPECT_THAT(message(o), HasSubstr("nvme_paths[1]: \"/a\" is given twice"));
  EXPECT_THAT(message(o), HasSubstr("nvme_paths[2]: an empty path"));
  o = {};
  o.partition_bytes = 4097;
  EXPECT_THAT(message(o),
              HasSubstr("partition_bytes: 4097 bytes is not a multiple of "
                        "4096"));
  o = {};
  o.staging_buffer_bytes = 100;
  EXPECT_THAT(message(o), HasSubstr("staging_buffer_bytes: 100 bytes is out "
                                    "of range; accepted: 0 (automatic) or "
                                    "4 KiB .. 1 TiB"));
  o = {};
  o.staging_buffer_count = 5000;
  EXPECT_THAT(message(o), HasSubstr("staging_buffer_count: 5000"));
  o = {};
  o.max_live_bytes = 0;
  EXPECT_THAT(message(o), HasSubstr("max_live_bytes: 0 bytes is out of range"));
  o = {};
  o.sub_group_bytes = 0;
  EXPECT_THAT(message(o), HasSubstr("sub_group_bytes: 0"));
  o = {};
  o.io.queue_depth = 0;
  EXPECT_THAT(message(o), HasSubstr("io.queue_depth: 0 is out of range"));
  o = {};
  o.gradient_accumulation_steps = 0;
  EXPECT_THAT(message(o), HasSubstr("gradient_accumulation_steps: 0"));
  o = {};
  o.gradient_clipping = -1;
  EXPECT_THAT(message(o), HasSubstr("gradient_clipping: -1 is out of range"));
  o = {};
  o.optimizer.lr = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THAT(message(o), HasSubstr("optimizer.lr: nan is out of range"));
  o = {};
  o.loss_scale.mode = LossScaleMode::kDynamic;
  o.loss_scale.window = 0;
  EXPECT_THAT(message(o), HasSubstr("loss_scale.window: 0 is out of range"));
  o = {};
  o.zero_stage = 1;
  o.params = Residence::kHost;
  EXPECT_THAT(message(o), HasSubstr("params: resting on host needs "
                                    "zero_stage 3"));
  // Several at once, all named.
  o = {};
  o.rank = -1;
  o.io_block_bytes = 0;
  const std::string both = message(o);
  EXPECT_THAT(both, HasSubstr("rank"));
  EXPECT_THAT(both, HasSubstr("io_block_bytes"));
}

TEST(EngineConfigTest, MomentFormats) {
  EXPECT_EQ(EngineOptions{}.optimizer.moment_dtype, CpuDType::kFloat32);
  for (const auto& [name, dtype] : {std::pair{"fp32", CpuDType::kFloat32},
                                    std::pair{"bf16", CpuDType::kBFloat16},
                                    std::pair{"INT8", CpuDType::kBlock8}}) {
    const EngineConfig c =
        ParseOk(std::string(R"({"strata": {"optimizer": {"algo": "lion",
            "moment_dtype": ")") +
                name + "\"}}}");
    EXPECT_EQ(c.options.optimizer.moment_dtype, dtype) << name;
  }
  EXPECT_EQ(MomentDTypeName(CpuDType::kBlock8), "int8");
  EXPECT_EQ(MomentDTypeName(CpuDType::kBFloat16), "bf16");
  EXPECT_EQ(ParseMomentDType("fp16").status().code(),
            StatusCode::kInvalidArgument);

  // Bad values name the key and what it accepts.
  for (const char* bad : {R"("fp16")", R"("int4")", "8"}) {
    const std::string m = ParseError(
        std::string(R"({"strata": {"optimizer": {"moment_dtype": )") + bad +
        "}}}");
    EXPECT_THAT(m, HasSubstr("strata.optimizer.moment_dtype: expected "));
  }
  EXPECT_THAT(
      ParseError(R"({"strata": {"optimizer": {"moment_dtype": "fp16"}}})"),
      HasSubstr("one of fp32, bf16, int8"));
  // Only Adam, AdamW and Lion take bf16 and int8 moments.
  const std::string m = ParseError(
      R"({"strata": {"optimizer": {"algo": "adagrad", "moment_dtype": "int8"}}})");
  EXPECT_THAT(m, HasSubstr("strata.optimizer.moment_dtype: int8 with adagrad; "
                           "accepted: fp32 with any optimizer, bf16 with "
                           "adam, adamw, lion, adafactor or sm3 (their first "
                           "moment), int8 with adam, adamw or lion"));
  // Adafactor's and SM3's first moment is bf16 at most.
  EXPECT_THAT(
      ParseError(
          R"({"strata": {"optimizer": {"algo": "sm3", "moment_dtype": "int8"}}})"),
      HasSubstr("strata.optimizer.moment_dtype: int8 with sm3"));
  EngineOptions o;
  o.optimizer.moment_dtype = CpuDType::kFloat16;
  Status st = ValidateEngineOptions(o);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("optimizer.moment_dtype: fp16 is not a moment format; "
                        "accepted: fp32, bf16, int8"));
  o.optimizer.moment_dtype = CpuDType::kBFloat16;
  o.optimizer.cpu.algo = CpuOptimizerAlgo::kAdagrad;
  EXPECT_THAT(std::string(ValidateEngineOptions(o).message()),
              HasSubstr("optimizer.moment_dtype: bf16 with adagrad"));
}

TEST(EngineConfigTest, NamesOfEnums) {
  EXPECT_EQ(ResidenceName(Residence::kDevice), "device");
  EXPECT_EQ(ResidenceName(Residence::kHost), "host");
  EXPECT_EQ(ResidenceName(Residence::kNvme), "nvme");
  EXPECT_EQ(LossScaleModeName(LossScaleMode::kNone), "none");
  EXPECT_EQ(LossScaleModeName(LossScaleMode::kStatic), "static");
  EXPECT_EQ(LossScaleModeName(LossScaleMode::kDynamic), "dynamic");
  EXPECT_EQ(CommMemoryName(CommMemory::kAuto), "auto");
  EXPECT_EQ(CommMemoryName(CommMemory::kHost), "host");
  EXPECT_EQ(CommMemoryName(CommMemory::kDevice), "device");
}

TEST(EngineConfigTest, File) {
  const std::string path = ::testing::TempDir() + "/strata_engine_config.json";
  {
    std::ofstream out(path);
    out << kZero3Nvme;
  }
  StatusOr<EngineConfig> c = ParseEngineConfigFile(path);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->options.params, Residence::kNvme);
  {
    std::ofstream out(path);
    out << R"({"aio": {"blok_size": 1}})";
  }
  c = ParseEngineConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("aio.blok_size: unknown key; did you mean "
                        "block_size?"));
  std::remove(path.c_str());
  c = ParseEngineConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
}

// ---- Fuzz ------------------------------------------------------------------

using nlohmann::json;

// Every node's pointer, the root included.
void CollectPointers(const json& j, const json::json_pointer& at,
                     std::vector<json::json_pointer>* out) {
  out->push_back(at);
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      CollectPointers(it.value(), at / it.key(), out);
    }
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) CollectPointers(j[i], at / i, out);
  }
}

json RandomValue(std::mt19937& rng) {
  static const json kValues[] = {nullptr,
                                 true,
                                 false,
                                 "auto",
                                 "true",
                                 -1,
                                 0,
                                 1,
                                 1.5,
                                 1e30,
                                 4096,
                                 3,
                                 "nvme",
                                 "cpu",
                                 "x",
                                 json::array(),
                                 json::object(),
                                 json::array({1, 2}),
                                 1e9,
                                 5000,
                                 -0.0,
                                 4,
                                 json::object({{"device", "nvme"}})};
  return kValues[rng() % std::size(kValues)];
}

std::string RandomKey(std::mt19937& rng, std::string key) {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyz_";
  const size_t pos = key.empty() ? 0 : rng() % (key.size() + 1);
  const char ch = kChars[rng() % (sizeof(kChars) - 1)];
  switch (rng() % 3) {
    case 0:
      key.insert(key.begin() + static_cast<std::ptrdiff_t>(pos), ch);
      break;
    case 1:
      if (pos < key.size()) key.erase(pos, 1);
      break;
    default:
      if (pos < key.size()) key[pos] = ch;
      break;
  }
  return key.empty() ? "k" : key;
}

void MutateStructure(std::mt19937& rng, json* doc) {
  std::vector<json::json_pointer> nodes;
  CollectPointers(*doc, json::json_pointer(), &nodes);
  const json::json_pointer at = nodes[rng() % nodes.size()];
  json& node = (*doc)[at];
  switch (rng() % 4) {
    case 0:  // a value of another type
      if (!at.empty()) node = RandomValue(rng);
      break;
    case 1:  // drop a key
      if (node.is_object() && !node.empty()) {
        auto it = node.begin();
        std::advance(it, rng() % node.size());
        node.erase(it);
      }
      break;
    case 2:  // misspell a key
      if (node.is_object() && !node.empty()) {
        auto it = node.begin();
        std::advance(it, rng() % node.size());
        const std::string key = it.key();
        json value = it.value();
        node.erase(key);
        node[RandomKey(rng, key)] = value;
      }
      break;
    default:  // add a key
      if (node.is_object()) node[RandomKey(rng, "key")] = RandomValue(rng);
      break;
  }
}

void MutateText(std::mt19937& rng, std::string* text) {
  static const char kChars[] = "{}[]\",:-.0123456789aetruflsn \n\\";
  const size_t pos = rng() % (text->size() + 1);
  switch (rng() % 4) {
    case 0:
      if (pos < text->size()) text->erase(pos, 1 + rng() % 3);
      break;
    case 1:
      text->insert(pos, 1, kChars[rng() % (sizeof(kChars) - 1)]);
      break;
    case 2:
      if (pos < text->size()) {
        text->insert(pos, text->substr(pos, 1 + rng() % 16));
      }
      break;
    default:
      text->resize(pos);
      break;
  }
}

bool IsKeyChar(char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
         (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
}

// Whether `m` starts with "<json path>[ (<field>)]: <what>": the path is
// "(top level)", or keys joined by '.', with [index] and ["odd key"].
bool StartsWithPath(std::string_view m) {
  size_t i = 0;
  if (m.rfind("(top level)", 0) == 0) {
    i = 11;
  } else {
    bool any = false;
    while (i < m.size()) {
      if (IsKeyChar(m[i]) ||
          (m[i] == '.' && any && i + 1 < m.size() && IsKeyChar(m[i + 1]))) {
        ++i;
      } else if (m.substr(i, 2) == "[\"") {
        i += 2;  // a JSON string up to its closing quote
        while (i < m.size() && m[i] != '"') i += m[i] == '\\' ? 2 : 1;
        if (m.substr(i, 2) != "\"]") return false;
        i += 2;
      } else if (m[i] == '[') {
        const size_t close = m.find(']', i);
        if (close == std::string_view::npos || close == i + 1) return false;
        for (size_t j = i + 1; j < close; ++j) {
          if (m[j] < '0' || m[j] > '9') return false;
        }
        i = close + 1;
      } else {
        break;
      }
      any = true;
    }
    if (!any) return false;
  }
  if (m.substr(i, 2) == " (") {
    const size_t close = m.find(')', i);
    if (close == std::string_view::npos) return false;
    i = close + 1;
  }
  return m.substr(i, 2) == ": " && m.size() > i + 2;
}

// OK, or an error whose first item names a JSON path (or says where the
// JSON is broken).
void ExpectOkOrPathError(const std::string& text, bool structural) {
  StatusOr<EngineConfig> c = ParseEngineConfig(text);
  if (c.ok()) {
    EXPECT_TRUE(ValidateEngineOptions(c->options).ok()) << text;
    return;
  }
  const std::string m(c.status().message());
  ASSERT_EQ(c.status().code(), StatusCode::kInvalidArgument) << m;
  constexpr std::string_view kPrefix = "engine config: ";
  ASSERT_EQ(m.rfind(kPrefix, 0), 0u) << m;
  const std::string_view rest = std::string_view(m).substr(kPrefix.size());
  if (structural) {
    EXPECT_TRUE(StartsWithPath(rest)) << m << "\n" << text;
  } else {
    EXPECT_TRUE(rest.rfind("invalid JSON: parse error at line ", 0) == 0 ||
                rest.rfind("empty input", 0) == 0 || StartsWithPath(rest))
        << m << "\n"
        << text;
  }
}

TEST(EngineConfigFuzzTest, PathCheckerOfTheFuzz) {
  EXPECT_TRUE(StartsWithPath("aio.block_size (io_block_bytes): 5000"));
  EXPECT_TRUE(StartsWithPath("x[1].b: key given twice"));
  EXPECT_TRUE(StartsWithPath("zero_optimization[\"a \\\" b\"]: unknown"));
  EXPECT_TRUE(StartsWithPath("(top level): expected"));
  EXPECT_FALSE(StartsWithPath("invalid JSON: parse error"));
  EXPECT_FALSE(StartsWithPath("aio.: x"));
  EXPECT_FALSE(StartsWithPath("aio[x]: x"));
  EXPECT_FALSE(StartsWithPath("aio.block_size: "));
}

TEST(EngineConfigFuzzTest, MutatedConfigsNeverCrashAndNameAPath) {
  constexpr uint32_t kSeed = 20240917;
  constexpr int kRounds = 400;
  std::cout << "fuzz seed " << kSeed << ", " << kRounds << " rounds\n";
  RecordProperty("seed", static_cast<int>(kSeed));
  std::mt19937 rng(kSeed);
  const json base = json::parse(kZero3Nvme);
  int refused = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const bool structural = rng() % 3 != 0;
    std::string text;
    if (structural) {
      json doc = base;
      const int n = 1 + static_cast<int>(rng() % 3);
      for (int i = 0; i < n; ++i) MutateStructure(rng, &doc);
      text = doc.dump();
    } else {
      text = base.dump(static_cast<int>(rng() % 2) * 2);
      const int n = 1 + static_cast<int>(rng() % 3);
      for (int i = 0; i < n; ++i) MutateText(rng, &text);
    }
    ExpectOkOrPathError(text, structural);
    refused += ParseEngineConfig(text).ok() ? 0 : 1;
    if (HasFatalFailure()) return;
  }
  // The mutations reach the error paths, and leave some configs valid.
  EXPECT_GT(refused, kRounds / 4);
  EXPECT_LT(refused, kRounds);
}

}  // namespace
}  // namespace strata
