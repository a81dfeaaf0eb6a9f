#pragma once
// apus's own cache (calibrations, synthetic checkpoints): $APUS_CACHE_DIR, else
// $XDG_CACHE_HOME/apus, else ~/.cache/apus.
#include <string>

namespace apus {

std::string apus_cache_dir();

}  // namespace apus
