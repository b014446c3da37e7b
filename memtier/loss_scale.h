// The loss scale of mixed-precision training, owned by the engine
// (EngineOptions::loss_scale). fp16 gradients underflow unless the loss is
// multiplied before backward; the engine divides the gradients by the same
// scale before the update and skips a step whose gradient overflowed.
//
// kDynamic follows DeepSpeed's rules, so a run moved from DeepSpeed sees the
// same scales: an overflow uses up one unit of hysteresis and, when none is
// left, halves the scale (never below min_scale) and restores the
// hysteresis; `window` good steps in a row double it; with
// consecutive_hysteresis every good step restores the hysteresis. kStatic
// keeps initial_scale and kNone keeps 1.
//
// Pure bookkeeping; thread-compatible (the engine holds its lock).
#ifndef STRATA_MEMTIER_LOSS_SCALE_H_
#define STRATA_MEMTIER_LOSS_SCALE_H_

#include <cstdint>
#include <string>

#include "strata/engine_options.h"
#include "strata/status.h"

namespace strata::memtier {

class LossScaler {
 public:
  // `o` has been validated (memtier/config.cc).
  explicit LossScaler(const LossScaleOptions& o);

  // The scale the next step's loss is to be multiplied by.
  double scale() const { return scale_; }
  // After a step: `overflow` when its gradient was not finite.
  void Update(bool overflow);

  // What a checkpoint keeps ("scale", "hysteresis", "good"), as JSON text.
  std::string Save() const;
  // Restores Save()'s text. Only a dynamic scale moves, so only a dynamic
  // scaler takes it; the others keep their fixed scale. kCorruption naming
  // `where` when the text is not a scaler's state or is out of range.
  Status Load(const std::string& text, const std::string& where);

 private:
  LossScaleOptions o_;
  double scale_;
  uint32_t hysteresis_;  // overflows still absorbed before the next halving
  uint64_t good_ = 0;    // good steps since the last overflow
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_LOSS_SCALE_H_
