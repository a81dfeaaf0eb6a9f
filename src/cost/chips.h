#pragma once
// Datasheet rates of the chips the roofline prices against (sources in docs/ROOFLINE.md).
#include <string>
#include <vector>

namespace apus {

struct Chip {
  std::string name;
  double bf16_flops;  // dense bf16 FLOP/s
  double int8_ops;    // dense int8 OP/s (0 where the chip has no such path)
  double fp8_flops;   // dense fp8 FLOP/s (0 where absent)
  double memory_bps;  // memory bandwidth, bytes/s
  double link_bps;    // one-direction chip-to-chip bandwidth, bytes/s
  std::string note;
};

const std::vector<Chip>& chip_table();
// Throws apus::Error listing the known names.
const Chip& find_chip(const std::string& name);

}  // namespace apus
