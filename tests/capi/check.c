/* The C ABI (include/apus/apus_c.h) from a program compiled as C: renders a klein batch and a
 * Stable Audio 3 clip from the tiny fixtures and writes them where tests/capi/check.sh compares
 * them with the CLI's files; prints the messages of the refusals it provokes for the script to
 * compare with the CLI's; checks the callbacks, both ways of cancelling and the handles' misuse.
 * Usage: capi_check KLEIN_DIR SA3_DIR OUT_DIR */
#include <apus/apus_c.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
#define EXPECT(cond)                                                    \
  do {                                                                  \
    if (!(cond)) {                                                      \
      fprintf(stderr, "capi check: line %d: %s\n", __LINE__, #cond);    \
      ++failures;                                                       \
    }                                                                   \
  } while (0)

struct Seen {
  int steps, previews[2], cancel_at;
};

static int on_progress(void* user, const char* line) {
  struct Seen* seen = (struct Seen*)user;
  if (strncmp(line, "step ", 5) == 0) ++seen->steps;
  return seen->cancel_at > 0 && seen->steps >= seen->cancel_at;
}

static void on_image_preview(void* user, int index, int step, int steps, int width, int height, const uint8_t* rgb) {
  struct Seen* seen = (struct Seen*)user;
  if (index >= 0 && index < 2 && step >= 1 && step <= steps && width > 0 && height > 0 && rgb) ++seen->previews[index];
}

static void on_audio_preview(void* user, int index, int step, int steps, const float* peaks, size_t count) {
  struct Seen* seen = (struct Seen*)user;
  if (index == 0 && step >= 1 && step <= steps && peaks && count > 0) ++seen->previews[0];
}

static void path_in(char* out, size_t size, const char* dir, const char* name) {
  snprintf(out, size, "%s/%s", dir, name);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s KLEIN_DIR SA3_DIR OUT_DIR\n", argv[0]);
    return 2;
  }
  const char *klein = argv[1], *sa3 = argv[2], *out = argv[3];
  char path[4096];
  EXPECT(apus_c_abi_version() == APUS_C_ABI_VERSION);
  EXPECT(strlen(apus_version()) > 0);

  apus_image_model* none = NULL;
  path_in(path, sizeof path, out, "no-such-model");
  EXPECT(apus_image_model_open(path, APUS_WEIGHTS_RESIDENT, NULL, &none) == APUS_ERROR && none == NULL);
  EXPECT(strstr(apus_last_error(), path) != NULL);
  printf("missing: %s\n", apus_last_error());

  EXPECT(apus_image_model_open_parts(klein, NULL, NULL, NULL, NULL, (apus_quant)7, APUS_WEIGHTS_RESIDENT, NULL, &none) ==
             APUS_ERROR &&
         none == NULL);
  EXPECT(strstr(apus_last_error(), "quant 7") != NULL);
  /* The fp8 tier opens on every CPU (its codes go through the bf16 GEMM). */
  apus_image_model* fp8 = NULL;
  EXPECT(apus_image_model_open_parts(klein, NULL, NULL, NULL, NULL, APUS_QUANT_FP8, APUS_WEIGHTS_RESIDENT, NULL, &fp8) ==
             APUS_OK &&
         fp8 != NULL);
  apus_image_model_free(fp8);

  apus_image_model* model = NULL;
  if (apus_image_model_open(klein, APUS_WEIGHTS_RESIDENT, "cpu", &model) != APUS_OK) {
    fprintf(stderr, "capi check: %s\n", apus_last_error());
    return 1;
  }
  EXPECT(strlen(apus_image_model_label(model)) > 0);
  EXPECT(strcmp(apus_last_error(), "") == 0);

  struct Seen seen = {0, {0, 0}, 0};
  apus_image_request* r = apus_image_request_new("a fox");
  EXPECT(r != NULL);
  EXPECT(apus_image_request_set_size(r, 32, 32) == APUS_OK);
  EXPECT(apus_image_request_set_steps(r, 2) == APUS_OK);
  EXPECT(apus_image_request_set_seed(r, 5) == APUS_OK);
  EXPECT(apus_image_request_set_preview(r, on_image_preview, &seen) == APUS_OK);
  apus_image_result* images = NULL;
  EXPECT(apus_image_generate(model, r, 2, on_progress, &seen, NULL, &images) == APUS_OK);
  EXPECT(apus_image_result_count(images) == 2);
  EXPECT(seen.steps == 2 && seen.previews[0] == 2 && seen.previews[1] == 2);
  int width = 0, height = 0;
  const uint8_t* rgb = NULL;
  uint64_t seed = 0;
  EXPECT(apus_image_result_get(images, 1, &width, &height, &rgb, &seed) == APUS_OK);
  EXPECT(width == 32 && height == 32 && rgb != NULL && seed == 6);
  EXPECT(apus_image_result_get(images, 2, NULL, NULL, NULL, NULL) == APUS_ERROR);
  for (int i = 0; i < 2; ++i) {
    char name[32];
    snprintf(name, sizeof name, "c-%d.png", i + 1);
    path_in(path, sizeof path, out, name);
    EXPECT(apus_image_result_write(images, i, path, 95) == APUS_OK);
  }
  path_in(path, sizeof path, out, "c.gif");
  EXPECT(apus_image_result_write(images, 0, path, 95) == APUS_ERROR);
  apus_image_result_free(images);

  /* Refused as the CLI refuses it, with its message. */
  EXPECT(apus_image_request_set_size(r, 17, 32) == APUS_OK);
  EXPECT(apus_image_generate(model, r, 1, NULL, NULL, NULL, &images) == APUS_ERROR && images == NULL);
  printf("width: %s\n", apus_last_error());
  EXPECT(apus_image_request_set_size(r, 32, 32) == APUS_OK);
  EXPECT(apus_image_generate(model, r, 0, NULL, NULL, NULL, &images) == APUS_ERROR);

  /* Cancelled: by the progress callback after the first step, and by a stop flag set before. */
  seen.steps = 0;
  seen.cancel_at = 1;
  EXPECT(apus_image_generate(model, r, 1, on_progress, &seen, NULL, &images) == APUS_CANCELLED && images == NULL);
  EXPECT(seen.steps == 1);
  EXPECT(strcmp(apus_last_error(), "cancelled") == 0);
  apus_stop* stop = apus_stop_new();
  apus_stop_now(stop);
  EXPECT(apus_image_generate(model, r, 1, NULL, NULL, stop, &images) == APUS_CANCELLED);
  apus_stop_free(stop);
  apus_image_request_free(r);
  apus_image_model_free(model);

  EXPECT(apus_image_request_set_steps(NULL, 2) == APUS_ERROR);
  EXPECT(apus_image_request_new(NULL) == NULL);
  apus_image_request_free(NULL);
  apus_image_result_free(NULL);
  apus_image_model_free(NULL);
  apus_stop_free(NULL);

  apus_audio_model* audio_model = NULL;
  if (apus_audio_model_open(sa3, APUS_WEIGHTS_RESIDENT, NULL, &audio_model) != APUS_OK) {
    fprintf(stderr, "capi check: %s\n", apus_last_error());
    return 1;
  }
  struct Seen heard = {0, {0, 0}, 0};
  apus_audio_request* a = apus_audio_request_new("rain");
  EXPECT(apus_audio_request_set_seconds(a, 1) == APUS_OK);
  EXPECT(apus_audio_request_set_steps(a, 2) == APUS_OK);
  EXPECT(apus_audio_request_set_seed(a, 3) == APUS_OK);
  EXPECT(apus_audio_request_set_cfg(a, 4, 1) == APUS_OK);
  EXPECT(apus_audio_request_set_negative_prompt(a, "wind") == APUS_OK);
  EXPECT(apus_audio_request_set_preview(a, on_audio_preview, &heard) == APUS_OK);
  apus_audio_result* clips = NULL;
  EXPECT(apus_audio_generate(audio_model, a, 1, on_progress, &heard, NULL, &clips) == APUS_OK);
  EXPECT(heard.steps == 2 && heard.previews[0] == 2);
  int rate = 0, channels = 0;
  size_t frames = 0;
  const float* samples = NULL;
  EXPECT(apus_audio_result_get(clips, 0, &rate, &channels, &frames, &samples, &seed) == APUS_OK);
  EXPECT(rate > 0 && channels == 2 && frames > 0 && samples != NULL && seed == 3);
  path_in(path, sizeof path, out, "c.wav");
  EXPECT(apus_audio_result_write(clips, 0, path) == APUS_OK);
  path_in(path, sizeof path, out, "c.mp3");
  EXPECT(apus_audio_result_write(clips, 0, path) == APUS_ERROR);
  apus_audio_result_free(clips);
  EXPECT(apus_audio_request_set_seconds(a, 100000) == APUS_OK);
  EXPECT(apus_audio_generate(audio_model, a, 1, NULL, NULL, NULL, &clips) == APUS_ERROR);
  printf("seconds: %s\n", apus_last_error());
  apus_audio_request_free(a);
  apus_audio_model_free(audio_model);

  if (failures) return 1;
  printf("capi check: passed\n");
  return 0;
}
