#include "memtier/loss_scale.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

namespace strata::memtier {

LossScaler::LossScaler(const LossScaleOptions& o)
    : o_(o),
      scale_(o.mode == LossScaleMode::kNone ? 1.0 : o.initial_scale),
      hysteresis_(o.hysteresis) {}

void LossScaler::Update(bool overflow) {
  if (o_.mode != LossScaleMode::kDynamic) return;
  if (overflow) {
    good_ = 0;
    if (--hysteresis_ > 0) return;
    scale_ = std::max(o_.min_scale, scale_ / 2);
    hysteresis_ = o_.hysteresis;
    return;
  }
  if (o_.consecutive_hysteresis) hysteresis_ = o_.hysteresis;
  if (++good_ % o_.window == 0) scale_ *= 2;
}

std::string LossScaler::Save() const {
  return nlohmann::json{
      {"scale", scale_}, {"hysteresis", hysteresis_}, {"good", good_}}
      .dump();
}

Status LossScaler::Load(const std::string& text, const std::string& where) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  const auto bad = [&] {
    return Status::Corruption(where +
                              ": the loss scale's state is not valid: " + text);
  };
  if (j.is_discarded() || !j.is_object() || !j.contains("scale") ||
      !j["scale"].is_number() || !j.contains("hysteresis") ||
      !j["hysteresis"].is_number_unsigned() || !j.contains("good") ||
      !j["good"].is_number_unsigned()) {
    return bad();
  }
  const double scale = j["scale"].get<double>();
  const uint64_t hysteresis = j["hysteresis"].get<uint64_t>();
  if (!(scale > 0) || !std::isfinite(scale) || hysteresis == 0 ||
      hysteresis > UINT32_MAX) {
    return bad();
  }
  if (o_.mode != LossScaleMode::kDynamic) return Status::Ok();
  scale_ = scale;
  // A checkpoint of a run with a larger hysteresis resumes within this one's.
  hysteresis_ =
      static_cast<uint32_t>(std::min<uint64_t>(hysteresis, o_.hysteresis));
  good_ = j["good"].get<uint64_t>();
  return Status::Ok();
}

}  // namespace strata::memtier
