#pragma once
// SentencePiece models (`tokenizer.model`), read and run by Debian's libsentencepiece: T5Gemma's
// Gemma tokenizer for Stable Audio 3. HF's GemmaTokenizer is a conversion of the same model; the
// fixtures (tools/oracle/make_t5gemma_tokenizer.py) show the two give the same ids.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace apus {

class SentencePieceTokenizer {
 public:
  // Errors name the file: missing, not a regular file, or not a SentencePiece model.
  static SentencePieceTokenizer load(const std::string& path);
  // The model from bytes already in memory (`path` names them in errors): the fuzz target's way in.
  static SentencePieceTokenizer parse(const std::string& bytes, const std::string& path);
  SentencePieceTokenizer(SentencePieceTokenizer&&) noexcept;
  SentencePieceTokenizer& operator=(SentencePieceTokenizer&&) noexcept;
  ~SentencePieceTokenizer();

  // Ids without BOS/EOS, as `tokenizer(text, add_special_tokens=False)`; invalid UTF-8 is refused.
  std::vector<int32_t> encode(std::string_view text) const;
  int32_t pad_id() const;
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t vocab_size() const;

 private:
  SentencePieceTokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string path_;
};

enum class PaddingSide { left, right };

// A tokenizer_config.json's padding_side; transformers 5's GemmaTokenizer pads on the left when
// the file does not say.
PaddingSide read_padding_side(const std::string& tokenizer_config_path);

struct PaddedIds {
  std::vector<int32_t> ids, mask;  // max_length each; mask 1 on tokens, 0 on padding
  bool truncated = false;          // the text had more than max_length tokens
};
// Truncated to max_length (from the right, as HF's truncation=True), then padded with pad_id.
PaddedIds pad_ids(std::vector<int32_t> ids, int max_length, int32_t pad_id, PaddingSide side);

}  // namespace apus
