#include "text/klein_prompt.h"

#include <algorithm>

#include "core/error.h"

namespace apus {

std::string klein_chat_text(std::string_view prompt) {
  std::string text = "<|im_start|>user\n";
  text += prompt;
  text += "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
  return text;
}

int klein_prompt_length(const BpeTokenizer& tokenizer, std::string_view prompt) {
  return static_cast<int>(tokenizer.encode(klein_chat_text(prompt)).size());
}

std::vector<int32_t> encode_klein_prompt(const BpeTokenizer& tokenizer, std::string_view prompt, int max_length,
                                         std::vector<int32_t>* attention_mask) {
  APUS_CHECK(max_length > 0, "klein prompt max_length must be positive, got ", max_length);
  // Qwen2's tokenizer_config sets <|endoftext|> as the pad token.
  const int32_t pad = tokenizer.token_id("<|endoftext|>");
  std::vector<int32_t> ids = tokenizer.encode(klein_chat_text(prompt));
  const size_t length = static_cast<size_t>(max_length);
  const size_t real = std::min(ids.size(), length);
  ids.resize(length, pad);
  if (attention_mask) {
    attention_mask->assign(length, 0);
    std::fill(attention_mask->begin(), attention_mask->begin() + static_cast<std::ptrdiff_t>(real), 1);
  }
  return ids;
}

}  // namespace apus
