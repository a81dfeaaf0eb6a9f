#pragma once
// `apus synth`: checkpoints with the exact file layout of a published model (every file, tensor
// name, dtype, shape and on-disk order) filled with seeded random weights, so the full-size
// pipeline can be run and measured without a download.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace apus {

// The published models whose layouts data/ carries: what synth, bench --synthetic and counting by
// name accept.
inline const std::vector<std::string> kPublishedModels = {"flux2-klein-4b",
                                                          "flux2-klein-9b",
                                                          "flux2-klein-9b-kv",
                                                          "stable-audio-3-medium",
                                                          "stable-audio-3-small-music",
                                                          "stable-audio-3-small-sfx"};

using SynthProgress = std::function<void(const std::string&)>;

// The published layout (configs and manifest.json, no weights) the engine carries for `name`
// ("flux2-klein-4b" is black-forest-labs/FLUX.2-klein-4B): $APUS_DATA_DIR/<name> when that
// variable is set, else share/apus/<name> beside the running program's bin/ (an installed apus),
// else data/<name> of the source tree this library was built from.
std::string published_layout_dir(const std::string& name);

// template_dir is either a layout folder (configs plus manifest.json, as under data/) or an existing
// checkpoint, whose *.safetensors files are re-created with the same tensors in the same order.
// Every other file is copied. Weights stream to disk in chunks; values are a pure function of
// (seed, file, tensor, element), so a rerun reproduces the same bytes.
// layout_only writes the headers and sizes each file without writing data (sparse on disk, reads
// as zeros): the full-size layout for loader checks, costing no disk space.
void synth_checkpoint(const std::string& template_dir, const std::string& out_dir, uint64_t seed,
                      const SynthProgress& progress, bool layout_only = false);

// A checkpoint whose values are made as they are read: synth_checkpoint's layout only (sparse
// files, no disk space) plus kSyntheticValuesFile naming the seed, so that open_weights generates each
// tensor when a model fetches it, byte for byte what synth_checkpoint would have written. What a
// device bench loads: the weights go straight to device memory, nothing is written first.
void synth_on_demand(const std::string& template_dir, const std::string& out_dir, uint64_t seed,
                     const SynthProgress& progress);
inline constexpr const char* kSyntheticValuesFile = "apus_synthetic_values.json";

// The values synth_checkpoint writes for tensor `name` of file `rel` (relative to the checkpoint's
// root) under `seed`, into `out` (host memory of the tensor's dtype and shape).
void synth_values(uint64_t seed, const std::string& rel, const std::string& name, Tensor& out);

// synth_checkpoint from published_layout_dir(name).
void synth_published(const std::string& name, const std::string& out_dir, uint64_t seed, const SynthProgress& progress);

// `name`'s synthetic checkpoint (seed 0) under apus_cache_dir()/synthetic/, written the first time it
// is asked for: `apus bench --synthetic` measures the published size without a download. on_demand:
// the layout with values made as they are read (synth_on_demand) under synthetic-on-demand/.
std::string synthetic_model_dir(const std::string& name, const SynthProgress& progress, bool on_demand = false);

}  // namespace apus
