// The C API (strata/c.h) call by call on the host-emulated device: the
// conventions (codes, messages, NULLs, destroy order), the engine trained
// through it with its tiers in host memory and on NVMe (a real scratch
// directory), and the CPU optimizer on caller arrays against the C++ one.
#include "strata/c.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/cpu_adam.h"
#include "strata/status.h"
#include "tests/swap/test_util.h"

extern "C" int strata_c_smoke(char* why, size_t why_len);

namespace strata {
namespace {

using testing::ScratchDir;

// Owns the message a call writes through errptr.
class CErr {
 public:
  CErr() = default;
  CErr(const CErr&) = delete;
  CErr& operator=(const CErr&) = delete;
  ~CErr() { strata_free(msg_); }
  // For the call's errptr: frees the previous message first.
  char** ptr() {
    strata_free(msg_);
    msg_ = nullptr;
    return &msg_;
  }
  const char* get() const { return msg_; }
  std::string str() const { return msg_ != nullptr ? msg_ : "(no message)"; }

 private:
  char* msg_ = nullptr;
};

#define EXPECT_MESSAGE_HAS(err, text) \
  EXPECT_NE((err).str().find(text), std::string::npos) << (err).str()

// Small partitions so that a few KiB of tensors span several units.
std::string HostConfig() {
  return R"({"strata": {"partition_bytes": 65536, "staging_buffer_bytes": 65536,
    "io_block_bytes": 65536, "device_budget_bytes": 8388608,
    "persistence_threshold_bytes": 0, "io": {"queue_depth": 4},
    "optimizer": {"threads": 1}}})";
}

std::string NvmeConfig(const std::string& dir) {
  nlohmann::json j = nlohmann::json::parse(HostConfig());
  j["strata"]["params"] = "nvme";
  j["strata"]["optimizer_states"] = "nvme";
  j["strata"]["grads"] = "nvme";
  j["strata"]["nvme_paths"] = {dir};
  return j.dump();
}

TEST(CApiTest, VersionMatchesTheHeaders) {
  EXPECT_STREQ(strata_version_string(), STRATA_VERSION_STRING);
  EXPECT_EQ(strata_version_major(), STRATA_VERSION_MAJOR);
  EXPECT_EQ(strata_version_minor(), STRATA_VERSION_MINOR);
  EXPECT_EQ(strata_version_patch(), STRATA_VERSION_PATCH);
  EXPECT_EQ(std::string(strata_version_string()),
            std::to_string(strata_version_major()) + "." +
                std::to_string(strata_version_minor()) + "." +
                std::to_string(strata_version_patch()));
}

TEST(CApiTest, CodeNamesAreStatusCodeNames) {
  for (int c = 0; c <= STRATA_INTERNAL; ++c) {
    EXPECT_EQ(std::string(strata_code_name(static_cast<strata_code_t>(c))),
              std::string(StatusCodeName(static_cast<StatusCode>(c))));
  }
  EXPECT_STREQ(strata_code_name(static_cast<strata_code_t>(99)), "Unknown");
  EXPECT_STREQ(strata_code_name(static_cast<strata_code_t>(-1)), "Unknown");
}

TEST(CApiTest, ErrptrIsNullOnSuccessAndAMessageOnFailure) {
  char sentinel = 0;
  char* err = &sentinel;  // must be overwritten, not freed
  EXPECT_EQ(strata_set_log_level("warn", &err), STRATA_OK);
  EXPECT_EQ(err, nullptr);
  EXPECT_EQ(strata_set_log_level("loud", &err), STRATA_INVALID_ARGUMENT);
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(err).find("trace, debug, info, warn, error, off"),
            std::string::npos)
      << err;
  strata_free(err);
  // errptr itself may be NULL; the code still tells.
  EXPECT_EQ(strata_set_log_level("loud", nullptr), STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_set_log_level(nullptr, nullptr), STRATA_INVALID_ARGUMENT);
  strata_free(nullptr);
}

TEST(CApiTest, HeaderIsC99AndCallableFromC) {
  char why[256] = {0};
  EXPECT_EQ(strata_c_smoke(why, sizeof why), 0) << why;
}

TEST(CApiTest, DeviceChoices) {
  CErr e;
  strata_device_t* dev = nullptr;
  ASSERT_EQ(strata_device_create("host", 16 << 20, &dev, e.ptr()), STRATA_OK)
      << e.str();
  EXPECT_STREQ(strata_device_kind(dev), "host-emulated");
  EXPECT_GT(std::strlen(strata_device_name(dev)), 0u);
  EXPECT_EQ(strata_device_destroy(dev, e.ptr()), STRATA_OK) << e.str();

  dev = reinterpret_cast<strata_device_t*>(&e);  // must be reset to NULL
  EXPECT_EQ(strata_device_create("tpu", 0, &dev, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(dev, nullptr);
  EXPECT_MESSAGE_HAS(e, "auto, host, cuda, cuda:N");
  EXPECT_EQ(strata_device_create("cuda:x", 0, &dev, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_device_create("host", 0, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "strata_device_create: out is NULL");

  // CUDA: a device where a GPU works, else Unavailable with the reason.
  const strata_code_t c = strata_device_create("cuda:0", 0, &dev, e.ptr());
  if (c == STRATA_OK) {
    EXPECT_STREQ(strata_device_kind(dev), "cuda");
    EXPECT_EQ(strata_device_destroy(dev, e.ptr()), STRATA_OK);
  } else {
    EXPECT_EQ(c, STRATA_UNAVAILABLE) << e.str();
    EXPECT_NE(e.get(), nullptr);
  }
  EXPECT_EQ(strata_device_destroy(nullptr, e.ptr()), STRATA_OK);
  EXPECT_STREQ(strata_device_kind(nullptr), nullptr);
}

class CApiDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(strata_device_create("host", 64 << 20, &dev_, e_.ptr()),
              STRATA_OK)
        << e_.str();
    ASSERT_EQ(strata_stream_create(dev_, &stream_, e_.ptr()), STRATA_OK)
        << e_.str();
  }
  void TearDown() override {
    EXPECT_EQ(strata_stream_destroy(stream_, e_.ptr()), STRATA_OK) << e_.str();
    EXPECT_EQ(strata_device_destroy(dev_, e_.ptr()), STRATA_OK) << e_.str();
  }

  CErr e_;
  strata_device_t* dev_ = nullptr;
  strata_stream_t* stream_ = nullptr;
};

TEST_F(CApiDeviceTest, CopiesThroughDeviceMemoryAndWrappedStreams) {
  strata_device_memory_t* mem = nullptr;
  ASSERT_EQ(strata_device_memory_alloc(stream_, 4096, &mem, e_.ptr()),
            STRATA_OK)
      << e_.str();
  ASSERT_NE(strata_device_memory_data(mem), nullptr);
  EXPECT_EQ(strata_device_memory_size(mem), 4096u);

  // A second stream on the same executor, as a trainer's stream would be.
  strata_stream_t* wrapped = nullptr;
  ASSERT_EQ(strata_stream_wrap_native(
                dev_, strata_stream_native_handle(stream_), &wrapped, e_.ptr()),
            STRATA_OK)
      << e_.str();
  std::vector<uint8_t> in(4096), out(4096, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7);
  ASSERT_EQ(
      strata_copy_async(wrapped, strata_device_memory_data(mem), in.data(),
                        in.size(), STRATA_HOST_TO_DEVICE, e_.ptr()),
      STRATA_OK)
      << e_.str();
  ASSERT_EQ(
      strata_copy_async(stream_, out.data(), strata_device_memory_data(mem),
                        out.size(), STRATA_DEVICE_TO_HOST, e_.ptr()),
      STRATA_OK)
      << e_.str();
  ASSERT_EQ(strata_stream_synchronize(stream_, e_.ptr()), STRATA_OK);
  EXPECT_EQ(in, out);

  // Registered caller memory is a device end too.
  std::vector<uint8_t> ext(4096, 0);
  strata_external_memory_t* reg = nullptr;
  ASSERT_EQ(strata_device_register_external(dev_, ext.data(), ext.size(), &reg,
                                            e_.ptr()),
            STRATA_OK)
      << e_.str();
  ASSERT_EQ(
      strata_copy_async(stream_, ext.data(), strata_device_memory_data(mem),
                        ext.size(), STRATA_DEVICE_TO_DEVICE, e_.ptr()),
      STRATA_OK)
      << e_.str();
  ASSERT_EQ(strata_stream_synchronize(stream_, e_.ptr()), STRATA_OK);
  EXPECT_EQ(ext, in);
  // Overlapping registrations are refused.
  strata_external_memory_t* again = nullptr;
  EXPECT_EQ(
      strata_device_register_external(dev_, ext.data(), 16, &again, e_.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(again, nullptr);

  EXPECT_EQ(strata_copy_async(stream_, out.data(), in.data(), 16,
                              static_cast<strata_copy_kind_t>(7), e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "copy kind 7");

  // Destroys in the wrong order are refused and destroy nothing.
  EXPECT_EQ(strata_stream_destroy(stream_, e_.ptr()),
            STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "strata_stream_destroy: 1 ");
  EXPECT_EQ(strata_device_destroy(dev_, e_.ptr()), STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "strata_device_destroy: 4 ");

  strata_external_memory_unregister(reg);
  strata_device_memory_free(mem);
  EXPECT_EQ(strata_stream_destroy(wrapped, e_.ptr()), STRATA_OK) << e_.str();
  strata_device_memory_free(nullptr);
  strata_external_memory_unregister(nullptr);
}

TEST_F(CApiDeviceTest, BadStreamArguments) {
  strata_stream_t* s = nullptr;
  int not_a_stream = 0;
  EXPECT_EQ(strata_stream_wrap_native(dev_, &not_a_stream, &s, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(s, nullptr);
  EXPECT_EQ(strata_stream_create(nullptr, &s, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "strata_stream_create: device is NULL");
  EXPECT_EQ(strata_stream_create(dev_, nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_stream_synchronize(nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_stream_destroy(nullptr, e_.ptr()), STRATA_OK);
  EXPECT_EQ(strata_stream_native_handle(nullptr), nullptr);
  strata_device_memory_t* mem = nullptr;
  EXPECT_EQ(strata_device_memory_alloc(nullptr, 16, &mem, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(
      strata_device_memory_alloc(stream_, size_t{1} << 40, &mem, e_.ptr()),
      STRATA_OUT_OF_MEMORY);
  EXPECT_EQ(mem, nullptr);
  EXPECT_EQ(strata_copy_async(nullptr, &mem, &mem, 1, STRATA_HOST_TO_DEVICE,
                              e_.ptr()),
            STRATA_INVALID_ARGUMENT);
}

TEST(CApiOptionsTest, JsonErrorsNameTheirPath) {
  CErr e;
  strata_engine_options_t* o = nullptr;
  const std::string bad = R"({"strata": {"partition_byts": 65536}})";
  EXPECT_EQ(
      strata_engine_options_from_json(bad.data(), bad.size(), &o, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(o, nullptr);
  EXPECT_MESSAGE_HAS(e, "strata.partition_byts");
  EXPECT_MESSAGE_HAS(e, "partition_bytes");  // the suggestion

  const std::string ds =
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
          "stage3_max_live_parameters": "auto"}})";
  EXPECT_EQ(strata_engine_options_from_json(ds.data(), ds.size(), &o, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "zero_optimization.stage3_max_live_parameters");

  const std::string broken = "{\"strata\": {";
  EXPECT_EQ(strata_engine_options_from_json(broken.data(), broken.size(), &o,
                                            e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "line");

  EXPECT_EQ(strata_engine_options_from_json(nullptr, 0, &o, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(
      strata_engine_options_from_json(bad.data(), bad.size(), nullptr, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_options_from_file(nullptr, &o, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  // The length counts, not a NUL: the tail after it is not read.
  const std::string padded = HostConfig() + "garbage";
  EXPECT_EQ(strata_engine_options_from_json(padded.data(), HostConfig().size(),
                                            &o, e.ptr()),
            STRATA_OK)
      << e.str();
  strata_engine_options_destroy(o);
  strata_engine_options_destroy(nullptr);
}

TEST(CApiOptionsTest, FileAndWarnings) {
  ScratchDir dir;
  CErr e;
  strata_engine_options_t* o = nullptr;
  const std::string missing = dir.File("missing.json");
  EXPECT_NE(strata_engine_options_from_file(missing.c_str(), &o, e.ptr()),
            STRATA_OK);
  EXPECT_MESSAGE_HAS(e, missing);

  const std::string path = dir.File("ds.json");
  std::ofstream(path) << R"({"zero_optimization": {"stage": 3,
      "overlap_comm": false, "offload_optimizer": {"device": "cpu"}},
      "bf16": {"enabled": true}})";
  ASSERT_EQ(strata_engine_options_from_file(path.c_str(), &o, e.ptr()),
            STRATA_OK)
      << e.str();
  ASSERT_GE(strata_engine_options_num_warnings(o), 1u);
  bool found = false;
  for (size_t i = 0; i < strata_engine_options_num_warnings(o); ++i) {
    found = found || std::string(strata_engine_options_warning(o, i))
                             .find("zero_optimization.overlap_comm") == 0;
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(
      strata_engine_options_warning(o, strata_engine_options_num_warnings(o)),
      nullptr);
  EXPECT_EQ(strata_engine_options_num_warnings(nullptr), 0u);
  strata_engine_options_destroy(o);
}

// ---- The communicator
// --------------------------------------------------------

// A config for `world_size` ranks with this rank and zero_stage 2.
std::string RanksConfig(int world_size, int rank) {
  nlohmann::json j = nlohmann::json::parse(HostConfig());
  j["strata"]["world_size"] = world_size;
  j["strata"]["rank"] = rank;
  j["strata"]["zero_stage"] = 2;
  return j.dump();
}

TEST(CApiCommTest, SingleRankCommGoesToTheEngine) {
  CErr e;
  strata_comm_t* comm = nullptr;
  ASSERT_EQ(strata_comm_create("single", 5, nullptr, nullptr, &comm, e.ptr()),
            STRATA_OK)
      << e.str();
  EXPECT_EQ(e.get(), nullptr);
  EXPECT_EQ(strata_comm_rank(comm), 0);
  EXPECT_EQ(strata_comm_size(comm), 1);
  EXPECT_STREQ(strata_comm_backend(comm), "single");
  strata_comm_t* dflt = nullptr;  // NULL backend and timeout 0: the defaults
  ASSERT_EQ(strata_comm_create(nullptr, 0, nullptr, nullptr, &dflt, e.ptr()),
            STRATA_OK)
      << e.str();
  EXPECT_STREQ(strata_comm_backend(dflt), "single");
  strata_comm_destroy(dflt);

  strata_device_t* dev = nullptr;
  ASSERT_EQ(strata_device_create("host", 16 << 20, &dev, e.ptr()), STRATA_OK);
  const std::string one = RanksConfig(1, 0);
  strata_engine_options_t* o = nullptr;
  ASSERT_EQ(
      strata_engine_options_from_json(one.data(), one.size(), &o, e.ptr()),
      STRATA_OK)
      << e.str();
  ASSERT_EQ(strata_engine_options_set_comm(o, comm, e.ptr()), STRATA_OK);
  strata_comm_destroy(comm);  // the options share it
  strata_engine_t* eng = nullptr;
  ASSERT_EQ(strata_engine_create(o, dev, &eng, e.ptr()), STRATA_OK) << e.str();
  strata_engine_options_destroy(o);  // and now the engine
  const int64_t shape[] = {40};
  uint32_t id = 9;
  ASSERT_EQ(
      strata_engine_register(eng, "t", shape, 1, STRATA_BFLOAT16, &id, e.ptr()),
      STRATA_OK)
      << e.str();
  ASSERT_EQ(strata_engine_start(eng, e.ptr()), STRATA_OK) << e.str();
  std::vector<float> init(40), back(40);
  for (size_t i = 0; i < init.size(); ++i)
    init[i] = 0.125f * static_cast<float>(i) - 2.0f;
  ASSERT_EQ(strata_engine_set_initial_values(eng, id, init.data(), init.size(),
                                             e.ptr()),
            STRATA_OK)
      << e.str();
  ASSERT_EQ(
      strata_engine_read_master(eng, id, back.data(), back.size(), e.ptr()),
      STRATA_OK)
      << e.str();
  EXPECT_EQ(back, init);
  EXPECT_EQ(strata_engine_destroy(eng, e.ptr()), STRATA_OK) << e.str();
  EXPECT_EQ(strata_device_destroy(dev, e.ptr()), STRATA_OK) << e.str();
}

TEST(CApiCommTest, TheEngineChecksTheConfigAgainstTheComm) {
  CErr e;
  strata_comm_t* comm = nullptr;
  ASSERT_EQ(strata_comm_create("single", 0, nullptr, nullptr, &comm, e.ptr()),
            STRATA_OK)
      << e.str();
  strata_device_t* dev = nullptr;
  ASSERT_EQ(strata_device_create("host", 16 << 20, &dev, e.ptr()), STRATA_OK);
  const std::string two = RanksConfig(2, 1);
  strata_engine_options_t* o = nullptr;
  ASSERT_EQ(
      strata_engine_options_from_json(two.data(), two.size(), &o, e.ptr()),
      STRATA_OK)
      << e.str();
  strata_engine_t* eng = nullptr;
  // world_size 2 without a communicator, then with one of 1 rank.
  EXPECT_EQ(strata_engine_create(o, dev, &eng, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "world_size 2 needs comm");
  ASSERT_EQ(strata_engine_options_set_comm(o, comm, e.ptr()), STRATA_OK);
  EXPECT_EQ(strata_engine_create(o, dev, &eng, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "comm has rank 0 of 1");
  EXPECT_MESSAGE_HAS(e, "rank 1 of world_size 2");
  EXPECT_EQ(eng, nullptr);
  // NULL takes the communicator back off.
  ASSERT_EQ(strata_engine_options_set_comm(o, nullptr, e.ptr()), STRATA_OK);
  EXPECT_EQ(strata_engine_create(o, dev, &eng, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "needs comm");
  strata_engine_options_destroy(o);
  strata_comm_destroy(comm);
  EXPECT_EQ(strata_device_destroy(dev, e.ptr()), STRATA_OK) << e.str();
}

TEST(CApiCommTest, BadArguments) {
  CErr e;
  strata_comm_t* comm = reinterpret_cast<strata_comm_t*>(&e);  // overwritten
  EXPECT_EQ(strata_comm_create("tcp", 0, nullptr, nullptr, &comm, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(comm, nullptr);
  EXPECT_MESSAGE_HAS(e, "strata_comm_create: backend \"tcp\"");
  EXPECT_MESSAGE_HAS(e, "accepted: single, mpi");
  EXPECT_EQ(strata_comm_create("", 0, nullptr, nullptr, &comm, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "backend \"\"");
  for (double t :
       {-1.0, 2e6, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    EXPECT_EQ(strata_comm_create("single", t, nullptr, nullptr, &comm, e.ptr()),
              STRATA_INVALID_ARGUMENT)
        << t;
    EXPECT_MESSAGE_HAS(e, "strata_comm_create: timeout_s");
    EXPECT_MESSAGE_HAS(e, "(0, 1e6]");
    EXPECT_EQ(comm, nullptr);
  }
  EXPECT_EQ(strata_comm_create("single", 0, nullptr, nullptr, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "strata_comm_create: out is NULL");
  // An MPI backend that cannot be loaded: unavailable, naming the file.
  ScratchDir dir;
  const std::string lib = dir.File("no_such_backend.so");
  EXPECT_EQ(strata_comm_create("mpi", 0, nullptr, lib.c_str(), &comm, e.ptr()),
            STRATA_UNAVAILABLE);
  EXPECT_MESSAGE_HAS(e, lib);
  EXPECT_EQ(comm, nullptr);

  EXPECT_EQ(strata_engine_options_set_comm(nullptr, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "strata_engine_options_set_comm: options is NULL");
}

TEST(CApiCommTest, NcclArgumentsAndItsAbsence) {
  CErr e;
  strata_comm_t* single = nullptr;
  ASSERT_EQ(strata_comm_create("single", 0, nullptr, nullptr, &single, e.ptr()),
            STRATA_OK)
      << e.str();
  strata_comm_t* comm = reinterpret_cast<strata_comm_t*>(&e);  // overwritten
  int fake = 0;  // never used as an ncclComm_t: every call below is refused
  EXPECT_EQ(strata_comm_create_nccl(nullptr, nullptr, 0, nullptr, 0, 0, &comm,
                                    e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(comm, nullptr);
  EXPECT_MESSAGE_HAS(e, "strata_comm_create_nccl: give one of nccl_comm");
  EXPECT_EQ(
      strata_comm_create_nccl(&fake, nullptr, 0, single, 0, 0, &comm, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "give one of nccl_comm");
  EXPECT_EQ(
      strata_comm_create_nccl(&fake, nullptr, 2, nullptr, 0, 0, &comm, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "ranks is NULL but num_ranks is 2");
  EXPECT_EQ(strata_comm_create_nccl(nullptr, nullptr, 0, single, -1, 0, &comm,
                                    e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "cuda_ordinal -1");
  EXPECT_EQ(strata_comm_create_nccl(nullptr, nullptr, 0, single, 0, -5, &comm,
                                    e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "strata_comm_create_nccl: timeout_s");
  EXPECT_EQ(strata_comm_create_nccl(nullptr, nullptr, 0, single, 0, 0, nullptr,
                                    e.ptr()),
            STRATA_INVALID_ARGUMENT);
  // Bootstrapped over one rank: an NCCL communicator of one rank where a
  // GPU and NCCL are, else unavailable with the reason.
  const strata_code_t made = strata_comm_create_nccl(
      nullptr, nullptr, 0, single, 0, 30, &comm, e.ptr());
  if (made == STRATA_OK) {
    EXPECT_STREQ(strata_comm_backend(comm), "nccl");
    EXPECT_EQ(strata_comm_size(comm), 1);
    strata_comm_destroy(comm);
  } else {
    EXPECT_EQ(made, STRATA_UNAVAILABLE) << e.str();
    EXPECT_EQ(comm, nullptr);
    EXPECT_FALSE(e.str().empty());
  }
  strata_comm_destroy(single);
}

TEST(CApiCommTest, NullHandles) {
  EXPECT_EQ(strata_comm_rank(nullptr), 0);
  EXPECT_EQ(strata_comm_size(nullptr), 0);
  EXPECT_EQ(strata_comm_backend(nullptr), nullptr);
  strata_comm_destroy(nullptr);
}

// ---- The engine -------------------------------------------------------------

constexpr int64_t kRows = 64, kCols = 48;  // 3072 elements: one 6 KiB unit
constexpr size_t kW = kRows * kCols;
constexpr size_t kB = 7;  // a small tensor packed with w
constexpr double kLr = 0.01;

// Constant nonzero gradients: Adam then moves each weight by lr * sign(g)
// per step (m / sqrt(v) is exactly g / |g| after bias correction).
float GradOf(size_t i) { return (i % 3 == 0 ? -0.5f : 0.25f) * (1 + i % 5); }
float InitOf(size_t i) { return 0.001f * static_cast<float>(i % 97) - 0.05f; }

// Engine test: the tiers in host memory (false) or on NVMe (true).
class CApiEngineTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    ASSERT_EQ(strata_device_create("host", 64 << 20, &dev_, e_.ptr()),
              STRATA_OK)
        << e_.str();
    ASSERT_EQ(strata_stream_create(dev_, &stream_, e_.ptr()), STRATA_OK);
    const std::string cfg = GetParam() ? NvmeConfig(dir_.path()) : HostConfig();
    strata_engine_options_t* o = nullptr;
    ASSERT_EQ(
        strata_engine_options_from_json(cfg.data(), cfg.size(), &o, e_.ptr()),
        STRATA_OK)
        << e_.str();
    ASSERT_EQ(strata_engine_create(o, dev_, &eng_, e_.ptr()), STRATA_OK)
        << e_.str();
    strata_engine_options_destroy(o);  // the engine holds a copy
  }

  void TearDown() override {
    EXPECT_EQ(strata_engine_destroy(eng_, e_.ptr()), STRATA_OK) << e_.str();
    EXPECT_EQ(strata_stream_destroy(stream_, e_.ptr()), STRATA_OK) << e_.str();
    EXPECT_EQ(strata_device_destroy(dev_, e_.ptr()), STRATA_OK) << e_.str();
  }

  // Registers w and b, starts, and sets their initial values.
  void RegisterAndStart() {
    const int64_t wshape[] = {kRows, kCols};
    const int64_t bshape[] = {static_cast<int64_t>(kB)};
    ASSERT_EQ(strata_engine_register(eng_, "w", wshape, 2, STRATA_BFLOAT16, &w_,
                                     e_.ptr()),
              STRATA_OK)
        << e_.str();
    ASSERT_EQ(strata_engine_register(eng_, "b", bshape, 1, STRATA_BFLOAT16, &b_,
                                     e_.ptr()),
              STRATA_OK)
        << e_.str();
    EXPECT_EQ(w_, 0u);
    EXPECT_EQ(b_, 1u);
    EXPECT_EQ(strata_engine_num_tensors(eng_), 2u);
    ASSERT_EQ(strata_engine_start(eng_, e_.ptr()), STRATA_OK) << e_.str();
    std::vector<float> w(kW), b(kB);
    for (size_t i = 0; i < kW; ++i) w[i] = InitOf(i);
    for (size_t i = 0; i < kB; ++i) b[i] = InitOf(i);
    ASSERT_EQ(strata_engine_set_initial_values(eng_, w_, w.data(), w.size(),
                                               e_.ptr()),
              STRATA_OK)
        << e_.str();
    ASSERT_EQ(strata_engine_set_initial_values(eng_, b_, b.data(), b.size(),
                                               e_.ptr()),
              STRATA_OK)
        << e_.str();
  }

  // A device buffer holding GradOf(i) * scale for n elements (fp32).
  strata_device_memory_t* DeviceGrad(size_t n, float scale) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = GradOf(i) * scale;
    strata_device_memory_t* mem = nullptr;
    EXPECT_EQ(strata_device_memory_alloc(stream_, n * 4, &mem, e_.ptr()),
              STRATA_OK)
        << e_.str();
    EXPECT_EQ(
        strata_copy_async(stream_, strata_device_memory_data(mem), g.data(),
                          n * 4, STRATA_HOST_TO_DEVICE, e_.ptr()),
        STRATA_OK)
        << e_.str();
    // Pageable host memory: the copy has read `g` once it returns.
    return mem;
  }

  // One micro-batch: fetch both (the trainer's forward), hand over w's
  // gradient by address and b's by ownership.
  void MicroBatch(float scale) {
    strata_param_pin_t* pw = nullptr;
    strata_param_pin_t* pb = nullptr;
    ASSERT_EQ(strata_engine_fetch(eng_, w_, &pw, e_.ptr()), STRATA_OK)
        << e_.str();
    ASSERT_EQ(strata_engine_fetch(eng_, b_, &pb, e_.ptr()), STRATA_OK)
        << e_.str();
    EXPECT_EQ(strata_param_pin_bytes(pw), kW * 2);
    EXPECT_EQ(strata_param_pin_dtype(pw), STRATA_BFLOAT16);
    EXPECT_EQ(strata_param_pin_wait_on(pw, stream_, e_.ptr()), STRATA_OK)
        << e_.str();
    EXPECT_EQ(strata_param_pin_wait(pb, e_.ptr()), STRATA_OK) << e_.str();
    strata_device_memory_t* gw = DeviceGrad(kW, scale);
    EXPECT_EQ(strata_engine_add_grad(eng_, w_, strata_device_memory_data(gw),
                                     STRATA_FLOAT32, stream_, e_.ptr()),
              STRATA_OK)
        << e_.str();
    EXPECT_EQ(strata_engine_add_grad_owned(eng_, b_, DeviceGrad(kB, scale),
                                           STRATA_FLOAT32, stream_, e_.ptr()),
              STRATA_OK)
        << e_.str();
    strata_param_pin_release(pw);
    strata_param_pin_release(pb);
    EXPECT_EQ(strata_engine_wait_grads(eng_, e_.ptr()), STRATA_OK) << e_.str();
    strata_device_memory_free(gw);  // unchanged until wait_grads returned
  }

  // A step at kLr, loss scale 1, no clipping: 1 if it was applied.
  int StepApplied() {
    int applied = -1;
    EXPECT_EQ(strata_engine_step(eng_, kLr, 1.0, 0.0, &applied, nullptr,
                                 nullptr, e_.ptr()),
              STRATA_OK)
        << e_.str();
    return applied;
  }

  std::vector<float> Master(uint32_t id, size_t n) {
    std::vector<float> m(n);
    EXPECT_EQ(strata_engine_read_master(eng_, id, m.data(), n, e_.ptr()),
              STRATA_OK)
        << e_.str();
    return m;
  }

  ScratchDir dir_;
  CErr e_;
  strata_device_t* dev_ = nullptr;
  strata_stream_t* stream_ = nullptr;
  strata_engine_t* eng_ = nullptr;
  uint32_t w_ = 0, b_ = 0;
};

TEST_P(CApiEngineTest, TrainsWithHandedOverGradients) {
  RegisterAndStart();
  uint64_t numel = 0;
  ASSERT_EQ(strata_engine_tensor_numel(eng_, w_, &numel, e_.ptr()), STRATA_OK);
  EXPECT_EQ(numel, kW);
  EXPECT_EQ(Master(w_, kW)[5], InitOf(5));

  constexpr int kSteps = 3;
  for (int s = 1; s <= kSteps; ++s) {
    // The second step hands over gradients scaled by 8 and unscales them.
    const float scale = s == 2 ? 8.0f : 1.0f;
    MicroBatch(scale);
    int applied = 0;
    double norm = 0;
    int64_t step = 0;
    ASSERT_EQ(strata_engine_step(eng_, kLr, scale, 0.0, &applied, &norm, &step,
                                 e_.ptr()),
              STRATA_OK)
        << e_.str();
    EXPECT_EQ(applied, 1);
    EXPECT_EQ(step, s);
    double want = 0;
    for (size_t i = 0; i < kW; ++i) want += double(GradOf(i)) * GradOf(i);
    for (size_t i = 0; i < kB; ++i) want += double(GradOf(i)) * GradOf(i);
    EXPECT_NEAR(norm, std::sqrt(want), 1e-6 * std::sqrt(want));
  }
  const std::vector<float> w = Master(w_, kW);
  const std::vector<float> b = Master(b_, kB);
  for (size_t i = 0; i < kW; ++i) {
    const double want = InitOf(i) - kSteps * kLr * (GradOf(i) > 0 ? 1.0 : -1.0);
    ASSERT_NEAR(w[i], want, 1e-5) << "w[" << i << "]";
  }
  for (size_t i = 0; i < kB; ++i) {
    const double want = InitOf(i) - kSteps * kLr * (GradOf(i) > 0 ? 1.0 : -1.0);
    ASSERT_NEAR(b[i], want, 1e-5) << "b[" << i << "]";
  }

  // The working copy fetched now is the master rounded to bf16.
  strata_param_pin_t* pw = nullptr;
  ASSERT_EQ(strata_engine_fetch(eng_, w_, &pw, e_.ptr()), STRATA_OK);
  ASSERT_EQ(strata_param_pin_wait(pw, e_.ptr()), STRATA_OK) << e_.str();
  std::vector<uint16_t> dev_bf16(kW), want_bf16(kW);
  ASSERT_EQ(
      strata_copy_async(stream_, dev_bf16.data(), strata_param_pin_data(pw),
                        kW * 2, STRATA_DEVICE_TO_HOST, e_.ptr()),
      STRATA_OK)
      << e_.str();
  ASSERT_EQ(strata_stream_synchronize(stream_, e_.ptr()), STRATA_OK);
  strata_param_pin_release(pw);
  ASSERT_EQ(strata_convert(w.data(), STRATA_FLOAT32, want_bf16.data(),
                           STRATA_BFLOAT16, kW, e_.ptr()),
            STRATA_OK)
      << e_.str();
  EXPECT_EQ(dev_bf16, want_bf16);

  char* json = nullptr;
  ASSERT_EQ(strata_engine_stats_json(eng_, &json, e_.ptr()), STRATA_OK);
  const nlohmann::json stats = nlohmann::json::parse(json);
  strata_free(json);
  EXPECT_EQ(stats.at("steps").get<int>(), kSteps);
  EXPECT_GE(stats.at("fetches").get<int>(), 2 * kSteps + 1);
  double scale = 0;
  ASSERT_EQ(strata_engine_loss_scale(eng_, &scale, e_.ptr()), STRATA_OK);
  EXPECT_EQ(scale, 1.0);  // no loss scaling in the config
  EXPECT_EQ(stats.at("loss_scale").get<double>(), 1.0);
}

// strata_engine_begin_step before each step's micro-batch: the masters of
// TrainsWithHandedOverGradients; with the gradients on the host the engine
// took their statistics while "backward" ran (none on NVMe). Its misuses
// come back as codes naming the rule.
TEST_P(CApiEngineTest, BeginStepBeforeTheLastMicroBatch) {
  RegisterAndStart();
  constexpr int kSteps = 3;
  for (int s = 1; s <= kSteps; ++s) {
    ASSERT_EQ(strata_engine_begin_step(eng_, kLr, 1.0, 0.0, e_.ptr()),
              STRATA_OK)
        << e_.str();
    MicroBatch(1.0f);
    EXPECT_EQ(StepApplied(), 1);
  }
  const std::vector<float> w = Master(w_, kW);
  for (size_t i = 0; i < kW; ++i) {
    const double want = InitOf(i) - kSteps * kLr * (GradOf(i) > 0 ? 1.0 : -1.0);
    ASSERT_NEAR(w[i], want, 1e-5) << "w[" << i << "]";
  }
  char* json = nullptr;
  ASSERT_EQ(strata_engine_stats_json(eng_, &json, e_.ptr()), STRATA_OK);
  const nlohmann::json stats = nlohmann::json::parse(json);
  strata_free(json);
  const int early = stats.at("early_statistics").get<int>();
  if (GetParam()) {
    EXPECT_EQ(early, 0);  // gradients on NVMe: the step reads them itself
  } else {
    EXPECT_GE(early, kSteps);  // every unit, every step
    EXPECT_EQ(early % kSteps, 0);
  }

  // Clipping, twice, a second gradient, no engine.
  EXPECT_EQ(strata_engine_begin_step(eng_, kLr, 1.0, 1.0, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "max_grad_norm");
  ASSERT_EQ(strata_engine_begin_step(eng_, kLr, 1.0, 0.0, e_.ptr()), STRATA_OK)
      << e_.str();
  EXPECT_EQ(strata_engine_begin_step(eng_, kLr, 1.0, 0.0, e_.ptr()),
            STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "twice");
  EXPECT_EQ(strata_engine_add_grad_owned(eng_, b_, DeviceGrad(kB, 1.0f),
                                         STRATA_FLOAT32, stream_, e_.ptr()),
            STRATA_OK)
      << e_.str();
  EXPECT_EQ(strata_engine_add_grad_owned(eng_, b_, DeviceGrad(kB, 1.0f),
                                         STRATA_FLOAT32, stream_, e_.ptr()),
            STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "last gradient");
  EXPECT_EQ(strata_engine_begin_step(nullptr, kLr, 1.0, 0.0, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "engine");
  // The step still runs, and the next steps need no begin_step.
  EXPECT_EQ(StepApplied(), 1);
}

TEST_P(CApiEngineTest, OverflowSkipsTheStep) {
  RegisterAndStart();
  MicroBatch(INFINITY);
  int applied = 1;
  int64_t step = -1;
  ASSERT_EQ(strata_engine_step(eng_, kLr, 1.0, 0.0, &applied, nullptr, &step,
                               e_.ptr()),
            STRATA_OK)
      << e_.str();
  EXPECT_EQ(applied, 0);
  EXPECT_EQ(step, 0);
  EXPECT_EQ(Master(w_, kW)[3], InitOf(3));
}

// A checkpoint round trip: the masters loaded are the saved ones bit for
// bit, and the step after the load is the uninterrupted run's step.
TEST_P(CApiEngineTest, CheckpointRoundTrip) {
  RegisterAndStart();
  auto one_step = [&](int64_t want_step) {
    MicroBatch(1.0f);
    int applied = 0;
    int64_t step = 0;
    ASSERT_EQ(strata_engine_step(eng_, kLr, 1.0, 0.0, &applied, nullptr, &step,
                                 e_.ptr()),
              STRATA_OK)
        << e_.str();
    EXPECT_EQ(applied, 1);
    EXPECT_EQ(step, want_step);
  };
  one_step(1);
  one_step(2);
  const std::vector<float> w2 = Master(w_, kW), b2 = Master(b_, kB);
  const std::string ckpt = dir_.File("ckpt");
  char* saved = nullptr;
  ASSERT_EQ(strata_engine_save_checkpoint(eng_, ckpt.c_str(), 2, 0, 1, &saved,
                                          e_.ptr()),
            STRATA_OK)
      << e_.str();
  ASSERT_NE(saved, nullptr);
  const std::string saved_path = saved;
  strata_free(saved);
  EXPECT_EQ(saved_path.rfind(ckpt + "/", 0), 0u) << saved_path;
  EXPECT_NE(saved_path.find("step-"), std::string::npos) << saved_path;
  // The same step again: the published one stays.
  EXPECT_EQ(strata_engine_save_checkpoint(eng_, ckpt.c_str(), 2, 0, 0, nullptr,
                                          e_.ptr()),
            STRATA_ALREADY_EXISTS);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_save_checkpoint: " + ckpt);

  one_step(3);
  const std::vector<float> w3 = Master(w_, kW), b3 = Master(b_, kB);
  ASSERT_NE(w3, w2);

  char* loaded = nullptr;
  ASSERT_EQ(
      strata_engine_load_checkpoint(eng_, ckpt.c_str(), &loaded, e_.ptr()),
      STRATA_OK)
      << e_.str();
  ASSERT_NE(loaded, nullptr);
  EXPECT_EQ(std::string(loaded), saved_path);
  strata_free(loaded);
  const std::vector<float> wl = Master(w_, kW), bl = Master(b_, kB);
  EXPECT_EQ(std::memcmp(wl.data(), w2.data(), kW * 4), 0);
  EXPECT_EQ(std::memcmp(bl.data(), b2.data(), kB * 4), 0);
  one_step(3);  // the step count came back with the state
  const std::vector<float> wr = Master(w_, kW), br = Master(b_, kB);
  EXPECT_EQ(std::memcmp(wr.data(), w3.data(), kW * 4), 0);
  EXPECT_EQ(std::memcmp(br.data(), b3.data(), kB * 4), 0);

  // The step-<N> directory itself loads too.
  ASSERT_EQ(strata_engine_load_checkpoint(eng_, saved_path.c_str(), nullptr,
                                          e_.ptr()),
            STRATA_OK)
      << e_.str();
  EXPECT_EQ(Master(w_, kW), w2);
}

TEST_P(CApiEngineTest, CheckpointErrors) {
  RegisterAndStart();
  const std::string ckpt = dir_.File("ckpt");
  char* path = reinterpret_cast<char*>(&e_);  // overwritten with NULL
  EXPECT_EQ(strata_engine_save_checkpoint(nullptr, ckpt.c_str(), 0, 0, 0, &path,
                                          e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(path, nullptr);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_save_checkpoint: engine is NULL");
  EXPECT_EQ(
      strata_engine_save_checkpoint(eng_, nullptr, 0, 0, 0, nullptr, e_.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_save_checkpoint: dir is NULL");
  EXPECT_EQ(strata_engine_save_checkpoint(eng_, ckpt.c_str(), -1, 0, 0, nullptr,
                                          e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "step -1");
  EXPECT_EQ(strata_engine_save_checkpoint(eng_, ckpt.c_str(), 0, -2, 0, nullptr,
                                          e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "keep -2");
  // A directory that cannot be made: its parent is a file.
  const std::string file = dir_.File("a-file");
  std::ofstream(file) << "x";
  const std::string under_file = file + "/ckpt";
  path = reinterpret_cast<char*>(&e_);
  EXPECT_NE(strata_engine_save_checkpoint(eng_, under_file.c_str(), 0, 0, 0,
                                          &path, e_.ptr()),
            STRATA_OK);
  EXPECT_EQ(path, nullptr);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_save_checkpoint: " + under_file);

  // Loading: nothing there, no checkpoint in it, NULLs.
  const std::string missing = dir_.File("missing");
  char* loaded = reinterpret_cast<char*>(&e_);
  EXPECT_EQ(
      strata_engine_load_checkpoint(eng_, missing.c_str(), &loaded, e_.ptr()),
      STRATA_NOT_FOUND);
  EXPECT_EQ(loaded, nullptr);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_load_checkpoint: " + missing);
  EXPECT_NE(strata_engine_load_checkpoint(eng_, dir_.path().c_str(), nullptr,
                                          e_.ptr()),
            STRATA_OK);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_load_checkpoint: " + dir_.path());
  EXPECT_EQ(strata_engine_load_checkpoint(eng_, nullptr, nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_load_checkpoint: path is NULL");
  EXPECT_EQ(
      strata_engine_load_checkpoint(nullptr, ckpt.c_str(), nullptr, e_.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_load_checkpoint: engine is NULL");
  // The engine is unharmed: it still steps.
  MicroBatch(1.0f);
  EXPECT_EQ(StepApplied(), 1);
}

TEST_P(CApiEngineTest, Misuse) {
  strata_param_pin_t* pin = nullptr;
  // Before start.
  EXPECT_EQ(strata_engine_fetch(eng_, 0, &pin, e_.ptr()),
            STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "before Start");
  EXPECT_EQ(pin, nullptr);
  const int64_t shape[] = {4, 4};
  const int64_t zero[] = {4, 0};
  uint32_t id = 99;
  EXPECT_EQ(strata_engine_register(eng_, "fp32", shape, 2, STRATA_FLOAT32, &id,
                                   e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(
      strata_engine_register(eng_, "q", shape, 2, STRATA_BLOCK8, &id, e_.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "accepted: STRATA_FLOAT32");
  EXPECT_EQ(strata_engine_register(eng_, "z", zero, 2, STRATA_BFLOAT16, &id,
                                   e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_register(eng_, "n", nullptr, 2, STRATA_BFLOAT16, &id,
                                   e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_register(eng_, nullptr, shape, 2, STRATA_BFLOAT16,
                                   &id, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_register(eng_, "x", shape, 2, STRATA_BFLOAT16,
                                   nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(id, 99u);
  RegisterAndStart();

  // Unknown tensor ids.
  std::vector<float> buf(kW);
  uint64_t numel = 0;
  EXPECT_EQ(strata_engine_fetch(eng_, 7, &pin, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "no tensor 7");
  EXPECT_EQ(strata_engine_read_master(eng_, 7, buf.data(), kW, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_set_initial_values(eng_, 7, buf.data(), kW, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_tensor_numel(eng_, 7, &numel, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "no tensor 7 (2 registered)");
  strata_device_memory_t* g = DeviceGrad(kW, 1.0f);
  EXPECT_EQ(strata_engine_add_grad(eng_, 7, strata_device_memory_data(g),
                                   STRATA_FLOAT32, stream_, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  // Sizes that do not match the tensor.
  EXPECT_EQ(strata_engine_read_master(eng_, w_, buf.data(), kW - 1, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(
      strata_engine_set_initial_values(eng_, b_, buf.data(), kB + 1, e_.ptr()),
      STRATA_INVALID_ARGUMENT);

  // A stream of another device is refused where a stream is taken.
  strata_device_t* other = nullptr;
  strata_stream_t* foreign = nullptr;
  ASSERT_EQ(strata_device_create("host", 1 << 20, &other, e_.ptr()), STRATA_OK);
  ASSERT_EQ(strata_stream_create(other, &foreign, e_.ptr()), STRATA_OK);
  EXPECT_EQ(strata_engine_add_grad(eng_, w_, strata_device_memory_data(g),
                                   STRATA_FLOAT32, foreign, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_add_grad: the stream is");

  // Pins: the engine and the stream a pin waited on outlive it.
  ASSERT_EQ(strata_engine_fetch(eng_, w_, &pin, e_.ptr()), STRATA_OK);
  EXPECT_EQ(strata_param_pin_wait_on(pin, foreign, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  strata_stream_t* consumer = nullptr;
  ASSERT_EQ(strata_stream_create(dev_, &consumer, e_.ptr()), STRATA_OK);
  ASSERT_EQ(strata_param_pin_wait_on(pin, consumer, e_.ptr()), STRATA_OK)
      << e_.str();
  ASSERT_EQ(strata_param_pin_wait_on(pin, consumer, e_.ptr()), STRATA_OK);
  EXPECT_EQ(strata_engine_destroy(eng_, e_.ptr()), STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_destroy: 1 pins are still live");
  EXPECT_EQ(strata_engine_step(eng_, kLr, 1.0, 0.0, nullptr, nullptr, nullptr,
                               e_.ptr()),
            STRATA_FAILED_PRECONDITION);
  EXPECT_MESSAGE_HAS(e_, "still pinned");
  EXPECT_EQ(strata_stream_destroy(consumer, e_.ptr()),
            STRATA_FAILED_PRECONDITION);
  EXPECT_EQ(strata_device_destroy(dev_, e_.ptr()), STRATA_FAILED_PRECONDITION);
  // Everything still works after the refusals.
  EXPECT_EQ(strata_param_pin_wait(pin, e_.ptr()), STRATA_OK) << e_.str();
  strata_param_pin_release(pin);
  EXPECT_EQ(strata_stream_destroy(consumer, e_.ptr()), STRATA_OK) << e_.str();

  // Gradients handed over by ownership are freed even when refused.
  EXPECT_EQ(strata_engine_add_grad_owned(eng_, 7, DeviceGrad(kW, 1.0f),
                                         STRATA_FLOAT32, stream_, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_add_grad_owned(eng_, w_, DeviceGrad(kW, 1.0f),
                                         STRATA_FLOAT32, foreign, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_add_grad_owned(eng_, w_, nullptr, STRATA_FLOAT32,
                                         stream_, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_add_grad(eng_, w_, strata_device_memory_data(g),
                                   STRATA_BLOCK8, stream_, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  strata_device_memory_free(g);
  EXPECT_EQ(strata_stream_destroy(foreign, e_.ptr()), STRATA_OK);
  EXPECT_EQ(strata_device_destroy(other, e_.ptr()), STRATA_OK);

  // NULL handles and out-pointers: an error, never a crash.
  EXPECT_EQ(strata_engine_fetch(nullptr, 0, &pin, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e_, "strata_engine_fetch: engine is NULL");
  EXPECT_EQ(strata_engine_fetch(eng_, 0, nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_start(nullptr, e_.ptr()), STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_read_master(eng_, w_, nullptr, kW, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_set_initial_values(eng_, w_, nullptr, kW, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_tensor_numel(eng_, w_, nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_add_grad(eng_, w_, nullptr, STRATA_FLOAT32, stream_,
                                   e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_add_grad(eng_, w_, buf.data(), STRATA_FLOAT32,
                                   nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_wait_grads(nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_step(nullptr, kLr, 1, 0, nullptr, nullptr, nullptr,
                               e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  char* json = nullptr;
  EXPECT_EQ(strata_engine_stats_json(nullptr, &json, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(json, nullptr);
  EXPECT_EQ(strata_engine_stats_json(eng_, nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  double scale = 0;
  EXPECT_EQ(strata_engine_loss_scale(nullptr, &scale, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_loss_scale(eng_, nullptr, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_param_pin_wait(nullptr, e_.ptr()), STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_param_pin_wait_on(nullptr, stream_, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_param_pin_data(nullptr), nullptr);
  EXPECT_EQ(strata_param_pin_bytes(nullptr), 0u);
  strata_param_pin_release(nullptr);
  EXPECT_EQ(strata_engine_num_tensors(nullptr), 0u);
  strata_engine_t* eng = nullptr;
  EXPECT_EQ(strata_engine_create(nullptr, dev_, &eng, e_.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_engine_destroy(nullptr, e_.ptr()), STRATA_OK);

  // A bad step argument leaves the engine usable.
  EXPECT_EQ(strata_engine_step(eng_, -1.0, 1.0, 0.0, nullptr, nullptr, nullptr,
                               e_.ptr()),
            STRATA_INVALID_ARGUMENT)
      << e_.str();
  MicroBatch(1.0f);
  int64_t step = 0;
  EXPECT_EQ(strata_engine_step(eng_, kLr, 1.0, 0.0, nullptr, nullptr, &step,
                               e_.ptr()),
            STRATA_OK)
      << e_.str();
  EXPECT_EQ(step, 1);
}

INSTANTIATE_TEST_SUITE_P(Tiers, CApiEngineTest, ::testing::Bool(),
                         [](const auto& p) {
                           return p.param ? "Nvme" : "Host";
                         });

// ---- The CPU optimizer ------------------------------------------------------

// An fp32 gradient's update arrays, without a working copy.
strata_cpu_tensors_t CTensors(size_t n, float* master, const float* grad,
                              void* exp_avg, void* exp_avg_sq,
                              strata_dtype_t moment_dtype) {
  strata_cpu_tensors_t t{};
  t.n = n;
  t.master = master;
  t.grad = grad;
  t.grad_dtype = STRATA_FLOAT32;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.moment_dtype = moment_dtype;
  return t;
}

TEST(CApiCpuOptimizerTest, MatchesTheCppOptimizerBitForBit) {
  CErr e;
  strata_cpu_optimizer_options_t* o = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_options_create(&o, e.ptr()), STRATA_OK);
  strata_cpu_optimizer_options_set_algo(o, STRATA_CPU_ADAMW);
  strata_cpu_optimizer_options_set_betas(o, 0.8, 0.99);
  strata_cpu_optimizer_options_set_eps(o, 1e-6);
  strata_cpu_optimizer_options_set_weight_decay(o, 0.1);
  strata_cpu_optimizer_options_set_bias_correction(o, 1);
  strata_cpu_optimizer_options_set_variant(o, STRATA_CPU_VARIANT_SCALAR);
  strata_cpu_optimizer_options_set_threads(o, 2);
  strata_cpu_optimizer_t* opt = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()), STRATA_OK)
      << e.str();
  strata_cpu_optimizer_options_destroy(o);
  EXPECT_STREQ(strata_cpu_optimizer_variant(opt), "scalar");
  EXPECT_EQ(strata_cpu_optimizer_threads(opt), 2);

  CpuOptimizerOptions co;
  co.beta1 = 0.8;
  co.beta2 = 0.99;
  co.eps = 1e-6;
  co.weight_decay = 0.1;
  co.variant = CpuKernelVariant::kScalar;
  co.threads = 2;
  auto ref = NewCpuOptimizer(co);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();

  constexpr size_t n = 5000;
  std::vector<float> master(n), grad(n), m(n, 0), v(n, 0);
  for (size_t i = 0; i < n; ++i) {
    master[i] = std::sin(float(i));
    grad[i] = std::cos(float(i) * 0.37f);
  }
  std::vector<float> rmaster = master, rm = m, rv = v;
  std::vector<uint16_t> working(n), rworking(n);
  const size_t state = strata_cpu_state_bytes(STRATA_BFLOAT16, n);
  EXPECT_EQ(state, CpuStateBytes(CpuDType::kBFloat16, n));
  std::vector<uint8_t> m16(state, 0), v16(state, 0), rm16 = m16, rv16 = v16;

  for (int64_t step = 1; step <= 4; ++step) {
    strata_cpu_tensors_t t = CTensors(n, master.data(), grad.data(), m16.data(),
                                      v16.data(), STRATA_BFLOAT16);
    t.working = working.data();
    t.working_dtype = STRATA_BFLOAT16;
    int applied = 0;
    ASSERT_EQ(strata_cpu_optimizer_step(opt, &t, step, 1e-2, 0.5, 0.9, 1,
                                        &applied, e.ptr()),
              STRATA_OK)
        << e.str();
    EXPECT_EQ(applied, 1);

    CpuOptimizerTensors rt;
    rt.n = n;
    rt.master = rmaster.data();
    rt.grad = grad.data();
    rt.exp_avg = rm16.data();
    rt.exp_avg_sq = rv16.data();
    rt.moment_dtype = CpuDType::kBFloat16;
    rt.working = rworking.data();
    rt.working_dtype = CpuDType::kBFloat16;
    CpuStepArgs a;
    a.step = step;
    a.lr = 1e-2;
    a.inv_loss_scale = 0.5;
    a.clip_coef = 0.9;
    ASSERT_TRUE((*ref)->Step(rt, a).ok());
  }
  EXPECT_EQ(0, std::memcmp(master.data(), rmaster.data(), n * 4));
  EXPECT_EQ(m16, rm16);
  EXPECT_EQ(v16, rv16);
  EXPECT_EQ(working, rworking);

  double sum_sq = 0;
  int finite = 0;
  ASSERT_EQ(strata_cpu_optimizer_grad_stats(opt, grad.data(), STRATA_FLOAT32, n,
                                            2.0, &sum_sq, &finite, e.ptr()),
            STRATA_OK)
      << e.str();
  auto rs = (*ref)->ComputeGradStats(grad.data(), CpuDType::kFloat32, n, 2.0);
  ASSERT_TRUE(rs.ok());
  EXPECT_EQ(sum_sq, rs->sum_sq);
  EXPECT_EQ(finite, 1);
  EXPECT_EQ(strata_cpu_optimizer_grad_stats(opt, grad.data(), STRATA_FLOAT32, n,
                                            1.0, nullptr, nullptr, e.ptr()),
            STRATA_OK);

  // An inf writes nothing and is not an error.
  grad[17] = INFINITY;
  const std::vector<float> before = master;
  strata_cpu_tensors_t t = CTensors(n, master.data(), grad.data(), m.data(),
                                    v.data(), STRATA_FLOAT32);
  int applied = 1;
  ASSERT_EQ(strata_cpu_optimizer_step(opt, &t, 5, 1e-2, 1.0, 1.0, 1, &applied,
                                      e.ptr()),
            STRATA_OK);
  EXPECT_EQ(applied, 0);
  EXPECT_EQ(master, before);
  ASSERT_EQ(strata_cpu_optimizer_grad_stats(opt, grad.data(), STRATA_FLOAT32, n,
                                            1.0, &sum_sq, &finite, e.ptr()),
            STRATA_OK);
  EXPECT_EQ(finite, 0);
  strata_cpu_optimizer_destroy(opt);
}

// One optimizer through the C API and its C++ twin, both given `t`'s arrays
// (the C++ one copies of them), stepped alike.
struct FactoredRun {
  std::vector<float> master, grad;
  std::vector<uint8_t> m, stats;
  std::vector<uint16_t> working;
};

FactoredRun NewFactoredRun(size_t rows, size_t cols,
                           const strata_cpu_step_footprint_t& f) {
  FactoredRun r;
  const size_t n = rows * cols;
  r.master.resize(n);
  r.grad.resize(n);
  for (size_t i = 0; i < n; ++i) {
    r.master[i] = 0.1f * std::sin(float(i) * 0.7f);
    r.grad[i] = std::cos(float(i) * 0.37f) * (1.0f + float(i % cols) / 8.0f);
  }
  r.m.assign(f.exp_avg_bytes, 0);
  r.stats.assign(f.exp_avg_sq_bytes, 0);
  r.working.assign(n, 0);
  return r;
}

// Adafactor (by name, with its setters, the weights' sum of squares
// carried) and SM3 (from a DeepSpeed section, bf16 momentum) over an odd
// matrix, through the C API and the C++ API: the same bits, the same
// results, the same footprint.
TEST(CApiCpuOptimizerTest, FactoredMatchTheCppOptimizerBitForBit) {
  constexpr size_t kMatRows = 37, kMatCols = 129, n = kMatRows * kMatCols;
  for (const bool sm3 : {false, true}) {
    SCOPED_TRACE(sm3 ? "sm3" : "adafactor");
    CErr e;
    strata_cpu_optimizer_options_t* o = nullptr;
    ASSERT_EQ(strata_cpu_optimizer_options_create(&o, e.ptr()), STRATA_OK);
    strata_cpu_optimizer_options_set_variant(o, STRATA_CPU_VARIANT_SCALAR);
    strata_cpu_optimizer_options_set_threads(o, 2);
    double lr = 1e-2;
    if (sm3) {
      const std::string json =
          R"({"type": "SM3", "params": {"lr": 0.05, "momentum": 0.8,)"
          R"( "eps": 1e-6, "weight_decay": 0.01}})";
      double got = 0;
      ASSERT_EQ(strata_cpu_optimizer_options_from_json(
                    o, json.data(), json.size(), &got, e.ptr()),
                STRATA_OK)
          << e.str();
      EXPECT_EQ(got, 0.05);
      lr = got;
    } else {
      ASSERT_EQ(
          strata_cpu_optimizer_options_set_algo_name(o, "AdaFactor", e.ptr()),
          STRATA_OK)
          << e.str();
      strata_cpu_optimizer_options_set_adafactor_eps(o, 1e-29, 2e-3);
      strata_cpu_optimizer_options_set_adafactor_clip_threshold(o, 0.5);
      strata_cpu_optimizer_options_set_adafactor_decay_rate(o, -0.7);
      strata_cpu_optimizer_options_set_adafactor_beta1(o, 0.9);
      strata_cpu_optimizer_options_set_adafactor_schedule(o, 1, 1, 0);
      strata_cpu_optimizer_options_set_weight_decay(o, 0.01);
    }
    strata_cpu_optimizer_t* opt = nullptr;
    ASSERT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()), STRATA_OK)
        << e.str();

    CpuOptimizerOptions co;
    co.variant = CpuKernelVariant::kScalar;
    co.threads = 2;
    co.weight_decay = 0.01;
    if (sm3) {
      co.algo = CpuOptimizerAlgo::kSm3;
      co.beta1 = 0.8;
      co.eps = 1e-6;
    } else {
      co.algo = CpuOptimizerAlgo::kAdafactor;
      co.adafactor.eps1 = 1e-29;
      co.adafactor.eps2 = 2e-3;
      co.adafactor.clip_threshold = 0.5;
      co.adafactor.decay_rate = -0.7;
      co.adafactor.beta1 = 0.9;
    }
    auto ref = NewCpuOptimizer(co);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();

    const CpuDType moment = sm3 ? CpuDType::kBFloat16 : CpuDType::kFloat32;
    strata_cpu_step_shape_t shape{};
    shape.n = n;
    shape.rows = kMatRows;
    shape.cols = kMatCols;
    shape.grad_dtype = STRATA_FLOAT32;
    shape.moment_dtype = sm3 ? STRATA_BFLOAT16 : STRATA_FLOAT32;
    shape.has_working = 1;
    shape.working_dtype = STRATA_BFLOAT16;
    shape.param_sq_known = sm3 ? 0 : 1;
    strata_cpu_step_footprint_t f{};
    ASSERT_EQ(strata_cpu_step_footprint_of(o, &shape, &f, e.ptr()), STRATA_OK)
        << e.str();
    strata_cpu_optimizer_options_destroy(o);
    CpuStepShape cs;
    cs.n = n;
    cs.rows = kMatRows;
    cs.cols = kMatCols;
    cs.moment_dtype = moment;
    cs.param_sq_known = !sm3;
    auto rf = CpuStepFootprintOf(co, cs);
    ASSERT_TRUE(rf.ok()) << rf.status().ToString();
    EXPECT_EQ(f.exp_avg_bytes, rf->exp_avg_bytes);
    EXPECT_EQ(f.exp_avg_sq_bytes, rf->exp_avg_sq_bytes);
    EXPECT_EQ(f.exp_avg_sq_bytes, (kMatRows + kMatCols) * sizeof(float));
    EXPECT_EQ(f.read_bytes, rf->read_bytes);
    EXPECT_EQ(f.written_bytes, rf->written_bytes);
    EXPECT_EQ(f.passes, rf->passes);
    EXPECT_EQ(f.passes, sm3 ? 1 : 2);

    FactoredRun c = NewFactoredRun(kMatRows, kMatCols, f), r = c;
    strata_cpu_step_args_t args = strata_cpu_step_args_default();
    EXPECT_EQ(args.step, 1);
    EXPECT_EQ(args.inv_loss_scale, 1.0);
    EXPECT_EQ(args.check_overflow, 1);
    EXPECT_LT(args.param_sq, 0.0);
    double ref_param_sq = -1.0;
    for (int64_t step = 1; step <= 4; ++step) {
      strata_cpu_tensors_t t =
          CTensors(n, c.master.data(), c.grad.data(), c.m.data(),
                   c.stats.data(), shape.moment_dtype);
      t.working = c.working.data();
      t.working_dtype = STRATA_BFLOAT16;
      args.step = step;
      args.lr = lr;
      args.inv_loss_scale = 0.5;
      strata_cpu_step_result_t res{};
      ASSERT_EQ(strata_cpu_optimizer_step_shaped(opt, &t, kMatRows, kMatCols,
                                                 &args, &res, e.ptr()),
                STRATA_OK)
          << e.str();

      CpuOptimizerTensors rt;
      rt.n = n;
      rt.rows = kMatRows;
      rt.cols = kMatCols;
      rt.master = r.master.data();
      rt.grad = r.grad.data();
      rt.exp_avg = r.m.data();
      rt.exp_avg_sq = r.stats.data();
      rt.moment_dtype = moment;
      rt.working = r.working.data();
      CpuStepArgs a;
      a.step = step;
      a.lr = lr;
      a.inv_loss_scale = 0.5;
      a.param_sq = ref_param_sq;
      auto rr = (*ref)->Step(rt, a);
      ASSERT_TRUE(rr.ok()) << rr.status().ToString();
      EXPECT_EQ(res.applied, 1);
      EXPECT_EQ(res.passes, rr->passes);
      EXPECT_EQ(res.param_sq, rr->param_sq);
      EXPECT_GE(res.pass_seconds[0], 0.0);
      if (sm3) {
        EXPECT_LT(res.param_sq, 0.0);
      } else {
        EXPECT_GT(res.param_sq, 0.0);
        args.param_sq = res.param_sq;  // carried, as a training loop would
        ref_param_sq = rr->param_sq;
      }
    }
    EXPECT_EQ(0, std::memcmp(c.master.data(), r.master.data(), n * 4));
    EXPECT_NE(c.master, NewFactoredRun(kMatRows, kMatCols, f).master);
    EXPECT_EQ(c.m, r.m);
    EXPECT_EQ(c.stats, r.stats);
    EXPECT_EQ(c.working, r.working);
    if (!sm3) {
      // The step uses the param_sq it is given, not its own sum: a wrong one
      // (100 times the weights' squares) moves the C and the C++ weights
      // alike, and away from a step that sums them.
      FactoredRun summed = r;
      for (FactoredRun* run : {&c, &r, &summed}) {
        const bool via_c = run == &c;
        const double param_sq = run == &summed ? -1.0 : 100.0 * ref_param_sq;
        if (via_c) {
          strata_cpu_tensors_t t =
              CTensors(n, run->master.data(), run->grad.data(), run->m.data(),
                       run->stats.data(), shape.moment_dtype);
          args.step = 5;
          args.param_sq = param_sq;
          ASSERT_EQ(strata_cpu_optimizer_step_shaped(
                        opt, &t, kMatRows, kMatCols, &args, nullptr, e.ptr()),
                    STRATA_OK)
              << e.str();
        } else {
          CpuOptimizerTensors rt;
          rt.n = n;
          rt.rows = kMatRows;
          rt.cols = kMatCols;
          rt.master = run->master.data();
          rt.grad = run->grad.data();
          rt.exp_avg = run->m.data();
          rt.exp_avg_sq = run->stats.data();
          CpuStepArgs a;
          a.step = 5;
          a.lr = lr;
          a.inv_loss_scale = 0.5;
          a.param_sq = param_sq;
          ASSERT_TRUE((*ref)->Step(rt, a).ok());
        }
      }
      EXPECT_EQ(0, std::memcmp(c.master.data(), r.master.data(), n * 4));
      EXPECT_NE(c.master, summed.master);
    }

    // A null result is allowed; an inf is not an error and writes nothing.
    c.grad[40] = INFINITY;
    const std::vector<float> before = c.master;
    strata_cpu_tensors_t t =
        CTensors(n, c.master.data(), c.grad.data(), c.m.data(), c.stats.data(),
                 shape.moment_dtype);
    ASSERT_EQ(strata_cpu_optimizer_step_shaped(opt, &t, kMatRows, kMatCols,
                                               &args, nullptr, e.ptr()),
              STRATA_OK)
        << e.str();
    strata_cpu_step_result_t res{};
    res.applied = 1;
    ASSERT_EQ(strata_cpu_optimizer_step_shaped(opt, &t, kMatRows, kMatCols,
                                               &args, &res, e.ptr()),
              STRATA_OK);
    EXPECT_EQ(res.applied, 0);
    EXPECT_EQ(res.passes, 0);
    EXPECT_LT(res.param_sq, 0.0);
    EXPECT_EQ(c.master, before);
    strata_cpu_optimizer_destroy(opt);
  }
}

// The shaped step of the Adam family ignores the shape: the same bits as
// strata_cpu_optimizer_step.
TEST(CApiCpuOptimizerTest, ShapedStepOfAdamWIsTheFlatStep) {
  CErr e;
  strata_cpu_optimizer_t* opt = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_create(nullptr, &opt, e.ptr()), STRATA_OK);
  constexpr size_t n = 6 * 50;
  std::vector<float> m1(n), g(n), a1(n, 0), v1(n, 0);
  for (size_t i = 0; i < n; ++i) {
    m1[i] = std::sin(float(i));
    g[i] = std::cos(float(i) * 0.3f);
  }
  std::vector<float> m2 = m1, a2 = a1, v2 = v1;
  for (int64_t step = 1; step <= 3; ++step) {
    strata_cpu_tensors_t t1 =
        CTensors(n, m1.data(), g.data(), a1.data(), v1.data(), STRATA_FLOAT32);
    strata_cpu_tensors_t t2 =
        CTensors(n, m2.data(), g.data(), a2.data(), v2.data(), STRATA_FLOAT32);
    int applied = 0;
    ASSERT_EQ(strata_cpu_optimizer_step(opt, &t1, step, 1e-2, 1.0, 1.0, 1,
                                        &applied, e.ptr()),
              STRATA_OK);
    strata_cpu_step_args_t args = strata_cpu_step_args_default();
    args.step = step;
    args.lr = 1e-2;
    strata_cpu_step_result_t res{};
    ASSERT_EQ(
        strata_cpu_optimizer_step_shaped(opt, &t2, 6, 50, &args, &res, e.ptr()),
        STRATA_OK)
        << e.str();
    EXPECT_EQ(res.applied, 1);
    EXPECT_EQ(res.passes, 1);
  }
  EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), n * 4));
  EXPECT_EQ(a1, a2);
  EXPECT_EQ(v1, v2);
  strata_cpu_optimizer_destroy(opt);
}

TEST(CApiCpuOptimizerTest, FactoredBadArguments) {
  CErr e;
  strata_cpu_optimizer_options_t* o = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_options_create(&o, e.ptr()), STRATA_OK);
  // By name: an unknown name leaves the algorithm as it was.
  ASSERT_EQ(strata_cpu_optimizer_options_set_algo_name(o, "sm3", e.ptr()),
            STRATA_OK);
  EXPECT_EQ(strata_cpu_optimizer_options_set_algo_name(o, "adamax", e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "strata_cpu_optimizer_options_set_algo_name");
  EXPECT_MESSAGE_HAS(e, "'adamax'");
  EXPECT_MESSAGE_HAS(e, "adafactor or sm3");
  EXPECT_EQ(strata_cpu_optimizer_options_set_algo_name(o, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "name is NULL");
  EXPECT_EQ(
      strata_cpu_optimizer_options_set_algo_name(nullptr, "adam", e.ptr()),
      STRATA_INVALID_ARGUMENT);
  // From JSON: the path at fault, and the options left as they were.
  const std::string bad =
      R"({"type": "Adafactor", "params": {"clip_threshold": -1}})";
  double lr = 7.0;
  EXPECT_EQ(strata_cpu_optimizer_options_from_json(o, bad.data(), bad.size(),
                                                   &lr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "optimizer.params.clip_threshold");
  EXPECT_EQ(lr, 7.0);
  const std::string typo = R"({"type": "Adafactor", "params": {"beta": 0}})";
  EXPECT_EQ(strata_cpu_optimizer_options_from_json(o, typo.data(), typo.size(),
                                                   nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "optimizer.params.beta");
  EXPECT_EQ(strata_cpu_optimizer_options_from_json(o, "{", 1, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(
      strata_cpu_optimizer_options_from_json(o, nullptr, 4, nullptr, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "json is NULL");
  strata_cpu_optimizer_t* opt = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()), STRATA_OK)
      << e.str();  // still SM3, with the defaults
  strata_cpu_optimizer_destroy(opt);
  opt = nullptr;

  // Adafactor's values are checked at create.
  strata_cpu_optimizer_options_set_algo(o, STRATA_CPU_ADAFACTOR);
  strata_cpu_optimizer_options_set_adafactor_clip_threshold(o, 0.0);
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "clip_threshold");
  EXPECT_EQ(opt, nullptr);
  strata_cpu_optimizer_options_set_adafactor_clip_threshold(o, 1.0);
  strata_cpu_optimizer_options_set_adafactor_decay_rate(o, 0.5);
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "decay_rate");
  strata_cpu_optimizer_options_set_adafactor_decay_rate(o, -0.8);
  strata_cpu_optimizer_options_set_algo(o, static_cast<strata_cpu_algo_t>(6));
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "algo 6");
  strata_cpu_optimizer_options_set_algo(o, STRATA_CPU_ADAFACTOR);
  strata_cpu_optimizer_options_set_adafactor_eps(nullptr, 1, 1);  // ignored
  strata_cpu_optimizer_options_set_adafactor_schedule(nullptr, 0, 0, 0);

  // The footprint: a shape that does not match n, a refused moment type.
  strata_cpu_step_shape_t shape{};
  shape.n = 12;
  shape.rows = 5;
  shape.cols = 3;
  shape.grad_dtype = STRATA_FLOAT32;
  shape.moment_dtype = STRATA_FLOAT32;
  strata_cpu_step_footprint_t f{};
  EXPECT_EQ(strata_cpu_step_footprint_of(o, &shape, &f, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  shape.rows = 4;
  shape.moment_dtype = STRATA_BLOCK8;
  EXPECT_EQ(strata_cpu_step_footprint_of(o, &shape, &f, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  shape.moment_dtype = static_cast<strata_dtype_t>(9);
  EXPECT_EQ(strata_cpu_step_footprint_of(o, &shape, &f, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "dtype 9");
  shape.moment_dtype = STRATA_FLOAT32;
  EXPECT_EQ(strata_cpu_step_footprint_of(o, nullptr, &f, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_cpu_step_footprint_of(o, &shape, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  ASSERT_EQ(strata_cpu_step_footprint_of(o, &shape, &f, e.ptr()), STRATA_OK)
      << e.str();
  EXPECT_EQ(f.exp_avg_sq_bytes, (4u + 3u) * sizeof(float));
  EXPECT_EQ(f.exp_avg_bytes, 0u);  // no first moment

  // The shaped step: its shape, its args, the state it needs.
  ASSERT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()), STRATA_OK);
  strata_cpu_optimizer_options_destroy(o);
  float master[12] = {0}, grad[12] = {0}, stats[7] = {0};
  strata_cpu_tensors_t t =
      CTensors(12, master, grad, nullptr, stats, STRATA_FLOAT32);
  strata_cpu_step_args_t args = strata_cpu_step_args_default();
  EXPECT_EQ(
      strata_cpu_optimizer_step_shaped(opt, &t, 5, 3, &args, nullptr, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_cpu_optimizer_step_shaped(opt, &t, 4, 3, nullptr, nullptr,
                                             e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "strata_cpu_optimizer_step_shaped: args is NULL");
  EXPECT_EQ(strata_cpu_optimizer_step_shaped(nullptr, &t, 4, 3, &args, nullptr,
                                             e.ptr()),
            STRATA_INVALID_ARGUMENT);
  args.param_sq = NAN;
  EXPECT_EQ(
      strata_cpu_optimizer_step_shaped(opt, &t, 4, 3, &args, nullptr, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  args.param_sq = -1.0;
  t.exp_avg_sq = nullptr;
  EXPECT_EQ(
      strata_cpu_optimizer_step_shaped(opt, &t, 4, 3, &args, nullptr, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  t.exp_avg_sq = stats;
  strata_cpu_step_result_t res{};
  ASSERT_EQ(
      strata_cpu_optimizer_step_shaped(opt, &t, 4, 3, &args, &res, e.ptr()),
      STRATA_OK)
      << e.str();
  EXPECT_EQ(res.applied, 1);
  EXPECT_EQ(res.passes, 2);
  strata_cpu_optimizer_destroy(opt);
}

TEST(CApiCpuOptimizerTest, BadArguments) {
  CErr e;
  strata_cpu_optimizer_t* opt = nullptr;
  strata_cpu_optimizer_options_t* o = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_options_create(&o, e.ptr()), STRATA_OK);
  strata_cpu_optimizer_options_set_betas(o, 1.5, 0.999);
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "betas must be in [0, 1)");
  EXPECT_EQ(opt, nullptr);
  strata_cpu_optimizer_options_set_betas(o, 0.9, 0.999);
  strata_cpu_optimizer_options_set_algo(o, static_cast<strata_cpu_algo_t>(9));
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "algo 9");
  strata_cpu_optimizer_options_set_algo(o, STRATA_CPU_LION);
  strata_cpu_optimizer_options_set_variant(
      o, static_cast<strata_cpu_variant_t>(12));
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  strata_cpu_optimizer_options_set_variant(o, STRATA_CPU_VARIANT_AUTO);
  strata_cpu_optimizer_options_set_threads(o, -1);
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  strata_cpu_optimizer_options_set_threads(o, 1);
  strata_cpu_optimizer_options_set_block8_sweeps(o, 3);
  EXPECT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "block8_sweeps");
  strata_cpu_optimizer_options_set_block8_sweeps(o, 2);
  ASSERT_EQ(strata_cpu_optimizer_create(o, &opt, e.ptr()), STRATA_OK)
      << e.str();
  strata_cpu_optimizer_destroy(opt);
  opt = nullptr;
  strata_cpu_optimizer_options_set_block8_sweeps(nullptr, 1);  // ignored
  strata_cpu_optimizer_options_destroy(o);
  strata_cpu_optimizer_options_destroy(nullptr);
  strata_cpu_optimizer_options_set_eps(nullptr, 1.0);  // ignored
  EXPECT_EQ(strata_cpu_optimizer_options_create(nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_cpu_optimizer_create(nullptr, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);

  ASSERT_EQ(strata_cpu_optimizer_create(nullptr, &opt, e.ptr()), STRATA_OK)
      << e.str();
  float master[4] = {0}, grad[4] = {0}, m[4] = {0}, v[4] = {0};
  strata_cpu_tensors_t t = CTensors(4, master, grad, m, v, STRATA_FLOAT32);
  int applied = 0;
  EXPECT_EQ(strata_cpu_optimizer_step(opt, nullptr, 1, 1e-3, 1, 1, 1, &applied,
                                      e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_cpu_optimizer_step(nullptr, &t, 1, 1e-3, 1, 1, 1, &applied,
                                      e.ptr()),
            STRATA_INVALID_ARGUMENT);
  t.grad_dtype = static_cast<strata_dtype_t>(42);
  EXPECT_EQ(
      strata_cpu_optimizer_step(opt, &t, 1, 1e-3, 1, 1, 1, &applied, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS(e, "dtype 42");
  t.grad_dtype = STRATA_FLOAT32;
  t.master = nullptr;
  EXPECT_EQ(
      strata_cpu_optimizer_step(opt, &t, 1, 1e-3, 1, 1, 1, &applied, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  t.master = master;
  EXPECT_EQ(
      strata_cpu_optimizer_step(opt, &t, 1, NAN, 1, 1, 1, &applied, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_cpu_optimizer_grad_stats(nullptr, grad, STRATA_FLOAT32, 4, 1,
                                            nullptr, nullptr, e.ptr()),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_cpu_optimizer_variant(nullptr), nullptr);
  EXPECT_EQ(strata_cpu_optimizer_threads(nullptr), 0);
  strata_cpu_optimizer_destroy(opt);
  strata_cpu_optimizer_destroy(nullptr);

  EXPECT_EQ(strata_cpu_state_bytes(static_cast<strata_dtype_t>(8), 10), 0u);
  EXPECT_EQ(strata_cpu_state_bytes(STRATA_FLOAT32, 10), 40u);
  float f[3] = {1.0f, -2.5f, 3.0f}, back[3] = {0};
  uint16_t h[3];
  ASSERT_EQ(strata_convert(f, STRATA_FLOAT32, h, STRATA_FLOAT16, 3, e.ptr()),
            STRATA_OK);
  ASSERT_EQ(strata_convert(h, STRATA_FLOAT16, back, STRATA_FLOAT32, 3, e.ptr()),
            STRATA_OK);
  EXPECT_EQ(0, std::memcmp(f, back, sizeof f));
  EXPECT_EQ(
      strata_convert(nullptr, STRATA_FLOAT32, h, STRATA_FLOAT16, 3, e.ptr()),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_convert(f, STRATA_FLOAT32, h, static_cast<strata_dtype_t>(5),
                           3, e.ptr()),
            STRATA_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace strata
