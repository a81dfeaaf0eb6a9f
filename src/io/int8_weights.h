#pragma once
// The int8 tier (`--quant int8`): a model's linear weights held as int8 codes with one fp32 scale
// per output feature (max |row| / 127, codes rounded to nearest), and flagged so that the linears
// quantise their input per row and multiply in integers (ops/op_list.h, linear). Opt-in: it
// trades exactness against the official code for speed, which `apus gate` measures.
#include <string>
#include <vector>

#include "io/weight_source.h"

namespace apus {

// w (bf16, f16 or f32, rank 2) quantised row by row (core/int8_rows.h), int8_matmul set: a heap
// copy. `what` names the tensor in the error a non-finite weight gets.
Tensor quantize_int8_weight(const Tensor& w, const std::string& what);

// Every rank-2 "*.weight" but those ending in one of `not_linear` (token embeddings, which feed a
// lookup): quantised, or, stored as int8 with a scale per row already (a quantised checkpoint's),
// flagged as it is. Other stored quantisations (GGUF blocks, fp8) are refused naming the tensor:
// requantising them would round twice.
class Int8Linears final : public WeightTransform {
 public:
  explicit Int8Linears(std::vector<std::string> not_linear) : not_linear_(std::move(not_linear)) {}
  Tensor apply(const std::string& name, const Tensor& stored) const override;

 private:
  std::vector<std::string> not_linear_;
};

}  // namespace apus
