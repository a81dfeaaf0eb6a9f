#include "pipeline/family.h"

#include <utility>

namespace apus {

FamilyDescriptor sa3_family();    // pipeline/sa3/family.cpp
FamilyDescriptor klein_family();  // pipeline/klein/family.cpp

namespace {

std::vector<FamilyDescriptor>& table() {
  // Stable Audio 3 first: its files are told by one key or a GGUF architecture, klein's by the
  // tensor names of a FLUX.2 transformer.
  static std::vector<FamilyDescriptor> all = {sa3_family(), klein_family()};
  return all;
}

}  // namespace

const std::vector<FamilyDescriptor>& families() { return table(); }

void add_family(FamilyDescriptor family) { table().push_back(std::move(family)); }

}  // namespace apus
