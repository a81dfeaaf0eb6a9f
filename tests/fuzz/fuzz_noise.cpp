// libFuzzer target for `--noise FILE`: any bytes as the file must yield a finite tensor of the
// requested shape or raise apus::Error.
#include <cmath>

#include "fuzz_file.h"
#include "sampling/noise.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("noise.safetensors", data, size);
  for (const apus::DType act : {apus::DType::bf16, apus::DType::f32})
    apus::fuzz::expect_only_apus_errors([&] {
      const apus::Tensor n = apus::read_noise(path, {1, 4, 2, 3}, act);
      if (n.shape != apus::Shape({1, 4, 2, 3}) || n.dtype != act) __builtin_trap();
      for (int64_t i = 0; i < n.numel(); ++i)
        if (!std::isfinite(apus::load_f32(n, i))) __builtin_trap();
    });
  return 0;
}
