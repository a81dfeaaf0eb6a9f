// libFuzzer target for the JSON configs: the same bytes go through every config reader
// (model_index.json with the klein check, klein's transformer, text encoder, VAE, scheduler; Stable
// Audio 3's model_config.json, DiT, SAME, duration and T5Gemma configs); each must accept them or
// raise apus::Error, never crash or leak a library exception.
#include "fuzz_file.h"
#include "io/model_dir.h"
#include "models/flux2/klein.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "models/sa3/t5gemma_encoder.h"
#include "pipeline/sa3/model_config.h"
#include "sampling/flow_match.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace apus;
  const std::string path = fuzz::write_input("model_index.json", data, size);
  fuzz::expect_only_apus_errors([&] { flux2::check_klein_index(ModelDir::open(fuzz::scratch_dir(), false)); });
  fuzz::expect_only_apus_errors([&] { flux2::TransformerConfig::read(read_config(path)); });
  fuzz::expect_only_apus_errors([&] { flux2::TextEncoderConfig::read(read_config(path)); });
  fuzz::expect_only_apus_errors([&] { flux2::VaeConfig::read(read_config(path)); });
  fuzz::expect_only_apus_errors([&] { flow_match_schedule(read_config(path), 4, 1.0); });
  fuzz::expect_only_apus_errors([&] { sa3::read_official_config(path); });
  fuzz::expect_only_apus_errors([&] { sa3::DitConfig::read(read_config(path)); });
  fuzz::expect_only_apus_errors([&] { sa3::SameConfig::read(read_config(path)); });
  fuzz::expect_only_apus_errors([&] { sa3::DurationConfig::read(read_config(path)); });
  fuzz::expect_only_apus_errors([&] { sa3::T5GemmaConfig::read(read_config(path)); });
  return 0;
}
