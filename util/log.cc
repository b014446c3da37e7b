#include "util/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "strata/config.h"

namespace strata {
namespace {

spdlog::level::level_enum FromEnv() {
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  if (env == nullptr) return spdlog::level::info;
  const std::string v(env);
  if (v == "trace") return spdlog::level::trace;
  if (v == "debug") return spdlog::level::debug;
  if (v == "warn" || v == "warning") return spdlog::level::warn;
  if (v == "error") return spdlog::level::err;
  if (v == "off") return spdlog::level::off;
  return spdlog::level::info;
}

}  // namespace

namespace internal {

spdlog::logger& Logger() {
  // Built on first use; never destroyed, so logging from static destructors
  // of other objects stays safe.
  static spdlog::logger* logger = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    auto* l = new spdlog::logger("strata", std::move(sink));
    l->set_pattern("[strata %L %H:%M:%S.%e] %v");
    l->set_level(FromEnv());
    return l;
  }();
  return *logger;
}

}  // namespace internal

void SetLogLevel(LogLevel level) {
  static constexpr spdlog::level::level_enum kMap[] = {
      spdlog::level::trace, spdlog::level::debug, spdlog::level::info,
      spdlog::level::warn,  spdlog::level::err,   spdlog::level::off};
  internal::Logger().set_level(kMap[static_cast<int>(level)]);
}

LogLevel GetLogLevel() {
  switch (internal::Logger().level()) {
    case spdlog::level::trace:
      return LogLevel::kTrace;
    case spdlog::level::debug:
      return LogLevel::kDebug;
    case spdlog::level::info:
      return LogLevel::kInfo;
    case spdlog::level::warn:
      return LogLevel::kWarn;
    case spdlog::level::err:
    case spdlog::level::critical:
      return LogLevel::kError;
    default:
      return LogLevel::kOff;
  }
}

std::string_view Version() { return STRATA_VERSION_STRING; }

}  // namespace strata
