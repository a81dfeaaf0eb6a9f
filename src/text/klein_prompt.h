#pragma once
// Prompt -> Qwen3 input ids exactly as diffusers' Flux2KleinPipeline._get_qwen3_prompt_embeds
// builds them: the chat template with one user turn, a generation prompt and thinking disabled,
// tokenized with right truncation and right padding to a fixed length.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/bpe_tokenizer.h"

namespace apus {

// `<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n`
std::string klein_chat_text(std::string_view prompt);

// Token count of the templated prompt before truncation. Anything above max_length loses the end of
// the template (and so the assistant header) in the pipeline, which is why callers reject it.
int klein_prompt_length(const BpeTokenizer& tokenizer, std::string_view prompt);

// Exactly max_length ids: the templated prompt cut to max_length, then <|endoftext|> padding.
// When attention_mask is non-null it receives 1 per real token and 0 per padding token.
std::vector<int32_t> encode_klein_prompt(const BpeTokenizer& tokenizer, std::string_view prompt, int max_length,
                                         std::vector<int32_t>* attention_mask);

}  // namespace apus
