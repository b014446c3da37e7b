// The library's version at run time, callable from C.
#ifndef STRATA_VERSION_H_
#define STRATA_VERSION_H_

#include "strata/config.h"
#include "strata/export.h"

#ifdef __cplusplus
extern "C" {
#endif

// "MAJOR.MINOR.PATCH" of the library actually loaded (which may differ from
// STRATA_VERSION_STRING, the version of the headers compiled against).
STRATA_EXPORT const char* strata_version(void);

#ifdef __cplusplus
}
#endif

#endif  // STRATA_VERSION_H_
