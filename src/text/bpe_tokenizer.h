#pragma once
// BPE tokenizers read from a Hugging Face tokenizer.json: byte-level (GPT-2 / Qwen2 family), also
// from the tokenizer.ggml.* metadata llama.cpp's converter writes into a GGUF, and Gemma's (spaces
// as U+2581, words of characters, byte fallback), also from sa3.cpp's vocabulary GGUF (tok.*).
// Output matches HF `tokenizers` encode(text, add_special_tokens=False) for the configurations
// load() accepts; anything else is rejected at load time rather than tokenized differently.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace apus {

class GgufFile;

class BpeTokenizer {
 public:
  // `source`: a tokenizer.json, a folder holding one, or a GGUF file carrying its vocabulary.
  // Throws apus::Error naming the file for a missing or malformed file and for any
  // normalizer / pre_tokenizer / model / decoder setting this implementation does not reproduce.
  static BpeTokenizer load(const std::string& source);
  // The tokenizer a GGUF's tokenizer.ggml.* metadata describes (llama.cpp's gpt2 model with the
  // qwen2 pre-tokenizer), or sa3.cpp's tok.* (Gemma's); anything else is refused naming the file
  // and key.
  static BpeTokenizer from_gguf(const GgufFile& gguf);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // Added tokens (special or not) found literally in `text` become their own ids; the rest is
  // NFC-normalized, split by the pre-tokenizer regex, byte-mapped and merged by rank.
  // Throws apus::Error if `text` is not valid UTF-8.
  std::vector<int32_t> encode(std::string_view text) const;

  // Special tokens are kept; byte sequences that are not valid UTF-8 become U+FFFD.
  // Throws apus::Error for an id outside the vocabulary.
  std::string decode(const std::vector<int32_t>& ids) const;

  // Added tokens take precedence over the model vocabulary, as in HF. Throws apus::Error naming
  // the token when it is absent.
  int32_t token_id(std::string_view token) const;
  // The largest id any token has: a model must have an embedding row for each.
  int32_t max_id() const;

 private:
  struct Impl;
  static BpeTokenizer from_json(const nlohmann::json& root, const std::string& path);
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace apus
