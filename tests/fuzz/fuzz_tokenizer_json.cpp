// libFuzzer target for tokenizer.json: any bytes as the file must load or raise apus::Error
// naming it, and a loaded tokenizer must encode and decode a prompt without crashing.
#include "fuzz_file.h"
#include "text/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("tokenizer.json", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    const apus::BpeTokenizer tok = apus::BpeTokenizer::load(path);
    tok.decode(tok.encode("a lighthouse at dawn, 1234 <|im_start|>"));
  });
  return 0;
}
