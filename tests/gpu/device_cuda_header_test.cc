// strata/device_cuda.h, the optional typed CUDA helpers: they refuse what is
// not CUDA's (checked here on the host-emulated device, so this runs without
// a GPU), and on a GPU they wrap streams and memory that only the CUDA
// runtime made, as a trainer's are (skipped without one; a failure under
// STRATA_REQUIRE_CUDA=1).
#include "strata/device_cuda.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace strata {
namespace {

TEST(DeviceCudaHeaderTest, HelpersRefuseOtherBackends) {
  auto d = NewHostEmulatedDevice({});
  ASSERT_TRUE(d.ok());
  auto s = (*d)->NewStream({});
  auto e = (*d)->NewEvent();
  ASSERT_TRUE(s.ok() && e.ok());
  EXPECT_EQ(CudaStreamOf(**s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaEventOf(**e).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WrapCudaStream(**d, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

// A trainer's stream and tensor: made with the CUDA runtime, not strata.
TEST(DeviceCudaHeaderTest, WrapsATrainersStreamAndMemory) {
  DeviceOptions o;
  o.memory_budget_bytes = 16 << 20;
  auto d = NewCudaDevice(o);
  const char* required = getenv("STRATA_REQUIRE_CUDA");
  if (!d.ok() && (required == nullptr || std::string(required) != "1")) {
    GTEST_SKIP() << "CUDA backend unavailable: " << d.status().ToString();
  }
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  Device& device = **d;

  auto own = device.NewStream({});
  ASSERT_TRUE(own.ok());
  auto native = CudaStreamOf(**own);
  ASSERT_TRUE(native.ok());
  EXPECT_EQ(static_cast<void*>(*native), (*own)->native_handle());
  EXPECT_EQ(WrapCudaStream(device, cudaStreamPerThread).status().code(),
            StatusCode::kInvalidArgument);
  auto legacy = WrapCudaStream(device, nullptr);
  ASSERT_TRUE(legacy.ok()) << legacy.status().ToString();

  cudaStream_t trainer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking),
            cudaSuccess);
  const size_t n = 1 << 20;
  void* tensor = nullptr;
  ASSERT_EQ(cudaMalloc(&tensor, n), cudaSuccess);
  {
    auto s = WrapCudaStream(device, trainer, StreamKind::kCopy);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(*CudaStreamOf(**s), trainer);
    auto ext = device.RegisterExternalMemory(tensor, n);
    ASSERT_TRUE(ext.ok()) << ext.status().ToString();
    EXPECT_EQ(device.RegisterExternalMemory(tensor, n + 1).status().code(),
              StatusCode::kInvalidArgument);
    auto in = device.AllocatePinnedHost(n, {});
    auto out = device.AllocatePinnedHost(n, {});
    ASSERT_TRUE(in.ok() && out.ok());
    std::memset(in->data(), 0x3c, n);
    std::memset(out->data(), 0, n);
    // The copy in waits for host work, signalled after it is enqueued.
    auto he = device.NewHostEvent();
    ASSERT_TRUE(he.ok()) << he.status().ToString();
    ASSERT_TRUE(device.WaitHostEvent(**s, **he, 1).ok());
    ASSERT_TRUE(
        device
            .CopyAsync(**s, ext->data(), in->data(), n, CopyKind::kHostToDevice)
            .ok());
    auto copied = device.NewEvent();
    ASSERT_TRUE(copied.ok());
    ASSERT_TRUE(device.RecordEvent(**copied, **s).ok());
    std::memset(in->data(), 0x5a, n);
    (*he)->Signal(1);
    // The trainer orders its own stream after strata's event.
    auto ev = CudaEventOf(**copied);
    ASSERT_TRUE(ev.ok());
    ASSERT_EQ(cudaStreamWaitEvent(trainer, *ev, 0), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(out->data(), tensor, n, cudaMemcpyDeviceToHost,
                              trainer),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(trainer), cudaSuccess);
    std::vector<std::byte> want(n, std::byte{0x5a});
    EXPECT_EQ(std::memcmp(out->data(), want.data(), n), 0);
  }
  EXPECT_EQ(cudaStreamSynchronize(trainer), cudaSuccess)
      << "the wrapper destroyed the trainer's stream";
  EXPECT_EQ(cudaStreamDestroy(trainer), cudaSuccess);
  EXPECT_EQ(cudaFree(tensor), cudaSuccess);
}

}  // namespace
}  // namespace strata
