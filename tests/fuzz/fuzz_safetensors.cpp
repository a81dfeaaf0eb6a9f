// libFuzzer target for the safetensors header parser and the quantised layouts read from it
// (ComfyUI's tags and scales): any input must parse or raise apus::Error, never crash, hang or read
// outside the buffer (ASan watches); every quantised weight is decoded in full.
#include <cstdint>
#include <memory>

#include "core/error.h"
#include "fuzz_file.h"
#include "io/weights/quantized_layout.h"
#include "io/weights/safetensors.h"

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
    const apus::QuantizedLayout layout = apus::read_quantized_layout("fuzz", f);
    for (const auto& [name, q] : layout.weights) {
      try {
        volatile float sum = 0;
        for (const float v : apus::to_f32_vector(apus::quantized_weight("fuzz", f, name, q))) sum = sum + v;
      } catch (const apus::Error&) {
      }
    }
  } catch (const apus::Error&) {
  }
  return 0;
}
