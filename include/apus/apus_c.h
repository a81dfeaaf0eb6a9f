/* apus's C ABI (issue 44): the engine from C and from any language with a C FFI (Rust, Go, C#,
 * Python's ctypes, audio plugin hosts). Opaque handles and plain C types only; no C++ type or
 * exception crosses it.
 *
 *   apus_image_model* model;
 *   if (apus_image_model_open("FLUX.2-klein-4B", APUS_WEIGHTS_RESIDENT, "cpu", &model) != APUS_OK)
 *     fprintf(stderr, "%s\n", apus_last_error());
 *   apus_image_request* r = apus_image_request_new("a lighthouse at dawn");
 *   apus_image_request_set_size(r, 1024, 1024);
 *   apus_image_request_set_seed(r, 42);
 *   apus_image_result* out;
 *   if (apus_image_generate(model, r, 1, NULL, NULL, NULL, &out) == APUS_OK)
 *     apus_image_result_write(out, 0, "out.png", 95);
 *   apus_image_result_free(out); apus_image_request_free(r); apus_image_model_free(model);
 *
 * Every call that can fail returns an apus_status and keeps the failure's one-line message (what
 * the CLI prints) for apus_last_error() on the calling thread. A request's settings are checked
 * when it runs, as the C++ API checks them: a setter only refuses a null handle or string. Every
 * *_free takes NULL. A model renders requests from several threads at once. */
#ifndef APUS_C_H
#define APUS_C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Raised when a function's meaning changes or one is removed; additions keep it. 2: the open_parts
 * functions' quant is an apus_quant (it was "non-zero: int8"; 2 now means q8_0, others are refused). */
#define APUS_C_ABI_VERSION 2

typedef enum {
  APUS_OK = 0,
  APUS_ERROR = 1,         /* the request, a file or the model was wrong: apus_last_error() says what */
  APUS_CANCELLED = 2,     /* apus_stop_now() or the progress callback ended the run */
  APUS_OUT_OF_MEMORY = 3, /* an allocation failed */
} apus_status;

typedef enum {
  APUS_WEIGHTS_RESIDENT = 0,  /* loaded once at open, kept for every request (previews need it) */
  APUS_WEIGHTS_PER_STAGE = 1, /* each stage's weights mapped while it runs, for one request */
} apus_weights;

int apus_c_abi_version(void);
const char* apus_version(void); /* the release, e.g. "0.1.0" */
/* This thread's last failure's message; "" when none. Valid until this thread's next apus call. */
const char* apus_last_error(void);

/* Called with each progress line ("step 2/4 ..."); non-zero cancels the run. */
typedef int (*apus_progress_fn)(void* user, const char* line);

/* A stop flag any thread may set: the run ends between two ops (APUS_CANCELLED). */
typedef struct apus_stop apus_stop;
apus_stop* apus_stop_new(void); /* NULL when out of memory */
void apus_stop_now(apus_stop* stop);
void apus_stop_free(apus_stop* stop);

/* ---- Images: FLUX.2 [klein] ---------------------------------------------------------------- */

typedef struct apus_image_model apus_image_model;
/* A diffusers folder (or a Hugging Face cache's ORG/NAME), as `apus image --model`; device "cpu"
 * or "cuda[:N]" (NULL: "cpu"). */
apus_status apus_image_model_open(const char* dir, apus_weights weights, const char* device, apus_image_model** out);
/* --quant: the weights as the files hold them, the int8 tier, GGUF Q8_0 blocks, or the fp8 tier. */
typedef enum {
  APUS_QUANT_NONE = 0,
  APUS_QUANT_INT8 = 1,
  APUS_QUANT_Q8_0 = 2,
  APUS_QUANT_FP8 = 3,
} apus_quant;
/* A single file with its parts, as --model FILE --text-encoder --vae --tokenizer --config (each
 * may be NULL) --quant. */
apus_status apus_image_model_open_parts(const char* model, const char* text_encoder, const char* vae,
                                        const char* tokenizer, const char* config, apus_quant quant,
                                        apus_weights weights, const char* device, apus_image_model** out);
void apus_image_model_free(apus_image_model* model);
const char* apus_image_model_label(const apus_image_model* model);

typedef struct apus_image_request apus_image_request;
apus_image_request* apus_image_request_new(const char* prompt); /* NULL when out of memory or prompt is NULL */
void apus_image_request_free(apus_image_request* request);
/* Unset settings take the model's defaults (ImageRequest in apus/apus.h says which). */
apus_status apus_image_request_set_size(apus_image_request* request, int width, int height);
apus_status apus_image_request_set_steps(apus_image_request* request, int steps);
apus_status apus_image_request_set_seed(apus_image_request* request, uint64_t seed);
apus_status apus_image_request_set_cfg(apus_image_request* request, float cfg);
apus_status apus_image_request_set_negative_prompt(apus_image_request* request, const char* text);
apus_status apus_image_request_set_fp32(apus_image_request* request, int on);
apus_status apus_image_request_set_noise_file(apus_image_request* request, const char* path);
/* Output `index` of a batch diffusers draws from one torch.Generator (ImageRequest::noise_index). */
apus_status apus_image_request_set_noise_index(apus_image_request* request, int index);
apus_status apus_image_request_add_lora(apus_image_request* request, const char* file, float scale);
/* 8-bit RGB, rows top to bottom, width * height * 3 bytes (copied). */
apus_status apus_image_request_add_reference(apus_image_request* request, int width, int height, const uint8_t* rgb);
/* Repaints `image` where `mask` is white (Flux2KleinInpaintPipeline), strength in (0, 1]. */
apus_status apus_image_request_set_inpaint(apus_image_request* request, int width, int height, const uint8_t* rgb,
                                           int mask_width, int mask_height, const uint8_t* mask_rgb, double strength);
/* After every step of output `index`: the sampler's estimate, width x height RGB (resident models). */
typedef void (*apus_image_preview_fn)(void* user, int index, int step, int steps, int width, int height,
                                      const uint8_t* rgb);
apus_status apus_image_request_set_preview(apus_image_request* request, apus_image_preview_fn preview, void* user);

typedef struct apus_image_result apus_image_result;
/* Renders `batch` images of the request (seeds seed, seed + 1, ...; 1 for one). progress, user and
 * stop may be NULL. */
apus_status apus_image_generate(const apus_image_model* model, const apus_image_request* request, int batch,
                                apus_progress_fn progress, void* user, apus_stop* stop, apus_image_result** out);
int apus_image_result_count(const apus_image_result* result);
/* Output `index`'s pixels (valid while the result lives) and seed; any out-pointer may be NULL. */
apus_status apus_image_result_get(const apus_image_result* result, int index, int* width, int* height,
                                  const uint8_t** rgb, uint64_t* seed);
/* Output `index` as `apus image -o` writes it (.png, .jpg, .webp by the extension; its settings in
 * the metadata); quality for JPEG and WebP (1..100). */
apus_status apus_image_result_write(const apus_image_result* result, int index, const char* path, int quality);
void apus_image_result_free(apus_image_result* result);

/* ---- Audio: Stable Audio 3 ----------------------------------------------------------------- */

typedef struct apus_audio_model apus_audio_model;
apus_status apus_audio_model_open(const char* dir, apus_weights weights, const char* device, apus_audio_model** out);
apus_status apus_audio_model_open_parts(const char* model, const char* text_encoder, const char* vae,
                                        const char* tokenizer, const char* config, apus_quant quant,
                                        apus_weights weights, const char* device, apus_audio_model** out);
void apus_audio_model_free(apus_audio_model* model);
const char* apus_audio_model_label(const apus_audio_model* model);

typedef struct apus_audio_request apus_audio_request;
apus_audio_request* apus_audio_request_new(const char* prompt);
void apus_audio_request_free(apus_audio_request* request);
apus_status apus_audio_request_set_seconds(apus_audio_request* request, double seconds);
apus_status apus_audio_request_set_steps(apus_audio_request* request, int steps);
apus_status apus_audio_request_set_seed(apus_audio_request* request, uint64_t seed);
apus_status apus_audio_request_set_cfg(apus_audio_request* request, float cfg, float apg);
apus_status apus_audio_request_set_negative_prompt(apus_audio_request* request, const char* text);
apus_status apus_audio_request_set_fp32(apus_audio_request* request, int on);
apus_status apus_audio_request_set_chunked_decode(apus_audio_request* request, int chunked);
apus_status apus_audio_request_add_lora(apus_audio_request* request, const char* file, float scale);
/* Interleaved frames x channels samples in [-1, 1] at their own rate (copied). */
apus_status apus_audio_request_set_init_audio(apus_audio_request* request, int sample_rate, int channels, size_t frames,
                                              const float* samples, double noise_level);
apus_status apus_audio_request_set_inpaint_audio(apus_audio_request* request, int sample_rate, int channels,
                                                 size_t frames, const float* samples);
apus_status apus_audio_request_add_inpaint_region(apus_audio_request* request, double start, double end);
/* After every step: the clip's waveform as (min, max) pairs per bucket, `count` floats. */
typedef void (*apus_audio_preview_fn)(void* user, int index, int step, int steps, const float* peaks, size_t count);
apus_status apus_audio_request_set_preview(apus_audio_request* request, apus_audio_preview_fn preview, void* user);

typedef struct apus_audio_result apus_audio_result;
apus_status apus_audio_generate(const apus_audio_model* model, const apus_audio_request* request, int batch,
                                apus_progress_fn progress, void* user, apus_stop* stop, apus_audio_result** out);
int apus_audio_result_count(const apus_audio_result* result);
/* Output `index`: interleaved frames x channels samples (valid while the result lives). */
apus_status apus_audio_result_get(const apus_audio_result* result, int index, int* sample_rate, int* channels,
                                  size_t* frames, const float** samples, uint64_t* seed);
/* As `apus audio -o` writes it: .wav (16-bit PCM) or .flac by the extension, its settings in the
 * metadata. */
apus_status apus_audio_result_write(const apus_audio_result* result, int index, const char* path);
void apus_audio_result_free(apus_audio_result* result);

#ifdef __cplusplus
}
#endif

#endif /* APUS_C_H */
