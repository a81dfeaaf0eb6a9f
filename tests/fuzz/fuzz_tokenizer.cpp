// libFuzzer target for prompt text: any bytes must tokenise or raise apus::Error (invalid
// UTF-8), never crash; what encode yields must decode, and re-encoding the decoded text (the
// NFC form of the input) must give the same ids.
#include <cstdint>
#include <string>

#include "core/error.h"
#include "text/bpe_tokenizer.h"
#include "text/klein_prompt.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const apus::BpeTokenizer tok =
      apus::BpeTokenizer::load(APUS_FIXTURES "/klein_tiny_a/tokenizer/tokenizer.json");
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const apus::Error&) {
    return 0;  // invalid UTF-8 is refused, by design
  }
  try {
    if (tok.encode(tok.decode(ids)) != ids) __builtin_trap();
    std::vector<int32_t> mask;
    const auto padded = apus::encode_klein_prompt(tok, text, 512, &mask);
    if (padded.size() != 512 || mask.size() != 512) __builtin_trap();
  } catch (const apus::Error&) {
    __builtin_trap();  // valid text must never fail past encode
  }
  return 0;
}
