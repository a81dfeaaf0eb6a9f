// libFuzzer target for the GGUF parser: any input must parse or raise apus::Error, never crash,
// hang or read outside the buffer (ASan watches); every readable tensor's view is touched at both
// ends and its first row dequantised, and a tokenizer in its metadata (llama.cpp's or sa3.cpp's) is built and run.
// Invariants of what parses (a violation traps): the readable tensors' bytes do not overlap (the
// data tile the section, as ggml requires), and a block tensor fetched has no non-finite scale.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/quant_blocks.h"
#include "fuzz_file.h"
#include "io/weights/gguf.h"
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
    std::vector<std::pair<const uint8_t*, size_t>> spans;
    for (const auto& name : g.names()) {
      try {
        const apus::Tensor& t = g.get(name);
        if (apus::is_block_quantized(t.dtype) &&
            apus::first_nonfinite_scale(t.dtype, t.data, t.numel() / apus::dtype_block(t.dtype)) >= 0)
          __builtin_trap();  // fetched with a NaN or infinite block scale
        spans.emplace_back(static_cast<const uint8_t*>(t.data), t.nbytes());
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
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i - 1].first + spans[i - 1].second > spans[i].first) __builtin_trap();  // two tensors share bytes
  } catch (const apus::Error&) {
  }
  return 0;
}
