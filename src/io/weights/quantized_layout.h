#pragma once
// Quantised weights in a safetensors checkpoint, as the files users download lay them out:
// - ComfyUI's mixed files: a `<layer>.comfy_quant` tensor (U8 bytes of JSON, {"format": ...}) per
//   quantised layer, or the same per-layer JSON under the header's `_quantization_metadata`
//   ({"layers": {...}}), with `<layer>.weight_scale` (and nvfp4's `.weight_scale_2`) beside the
//   weight: float8_e4m3fn and float8_e5m2 (one scale), int8_tensorwise (one scale or one a row),
//   mxfp8 (e4m3 codes, an e8m0 scale a block of 32) and nvfp4 (packed e2m1 codes, an e4m3 scale a
//   block of 16 times one fp32 scale), as comfy/ops.py _load_quantized_module reads them and
//   comfy-kitchen's layouts define them (block scales in cuBLAS's tiled order);
// - ComfyUI's older scaled fp8: a `scaled_fp8` marker and `<layer>.scale_weight` (comfy/utils.py
//   convert_old_quants), every such layer float8_e4m3fn;
// - BFL's fp8 files: fp8 weights with `.weight_scale` beside them and no format tag.
// Activation scales (`.input_scale`, `.scale_input`) serve fp8 matmuls, which apus does not run: it
// multiplies the decoded weight, as ComfyUI does with full_precision_matrix_mult.
#include <map>
#include <set>
#include <string>

#include "io/weights/safetensors.h"

namespace apus {

struct QuantizedWeight {
  std::string format;          // ComfyUI's name: float8_e4m3fn, float8_e5m2, int8_tensorwise, mxfp8, nvfp4
  std::string scale, scale_2;  // stored names of the weight's scales (scale_2: nvfp4's per-tensor one)
};

struct QuantizedLayout {
  std::map<std::string, QuantizedWeight> weights;  // stored weight name -> how it is quantised
  std::set<std::string> sidecars;                  // stored names that describe weights: no model tensors
};

// Refuses, naming the file and the tensor or key, a format apus does not read, a setting it does
// not implement, a tag of no weight and a scale of none.
QuantizedLayout read_quantized_layout(const std::string& path, const SafetensorsFile& file);

// The stored weight as codes with its scales attached (Tensor::encoding: code_scale, block_scales), every
// shape and dtype checked against the format.
Tensor quantized_weight(const std::string& path, const SafetensorsFile& file, const std::string& stored,
                        const QuantizedWeight& q);

}  // namespace apus
