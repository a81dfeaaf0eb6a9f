// libFuzzer target for tokenizer.model: any bytes must load as a SentencePiece model or raise
// apus::Error naming the file, and a loaded model must encode a prompt without crashing.
#include "fuzz_file.h"
#include "text/sentencepiece_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("tokenizer.model", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    const apus::SentencePieceTokenizer tok = apus::SentencePieceTokenizer::load(path);
    tok.encode("warm lo-fi hip hop, vinyl crackle, 84 bpm 🎹");
  });
  return 0;
}
