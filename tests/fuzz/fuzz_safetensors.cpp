// libFuzzer target for the safetensors header parser: any input must parse or raise
// apus::Error, never crash, hang or read outside the buffer (ASan watches).
#include <cstdint>
#include <memory>

#include "core/error.h"
#include "fuzz_file.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const apus::SafetensorsFile f = apus::SafetensorsFile::parse(apus::fuzz::in_memory(data, size));
    for (const auto& name : f.names()) {
      const apus::Tensor& t = f.get(name);
      // Touch the first and last byte of every view: out-of-range views crash here under ASan.
      if (t.nbytes()) {
        volatile uint8_t a = static_cast<const uint8_t*>(t.data)[0];
        volatile uint8_t b = static_cast<const uint8_t*>(t.data)[t.nbytes() - 1];
        (void)a;
        (void)b;
      }
    }
  } catch (const apus::Error&) {
  }
  return 0;
}
