// Helpers shared by the engine tests.
#ifndef STRATA_TESTS_MEMTIER_ENGINE_TEST_UTIL_H_
#define STRATA_TESTS_MEMTIER_ENGINE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <memory>

#include "strata/device.h"

namespace strata::testing {

// The host-emulated device with a 64 MiB budget, where every engine test
// runs.
inline std::unique_ptr<Device> HostDevice() {
  DeviceOptions o;
  o.choice = DeviceChoice::kHostEmulated;
  o.memory_budget_bytes = 64 << 20;
  auto d = NewHostEmulatedDevice(o);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return std::move(d).value();
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_MEMTIER_ENGINE_TEST_UTIL_H_
