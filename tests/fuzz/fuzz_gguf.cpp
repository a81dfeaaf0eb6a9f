// libFuzzer target for the GGUF parser: any input must parse or raise apus::Error, never crash,
// hang or read outside the buffer (ASan watches); every readable tensor's view is touched at both
// ends and its first row dequantised, and a tokenizer in its metadata (llama.cpp's or sa3.cpp's) is built and run.
#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"
#include "fuzz_file.h"
#include "core/quant_blocks.h"
#include "io/gguf.h"
#include "text/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const apus::GgufFile g = apus::GgufFile::parse(apus::fuzz::in_memory(data, size));
    (void)g.metadata().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (g.metadata().contains("tokenizer.ggml.model") || g.metadata().contains("tok.tokens")) {
      try {
        const apus::BpeTokenizer tokenizer = apus::BpeTokenizer::from_gguf(g);
        (void)tokenizer.decode(tokenizer.encode("a b<|im_end|>\n12"));
      } catch (const apus::Error&) {
      }
    }
    for (const auto& name : g.names()) {
      try {
        const apus::Tensor& t = g.get(name);
        if (!t.nbytes()) continue;
        volatile uint8_t a = static_cast<const uint8_t*>(t.data)[0];
        volatile uint8_t b = static_cast<const uint8_t*>(t.data)[t.nbytes() - 1];
        (void)a;
        (void)b;
        if (apus::is_block_quantized(t.dtype) && t.shape.back() <= 4096) {
          std::vector<float> row(size_t(t.shape.back()));
          apus::dequantize_row(t.dtype, t.data, row.data(), t.shape.back());
        }
      } catch (const apus::Error&) {
      }
    }
  } catch (const apus::Error&) {
  }
  return 0;
}
