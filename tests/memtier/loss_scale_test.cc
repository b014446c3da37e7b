// The engine's loss scale follows DeepSpeed's dynamic rules (so a run moved
// from DeepSpeed sees the same scales) and survives a save and load.
#include "memtier/loss_scale.h"

#include <gtest/gtest.h>

#include <string>

namespace strata::memtier {
namespace {

LossScaleOptions Dynamic(double initial, uint32_t window, uint32_t hysteresis,
                         double min_scale) {
  LossScaleOptions o;
  o.mode = LossScaleMode::kDynamic;
  o.initial_scale = initial;
  o.window = window;
  o.hysteresis = hysteresis;
  o.min_scale = min_scale;
  return o;
}

TEST(LossScaler, NoneAndStaticNeverMove) {
  LossScaleOptions o;
  o.initial_scale = 512;
  LossScaler none(o);
  o.mode = LossScaleMode::kStatic;
  LossScaler fixed(o);
  for (bool overflow : {true, true, false, true, false, false}) {
    none.Update(overflow);
    fixed.Update(overflow);
  }
  EXPECT_EQ(none.scale(), 1.0);
  EXPECT_EQ(fixed.scale(), 512.0);
}

TEST(LossScaler, HysteresisAbsorbsOverflowsBeforeHalving) {
  LossScaler s(Dynamic(1024, 1000, 2, 1));
  s.Update(true);
  EXPECT_EQ(s.scale(), 1024.0);  // one overflow absorbed
  s.Update(true);
  EXPECT_EQ(s.scale(), 512.0);  // halved, hysteresis restored
  s.Update(true);
  EXPECT_EQ(s.scale(), 512.0);
  s.Update(false);  // a good step does not restore it by default
  s.Update(true);
  EXPECT_EQ(s.scale(), 256.0);
}

TEST(LossScaler, ConsecutiveHysteresisRestoresOnEveryGoodStep) {
  LossScaleOptions o = Dynamic(1024, 1000, 2, 1);
  o.consecutive_hysteresis = true;
  LossScaler s(o);
  s.Update(true);
  s.Update(false);
  s.Update(true);
  EXPECT_EQ(s.scale(), 1024.0);
  s.Update(true);
  EXPECT_EQ(s.scale(), 512.0);
}

TEST(LossScaler, WindowDoublesAndMinScaleFloors) {
  LossScaler s(Dynamic(8, 3, 1, 4));
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 8.0);
  s.Update(false);
  EXPECT_EQ(s.scale(), 16.0);
  s.Update(false);
  s.Update(true);  // restarts the window
  EXPECT_EQ(s.scale(), 8.0);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 8.0);
  s.Update(true);
  s.Update(true);
  s.Update(true);
  EXPECT_EQ(s.scale(), 4.0);
}

TEST(LossScaler, LoadResumesWhereSaveLeftOff) {
  const LossScaleOptions o = Dynamic(1024, 2, 2, 1);
  LossScaler a(o);
  a.Update(false);
  a.Update(false);  // 2048
  a.Update(true);   // hysteresis 1
  a.Update(false);  // one good step in the window
  LossScaler b(o);
  ASSERT_TRUE(b.Load(a.Save(), "ckpt").ok());
  EXPECT_EQ(b.scale(), 2048.0);
  for (bool overflow : {false, true, false, false, true}) {
    a.Update(overflow);
    b.Update(overflow);
    EXPECT_EQ(a.scale(), b.scale());
  }
}

TEST(LossScaler, OnlyADynamicScaleLoadsAndBadStateIsRefused) {
  LossScaler dyn(Dynamic(1024, 1, 1, 1));
  dyn.Update(false);
  LossScaleOptions o;
  o.mode = LossScaleMode::kStatic;
  o.initial_scale = 64;
  LossScaler fixed(o);
  ASSERT_TRUE(fixed.Load(dyn.Save(), "ckpt").ok());
  EXPECT_EQ(fixed.scale(), 64.0);

  LossScaler s(Dynamic(1024, 1, 1, 1));
  for (const char* bad : {"", "[]", R"({"scale": 2})",
                          R"({"scale": 0, "hysteresis": 1, "good": 0})",
                          R"({"scale": 2, "hysteresis": 0, "good": 0})",
                          R"({"scale": 2, "hysteresis": 1, "good": -1})",
                          R"({"scale": "2", "hysteresis": 1, "good": 0})"}) {
    Status st = s.Load(bad, "ckpt/blob");
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << bad;
    EXPECT_NE(st.message().find("ckpt/blob"), std::string::npos) << bad;
  }
  EXPECT_EQ(s.scale(), 1024.0);
}

}  // namespace
}  // namespace strata::memtier
