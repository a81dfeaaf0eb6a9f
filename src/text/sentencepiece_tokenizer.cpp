#include "text/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include "core/error.h"
#include "io/files.h"
#include "io/model_dir.h"
#include "text/utf8.h"

namespace apus {

SentencePieceTokenizer::SentencePieceTokenizer() : sp_(new sentencepiece::SentencePieceProcessor) {}
SentencePieceTokenizer::SentencePieceTokenizer(SentencePieceTokenizer&&) noexcept = default;
SentencePieceTokenizer& SentencePieceTokenizer::operator=(SentencePieceTokenizer&&) noexcept = default;
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

SentencePieceTokenizer SentencePieceTokenizer::load(const std::string& path) { return parse(read_file(path), path); }

SentencePieceTokenizer SentencePieceTokenizer::parse(const std::string& bytes, const std::string& path) {
  // No bytes parse as an empty model proto, which the library reports as a missing unk piece.
  APUS_CHECK(!bytes.empty(), path, ": empty file (0 bytes), not a SentencePiece model");
  SentencePieceTokenizer t;
  t.path_ = path;
  // The library reports most bad models through its status, some by throwing (its trie builder
  // throws on an empty piece, found by fuzzing): both become one error naming the file.
  sentencepiece::util::Status status;
  try {
    status = t.sp_->LoadFromSerializedProto(bytes);
  } catch (const std::exception& e) {
    fail(path, ": not a SentencePiece model: ", e.what());
  }
  APUS_CHECK(status.ok(), path, ": not a SentencePiece model: ", status.ToString());
  APUS_CHECK(t.sp_->GetPieceSize() > 0, path, ": the SentencePiece model has no pieces");
  return t;
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  require_utf8(text, "text to encode");
  std::vector<int> ids;
  sentencepiece::util::Status status;
  try {
    status = sp_->Encode(text, &ids);
  } catch (const std::exception& e) {
    fail(path_, ": cannot encode the prompt: ", e.what());
  }
  APUS_CHECK(status.ok(), path_, ": cannot encode the prompt: ", status.ToString());
  return {ids.begin(), ids.end()};
}

int32_t SentencePieceTokenizer::pad_id() const { return sp_->pad_id(); }

int32_t SentencePieceTokenizer::bos_id() const { return sp_->bos_id(); }

int32_t SentencePieceTokenizer::eos_id() const { return sp_->eos_id(); }
int32_t SentencePieceTokenizer::vocab_size() const { return sp_->GetPieceSize(); }

PaddingSide read_padding_side(const std::string& tokenizer_config_path) {
  const Config c = read_config(tokenizer_config_path);
  const std::string side = c.get_string("padding_side", "left");
  APUS_CHECK(side == "left" || side == "right", tokenizer_config_path, ": padding_side '", side,
             "', expected left or right");
  return side == "left" ? PaddingSide::left : PaddingSide::right;
}

PaddedIds pad_ids(std::vector<int32_t> ids, int max_length, int32_t pad_id, PaddingSide side) {
  APUS_CHECK(max_length >= 1, "max_length ", max_length, " must be at least 1");
  PaddedIds p;
  p.truncated = ids.size() > size_t(max_length);
  if (p.truncated) ids.resize(size_t(max_length));
  const size_t pad = size_t(max_length) - ids.size();
  p.ids.assign(size_t(max_length), pad_id);
  p.mask.assign(size_t(max_length), 0);
  const size_t at = side == PaddingSide::left ? pad : 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    p.ids[at + i] = ids[i];
    p.mask[at + i] = 1;
  }
  return p;
}

}  // namespace apus
