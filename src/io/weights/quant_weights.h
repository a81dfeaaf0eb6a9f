#pragma once
// What `--quant` makes of a model's linear weights at load.
// - int8, the int8 tier: int8 codes with one fp32 scale per output feature (max |row| / 127, codes
//   rounded to nearest), flagged so that the linears quantise their input per row and multiply in
//   integers (ops/op_list.h, linear). It trades exactness against the official code for speed,
//   which `apus gate` measures.
// - fp8, the fp8 tier: the same with float8_e4m3fn codes (max |row| / 448, each value rounded to
//   the nearest e4m3, ties to even) and float8 products summed in fp32: what Ada's and Hopper's fp8
//   tensor cores multiply; a CPU multiplies the codes in its bf16 GEMM.
// - q8_0: GGUF's Q8_0 blocks, as llama.cpp's quantize_row_q8_0_ref writes them (per 32 values
//   d = max |x| / 127 stored as f16, codes roundf(x / d) from the fp32 d), which the linears decode
//   like a GGUF file's: weight-only, half of bf16's bytes.
#include <memory>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "io/weights/weight_source.h"
#include "ops/backend.h"

namespace apus {

// w (bf16, f16 or f32, rank 2) quantised row by row (core/tier_rows.h), with int8 products: a
// heap copy. `what` names the tensor in the error a non-finite weight gets.
Tensor quantize_int8_weight(const Tensor& w, const std::string& what);

// w (bf16, f16 or f32, rank 2) as float8_e4m3fn codes row by row (core/tier_rows.h), with fp8
// products: a heap copy. `what` names the tensor in the error a non-finite weight gets.
Tensor quantize_fp8_weight(const Tensor& w, const std::string& what);

// w with `products`: quantize_int8_weight's or quantize_fp8_weight's copy, or w itself (decoded).
Tensor quantize_tier_weight(const Tensor& w, Products products, const std::string& what);

// Which "*.weight" matrices a model part's quantised tier takes, by the ends of their names.
struct TierScope {
  std::vector<std::string> skip;  // left as stored: token embeddings, which feed a lookup
  std::vector<std::string> only;  // when not empty, these alone
  // A weight stored quantised otherwise (GGUF blocks, fp8): refused naming it, requantising would
  // round twice; or, where the tier takes only a few of the part's matrices, run as stored.
  bool keep_quantized = false;
};

// Every rank-2 "*.weight" in scope with the tier's products (Products::int8 or fp8): quantised, or,
// stored in the tier's codes with one scale a row or for the whole tensor already (a quantised
// checkpoint's: ComfyUI's int8, BFL's and ComfyUI's float8_e4m3fn), flagged as it is.
class TierLinears final : public WeightTransform {
 public:
  TierLinears(Products products, TierScope scope) : products_(products), scope_(std::move(scope)) {}
  Tensor apply(const std::string& name, const Tensor& stored) const override;

 private:
  Products products_;
  TierScope scope_;
};

// w (bf16, f16 or f32, rank 2, rows of whole 32-blocks) as Q8_0 blocks: a heap copy. `what` names
// the tensor in the error a non-finite weight, or one past f16's range, gets.
Tensor quantize_q8_0_weight(const Tensor& w, const std::string& what);

// Every rank-2 "*.weight" whose rows are whole 32-blocks as Q8_0 (the token table too: lookups
// decode its rows); a weight stored quantised already, or of other rows, stays as stored.
class Q8Linears final : public WeightTransform {
 public:
  Tensor apply(const std::string& name, const Tensor& stored) const override;
};

// --quant's spelling of each choice: "none", "int8", "q8_0", "fp8".
const char* quant_name(Quant quant);

// What `--quant` makes of the linears of a transformer and a text encoder: the int8 or fp8 tier's
// transform (token embeddings, which feed a lookup, stay as stored), q8_0's, or null for
// Quant::none. A tier the device cannot multiply (Backend::refuses: int8 on a CPU with neither
// VNNI nor AVX2, fp8 on a GPU before Ada) is refused naming what it lacks.
std::shared_ptr<const WeightTransform> quant_linears(Quant quant, Backend* device);
// A diffusers folder's transformer and text encoder through quant_linears (nothing for Quant::none).
void use_quant_linears(ModelDir& dir, Quant quant, Backend* device);

}  // namespace apus
