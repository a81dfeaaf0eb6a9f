#pragma once
// apus public API: open a model directory once, then render requests from it.
//
//   auto model = apus::ImageModel::open("FLUX.2-klein-4B", apus::Weights::resident);
//   apus::ImageResult r = model->generate({.prompt = "a lighthouse", .width = 512, .height = 512});
//
// A resident model keeps its weights (and what is derived from them) for its lifetime and serves
// generate() from several threads at once, each request with its own scratch memory.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace apus {

// The engine's version ("0.1.0"): what `apus --version`, the server's /health and /metrics and the
// installed package say.
const char* version();

struct PipelineCost;  // the counted cost of one request (src/core/cost.h)

// 8-bit RGB pixels, rows top to bottom.
struct Rgb8Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // height * width * 3
};

// Inpainting as Flux2KleinInpaintPipeline does it: `image` is repainted where `mask` is white and
// kept where it is black (the mask resized to the image, to grey, thresholded at 128 and
// interpolated to the latent grid, so its edges blend). The result has the image's size, floored
// to multiples of 16 by resizing (over 1024x1024 pixels scaled to that area first). `strength` in
// (0, 1] is the share of the schedule that runs (its first steps are skipped) and how much noise
// the image gets at the start: 1 ignores the image inside the mask.
struct Inpainting {
  Rgb8Image image, mask;
  double strength = 0.8;  // a double as the pipeline's Python float: it decides the first step
};

// The bounds of an image request, held by generate() and count() alike: a setting outside them is
// refused with one message naming it, which the CLI, the server and the bench pass on as theirs.
struct ImageLimits {
  static constexpr int min_side = 16, max_side = 4096;  // width and height, multiples of 16
  static constexpr int max_steps = 200;
  static constexpr int max_batch = 64;  // requests rendered as one batch
};

// The sampler's current estimate of one request's result, after one of its steps: the image
// through a cheap latent-to-RGB projection (klein), or the clip's waveform (Stable Audio 3).
struct Preview {
  int step = 0, steps = 0;   // after step `step` (from 1) of the `steps` the request runs
  Rgb8Image image;           // klein: two pixels a latent token side, 1/8 of the image's
  std::vector<float> peaks;  // Stable Audio 3: the waveform's (min, max) per bucket, channels mixed
};
// Called on the rendering thread right after each step; it must not block for long.
using PreviewSink = std::function<void(const Preview&)>;

// The processes one request is split over (issue 43). The CLI's is MPI's world (src/dist); the
// engine itself only calls these.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over `data`: rank r's part is bytes[r] bytes at offset bytes[0] + .. + bytes[r-1];
  // on return every rank holds every part. `what` names the exchange in a failure's message.
  virtual void all_gather(void* data, const std::vector<size_t>& bytes, const char* what) const = 0;
  // Each rank sends send_bytes[j] bytes to rank j (`send` holds the parts in rank order) and
  // receives recv_bytes[i] bytes from rank i (into `recv`, in rank order).
  virtual void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                          const std::vector<size_t>& recv_bytes, const char* what) const = 0;

  // What a GPU's exchanges between these ranks (NCCL, bootstrapped by all_gather above) take from
  // the group: how long one waits for the slowest rank, in seconds; what one that cannot complete
  // does (`message` names it: the CLI's world ends the job, a server's answers the request first;
  // by default it throws); and the count of what each moved, beside the group's own exchanges.
  virtual double timeout() const { return 600; }
  [[noreturn]] virtual void lose(const std::string& message) const;
  virtual void count_exchange(double sent, double seconds) const {}
};

// How a request's work splits over a group's ranks; every rank runs the same request and returns
// the whole result (but under batch, where each runs its own).
enum class Parallel {
  none,
  // Classifier-free guidance parallelism: the transformer's samples (a guided request's two
  // branches, for every image of a batch) split over the ranks, each step's velocities gathered.
  cfg,
  // Ulysses sequence parallelism: every sample's tokens split over the ranks, each attention
  // exchanging queries, keys and values for a share of the heads over the whole sequence.
  ulysses,
  // Tensor parallelism: the transformer's block linears held as each rank's share of their output
  // features (ModelParts::tensor_ranks), every rank running every token of every sample, the
  // features gathered where the next op needs them all. The only split that divides the weights'
  // memory; a model opened so takes nothing else.
  tensor,
  // Batch parallelism as a server runs it: the requests given are this rank's share of a batch
  // dealt out over the group (each rank its own outputs, nothing split within them), every rank
  // rendering as many steps; only the stop and finish flags are agreed over the group before each
  // step, so that a cancel on one rank stops every rank's share.
  batch,
};
struct Parallelism {
  Parallel strategy = Parallel::none;
  const ProcessGroup* group = nullptr;  // required by every strategy but none
};

// A low-rank adapter (LoRA) a request applies, in order with the others, at `scale` (PEFT's
// adapter weight: the adapter's own alpha / rank times this). `file` is a safetensors file in any
// layout the family reads (see docs/DESIGN.md "Adapters"); the model's weights are not changed.
struct Lora {
  std::string file;
  float scale = 1;
};

// A setting left absent takes the model's default; a value given is checked as given (an
// explicit 0 is refused, never read as "the default").
struct ImageRequest {
  std::string prompt;
  // Multiples of 16 within ImageLimits' sides; absent: the first reference image's size (as the
  // pipeline floors it), else 1024.
  std::optional<int> width, height;
  // Editing / multi-reference generation (Flux2KleinPipeline's image=[...]): each reference is
  // centre-cropped to multiples of 16, VAE-encoded and attends with the image as extra tokens.
  // With `inpaint`, at most one reference (the pipeline's image_reference), and width and height
  // are the image's.
  std::vector<Rgb8Image> references;
  std::optional<Inpainting> inpaint;
  std::optional<int> steps;  // 1..max_steps; absent: the model's default (ImageModel::default_steps)
  // Classifier-free guidance (the -base models), in (0, 100]: absent is the model's default (4.0
  // for -base, 8.0 inpainting, as the official pipelines; a model that does not take_guidance()
  // refuses a scale above 1 and a negative prompt); <= 1 turns it off. The unconditional branch's
  // prompt is "" as in the official pipeline unless negative_prompt says otherwise.
  std::optional<float> cfg;
  std::optional<std::string> negative_prompt;
  std::optional<uint64_t> seed;  // drawn from the OS when absent; reported in the result
  // The noise is part `noise_index` of one torch.randn, from the seed, of noise_index + 1 noises,
  // as diffusers draws a batch's latents from one torch.Generator (num_images_per_prompt with one
  // generator: output i has noise_index i). 0: the seed's own draw; at most max_batch - 1.
  int noise_index = 0;
  std::string noise_file;   // safetensors holding "noise" [1, C, H/16, W/16]; overrides seed
  bool fp32 = false;        // parity mode: fp32 activations (weights stay as stored)
  bool trace = false;       // record the request's timeline into ImageResult::trace
  std::vector<Lora> loras;  // the transformer's adapters; every request of a batch the same
  // Live previews after every step (a resident model's; others refuse it). The first call fits the
  // projection to the model's VAE (one decode of two 256x256 images), once per model.
  PreviewSink preview;
  // Set from any thread to end the sampling early: no step starts after it, and the image is
  // decoded from the latents as they are (ImageResult::steps_run says how many ran). Null: none.
  const std::atomic<bool>* finish_steps = nullptr;
  Parallelism parallel;  // one process unless a group is given
};

struct StageTime {
  std::string name;   // what ran: "text encoder load", "transformer step 2", ...
  std::string stage;  // the counted stage it belongs to ("dit_step"), empty for loading and glue
  double seconds;
};

struct ImageResult {
  int width = 0, height = 0;
  uint64_t seed = 0;
  int steps = 0;             // the schedule's: the request's, or the model's default
  int steps_run = 0;         // ... of which inpainting ran the last (strength)
  float cfg = 1;             // ... the guidance scale (1: none)
  std::vector<uint8_t> rgb;  // height * width * 3
  std::vector<StageTime> stages;
  // With ImageRequest::trace: Chrome trace-event JSON (ui.perfetto.dev) of the batch it ran in, a
  // span per timed interval, counted stage, module and op (operands, FLOPs, bytes). docs/BENCH.md.
  std::string trace;
};

using Progress = std::function<void(const std::string&)>;

// How a model holds its weights.
enum class Weights {
  per_stage,  // mapped for one stage of one request and released after it: the one-shot CLI
  resident,   // mapped and made resident at open, kept across requests: servers
  none,       // configs only: counting (roofline, admission checks); generate() refuses
};

// How the transformer's and text encoder's linears hold their weights: as the files give them; the
// int8 tier: int8 codes with a scale per output feature, multiplied with the activations quantised
// per token (CPUs with VNNI or AVX2, GPUs; faster, and further from the official code's outputs:
// `apus gate` measures how far); or q8_0: GGUF's Q8_0 blocks (a scale a 32 values, llama.cpp's
// quantiser), decoded for each product as a GGUF file's are (half of bf16's memory, the
// activations untouched). Weights a file stores quantised already keep their formats under q8_0.
// fp8, the fp8 tier: as int8's with float8_e4m3fn codes and products summed in fp32 (the fp8
// tensor cores of Ada and Hopper GPUs; on a CPU the codes go through its bf16 GEMM, at bf16's
// rate); a file's own float8_e4m3fn weights are multiplied as they are.
enum class Quant { none, int8, q8_0, fp8 };

// An image model from its parts, as users download them: `model` a diffusers folder, a repository
// id, or one transformer file (BFL's or ComfyUI's safetensors, a GGUF quantisation: recognised from
// its tensor names, not its file name); the other parts, when given, replace the folder's.
struct ModelParts {
  std::string model;
  std::string text_encoder;  // a file in transformers' names (ComfyUI's qwen_3_4b.safetensors)
  std::string vae;           // a file in diffusers' names
  std::string tokenizer;     // a folder holding tokenizer.json
  // A diffusers folder whose configs (and, where not given above, other parts) serve a
  // single-file transformer; by default the layout apus carries for its shape, which holds no
  // text encoder, VAE or tokenizer.
  std::string config;
  Quant quant = Quant::none;
  // Tensor parallelism (Parallel::tensor): the transformer's block linears loaded as this rank's
  // share of their output features, so that each rank reads and holds only its share; every
  // request then runs split over these ranks. Null: whole weights. FLUX.2 [klein] only.
  const ProcessGroup* tensor_ranks = nullptr;
};

class ImageModel {
 public:
  static std::unique_ptr<ImageModel> open(const ModelParts& parts, Weights weights, const std::string& device = "cpu");
  // Recognises the directory from model_index.json's `_class_name` (or a published name the
  // engine carries the layout of, for Weights::none) and refuses anything else naming the class.
  // device: "cpu", or "cuda[:N]" where the build has the CUDA backend (its weights uploaded as
  // the models fetch them; docs/ROADMAP.md says what runs there and how fast).
  static std::unique_ptr<ImageModel> open(const std::string& dir, Weights weights, const std::string& device = "cpu");
  virtual ~ImageModel() = default;

  // Validates everything a request can get wrong before any weight is read, then renders it.
  // Progress lines ("step 2/4 ...") go to `progress` as they happen. Setting `*stop` from any
  // thread ends the run between two ops (an apus::Error "cancelled"), not only between steps, so
  // a stage that takes minutes still stops at once. Thread-safe.
  ImageResult generate(const ImageRequest& request, const Progress& progress = {},
                       const std::atomic<bool>* stop = nullptr) const {
    return generate_batch({request}, progress, stop).front();
  }
  // Renders several requests (at most ImageLimits::max_batch) as one batch through every stage:
  // they must agree on size, steps and precision; prompts, seeds and noise are their own. Each
  // result equals its request rendered alone.
  virtual std::vector<ImageResult> generate_batch(const std::vector<ImageRequest>& requests,
                                                  const Progress& progress = {},
                                                  const std::atomic<bool>* stop = nullptr) const = 0;
  // The FLOPs, bytes and peak activations per stage of `batch` such requests, counted by walking
  // the same stage code in counting mode. What generate_batch would refuse of the requests'
  // settings, count refuses with the same message.
  virtual PipelineCost count(const ImageRequest& request, int batch = 1) const = 0;

  virtual const std::string& label() const = 0;    // e.g. "black-forest-labs/FLUX.2-klein-4B"
  virtual const std::string& sampler() const = 0;  // e.g. "Euler (flow match)"
  // What a request leaving steps and cfg absent runs: 4 steps without guidance (distilled), 50
  // steps at guidance 4.0 (-base).
  virtual int default_steps() const = 0;
  virtual float default_cfg() const = 0;
  // Whether the model takes a guidance scale above 1 and a negative prompt (the -base models); the
  // step-distilled ones and the KV pipeline run without guidance and refuse both.
  virtual bool takes_guidance() const = 0;
};

// An input clip: interleaved frames x channels samples in [-1, 1], at its own rate (resampled to
// the model's as the official code does, with torchaudio's Resample) and channel count (mono is
// doubled, beyond stereo the first two kept).
struct AudioClip {
  int sample_rate = 0, channels = 0;
  std::vector<float> samples;
};

// The official CLI's init_noise_level.
constexpr double kDefaultInitNoiseLevel = 0.9;

// The bounds of an audio request, as ImageLimits' are held and refused; seconds run from one
// output frame (1 / the model's rate) to AudioModel::max_seconds().
struct AudioLimits {
  static constexpr int max_steps = 200;
  static constexpr int max_batch = 64;  // requests generated as one batch
};

// The defaults of a request are its members' initial values, for every front end.
struct AudioRequest {
  std::string prompt;
  // Absent settings take the model's defaults (AudioModel::default_seconds, default_steps,
  // default_cfg), as ImageRequest's do; a given one is checked as given.
  std::optional<double> seconds;  // the clip's length, within AudioLimits'
  std::optional<int> steps;       // ping-pong sampler steps, 1..max_steps
  std::optional<uint64_t> seed;   // drawn from the OS when absent; reported in the result
  bool fp32 = false;              // parity mode: fp32 activations and weights
  // The decoder over chunks of 128 latents (the official decode_audio) or the whole sequence in
  // one piece; absent: as the model's config says (official checkpoints: chunked).
  std::optional<bool> chunked_decode;
  // Classifier-free guidance as the official DiT does it (1: off; the -base models are meant for
  // ~7): the unconditional branch is all-zero cross tokens, or the negative prompt's with its
  // padding zeroed; apg is the adaptive projected guidance share (1: full, the official default).
  std::optional<float> cfg;
  float apg = 1;
  std::optional<std::string> negative_prompt;
  // Audio-to-audio (the official init_audio): the clip, encoded by SAME, starts the sampler at
  // (1 - level) x clip + level x noise on a schedule from `level` down, level in (0, 1] (1: the
  // clip has no effect; absent: kDefaultInitNoiseLevel). A level without a clip is refused.
  std::optional<AudioClip> init_audio;
  std::optional<double> init_noise_level;
  // Inpainting (the official inpaint_audio): the clip, encoded, conditions every DiT block
  // outside the regions [start, end) seconds, which are generated anew.
  std::optional<AudioClip> inpaint_audio;
  std::vector<std::pair<double, double>> inpaint_regions;
  bool trace = false;  // record the request's timeline into AudioResult::trace
  // The DiT's and duration conditioner's adapters (the official format, PEFT's), each at its
  // strength; every request of a batch the same.
  std::vector<Lora> loras;
  // Live previews after every step (a resident model's; others refuse it): the clip decoded from
  // the sampler's current estimate, as peaks. Each costs a decode of the clip.
  PreviewSink preview;
  // As ImageRequest::finish_steps: no step starts after it is set; the clip is decoded as it is.
  const std::atomic<bool>* finish_steps = nullptr;
  Parallelism parallel;  // one process unless a group is given
};

struct AudioResult {
  int sample_rate = 0, channels = 0;
  std::vector<float> samples;  // interleaved, frames * channels, in [-1, 1]
  uint64_t seed = 0;
  int prompt_tokens = 0;  // before truncation to the text encoder's 256
  std::vector<StageTime> stages;
  std::string trace;  // as ImageResult::trace
};

class AudioModel {
 public:
  // Recognises the directory from model_index.json's `_class_name` (StableAudio3Pipeline) and
  // refuses anything else naming the class. device: as ImageModel::open's.
  static std::unique_ptr<AudioModel> open(const std::string& dir, Weights weights, const std::string& device = "cpu");
  // A folder as above, or one checkpoint file with its parts (--text-encoder, --tokenizer, --config).
  static std::unique_ptr<AudioModel> open(const ModelParts& parts, Weights weights, const std::string& device = "cpu");
  virtual ~AudioModel() = default;

  AudioResult generate(const AudioRequest& request, const Progress& progress = {},
                       const std::atomic<bool>* stop = nullptr) const {
    return generate_batch({request}, progress, stop).front();
  }
  // Several requests (at most AudioLimits::max_batch) as one batch through every stage: they must
  // agree on seconds, steps and precision. Each result equals its request rendered alone.
  virtual std::vector<AudioResult> generate_batch(const std::vector<AudioRequest>& requests,
                                                  const Progress& progress = {},
                                                  const std::atomic<bool>* stop = nullptr) const = 0;
  // As ImageModel::count, refusing what generate_batch would refuse of the settings.
  virtual PipelineCost count(const AudioRequest& request, int batch = 1) const = 0;
  virtual double max_seconds() const = 0;
  virtual const std::string& label() const = 0;
  virtual const std::string& sampler() const = 0;
  // What a request leaving seconds, steps and cfg absent runs: the official generate()'s 8 steps
  // without guidance on every checkpoint (-base included: its docs suggest ~50 steps at cfg ~7
  // there, its code does not), and 30 s (the official default is 120 s, which on a CPU is minutes
  // of waiting for a first try).
  virtual double default_seconds() const = 0;
  virtual int default_steps() const = 0;
  virtual float default_cfg() const = 0;
};

// `n` copies of `request` to render as one batch, seeds seed, seed + 1, ... (without a seed, each
// is drawn from the OS); n outside 1..max_batch is refused as generate_batch refuses it. Every
// front end's -n or n is this.
std::vector<ImageRequest> batch_of(const ImageRequest& request, int n);
std::vector<AudioRequest> batch_of(const AudioRequest& request, int n);

// Peak resident memory of this process so far, in bytes (VmHWM).
uint64_t peak_rss_bytes();

}  // namespace apus
