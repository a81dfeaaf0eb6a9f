#include "cost/chips.h"

#include "core/error.h"

namespace apus {

const std::vector<Chip>& chip_table() {
  constexpr double T = 1e12, G = 1e9;
  static const std::vector<Chip> chips = {
      {"v6e", 918 * T, 1836 * T, 0, 1640 * G, 448 * G / 2,
       "Cloud TPU v6e (Trillium): ICI 3584 Gbit/s per chip, halved for one direction"},
      {"h200", 989.5 * T, 1979 * T, 1979 * T, 4800 * G, 450 * G, "H200 SXM: NVLink 900 GB/s total, 450 GB/s each way"},
      {"h100", 989.5 * T, 1979 * T, 1979 * T, 3350 * G, 450 * G, "H100 SXM: NVLink 900 GB/s total, 450 GB/s each way"},
      {"l4", 121 * T, 242.5 * T, 242.5 * T, 300 * G, 32 * G, "L4: no NVLink; PCIe 4.0 x16 one way"},
      {"rtx-pro-6000", 503.8 * T, 1007.6 * T, 1007.6 * T, 1792 * G, 64 * G,
       "RTX PRO 6000 Blackwell: no NVLink; PCIe 5.0 x16 one way"},
      {"cpu", 0.427 * T, 0, 0, 20 * G, 0,
       "this 2-core development machine: oneDNN bf16 GEMM and memcpy bandwidth as measured; "
       "override with --peak-tflops / --gbps"},
  };
  return chips;
}

const Chip& find_chip(const std::string& name) {
  std::string known;
  for (const Chip& c : chip_table()) {
    if (c.name == name) return c;
    known += (known.empty() ? "" : ", ") + c.name;
  }
  fail("unknown chip '", name, "' (known: ", known, ")");
}

}  // namespace apus
