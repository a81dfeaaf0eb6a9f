#pragma once
// The official single-checkpoint layout's model_config.json (stabilityai/stable-audio-3-*: the
// file the official factory builds the model from): every key it reads for the parts apus runs is
// either mapped to the engine's configs or refused naming the file and key.
#include <string>

#include "models/sa3/dit.h"
#include "models/sa3/duration_embedder.h"
#include "models/sa3/same_decoder.h"
#include "models/sa3/same_encoder.h"

namespace apus::sa3 {

struct OfficialConfig {
  DitConfig dit;
  SameConfig same;     // the decoder
  SameConfig encoder;  // the encoder (audio-to-audio, inpainting)
  DurationConfig duration;
  std::string text_encoder_folder;  // the T5Gemma subfolder beside model_config.json
  int max_tokens = 256;
  std::string max_tokens_key;     // where max_tokens comes from: "FILE (KEY PATH): 'max_length'"
  int64_t sample_size = 0;        // samples: the longest canvas
  int64_t encoder_chunk = 32;     // the SAME encoder's chunk_size: canvases align to it
  bool chunked_decode = false;    // model.pretransform.chunked
  bool euler = false;             // rectified_flow (the -base models): Euler, no per-step noise
  float mask_noise = 0;           // the decoder's placeholder noise
  float encoder_mask_noise = 0;   // the encoder's summary-token noise (refused when encoding)
  bool bottleneck_noise = false;  // the bottleneck's noise_regularize
};

OfficialConfig read_official_config(const std::string& path);
// The SAME autoencoder object (model.pretransform.config of a full checkpoint, or `model` of a
// SAME-L / SAME-S repository) into o.same and o.encoder, their noise and the encoder's chunk
// alignment.
void read_official_autoencoder(const Config& autoencoder, int64_t sample_rate, OfficialConfig& o);

}  // namespace apus::sa3
