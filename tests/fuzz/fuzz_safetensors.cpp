// libFuzzer target for the safetensors header parser: any input must parse or raise
// apus::Error, never crash, hang or read outside the buffer (ASan watches).
#include <cstdint>
#include <memory>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = std::make_shared<apus::MappedFile>();
  file->path = "fuzz-input";
  file->data = data;
  file->size = size;
  file->mapped = false;
  try {
    const apus::SafetensorsFile f = apus::SafetensorsFile::parse(file);
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
