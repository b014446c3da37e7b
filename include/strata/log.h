// strata's diagnostics go to stderr through one logger named "strata".
// The level comes from STRATA_LOG_LEVEL (trace, debug, info, warn, error, off;
// default info) unless SetLogLevel is called. Thread-safe.
#ifndef STRATA_LOG_H_
#define STRATA_LOG_H_

#include <string_view>

#include "strata/export.h"

namespace strata {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };

STRATA_EXPORT void SetLogLevel(LogLevel level);
STRATA_EXPORT LogLevel GetLogLevel();

// The library version, "MAJOR.MINOR.PATCH".
STRATA_EXPORT std::string_view Version();

}  // namespace strata

#endif  // STRATA_LOG_H_
