#include "strata/version.h"

extern "C" const char* strata_version(void) { return STRATA_VERSION_STRING; }
