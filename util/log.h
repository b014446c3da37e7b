// Internal logging: fmt-style macros over the shared "strata" spdlog logger.
// STRATA_LOG_ONCE logs at most once per call site per process, for fallbacks
// that would otherwise repeat on every request (the reason is said once).
#ifndef STRATA_UTIL_LOG_H_
#define STRATA_UTIL_LOG_H_

#include <spdlog/logger.h>

#include <atomic>

#include "strata/log.h"

namespace strata::internal {
spdlog::logger& Logger();
}  // namespace strata::internal

#define STRATA_LOG_TRACE(...) ::strata::internal::Logger().trace(__VA_ARGS__)
#define STRATA_LOG_DEBUG(...) ::strata::internal::Logger().debug(__VA_ARGS__)
#define STRATA_LOG_INFO(...) ::strata::internal::Logger().info(__VA_ARGS__)
#define STRATA_LOG_WARN(...) ::strata::internal::Logger().warn(__VA_ARGS__)
#define STRATA_LOG_ERROR(...) ::strata::internal::Logger().error(__VA_ARGS__)

#define STRATA_LOG_ONCE(level, ...)                      \
  do {                                                   \
    static std::atomic<bool> strata_logged_once_{false}; \
    if (!strata_logged_once_.exchange(true)) {           \
      STRATA_LOG_##level(__VA_ARGS__);                   \
    }                                                    \
  } while (0)

#endif  // STRATA_UTIL_LOG_H_
