#include "apus/apus.h"

namespace apus {

// APUS_VERSION is the project's version, defined for this file alone (CMakeLists.txt).
const char* version() { return APUS_VERSION; }

}  // namespace apus
