#include "pipeline/family.h"

namespace apus {

FamilyDescriptor sa3_family();    // pipeline/sa3/family.cpp
FamilyDescriptor klein_family();  // pipeline/klein/family.cpp

const std::vector<FamilyDescriptor>& families() {
  // Stable Audio 3 first: its files are told by one key or a GGUF architecture, klein's by the
  // tensor names of a FLUX.2 transformer.
  static const std::vector<FamilyDescriptor> all = {sa3_family(), klein_family()};
  return all;
}

}  // namespace apus
