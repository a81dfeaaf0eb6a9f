#include "dist/requests.h"

#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include "core/error.h"

namespace apus::dist {

// A request gaining a member must carry it to the other ranks here (or say why it need not);
// these sizes are what the members add up to on x86-64 with libstdc++.
#if defined(__x86_64__) && defined(__GLIBCXX__)
static_assert(sizeof(ImageRequest) == 352, "ImageRequest changed: carry the new member in encode() and decode()");
static_assert(sizeof(AudioRequest) == 336, "AudioRequest changed: carry the new member in encode() and decode()");
static_assert(sizeof(ImageResult) == 112, "ImageResult changed: carry the new member in encode() and decode()");
static_assert(sizeof(AudioResult) == 104, "AudioResult changed: carry the new member in encode() and decode()");
#endif

namespace {

class Writer {
 public:
  template <typename T> void put(const T& v) {
    if constexpr (std::is_same_v<T, std::string>) {
      put(uint64_t(v.size()));
      out_.append(v);
    } else if constexpr (std::is_same_v<T, Rgb8Image>) {
      put(v.width), put(v.height), put(v.rgb);
    } else if constexpr (std::is_same_v<T, Inpainting>) {
      put(v.image), put(v.mask), put(v.strength);
    } else if constexpr (std::is_same_v<T, AudioClip>) {
      put(v.sample_rate), put(v.channels), put(v.samples);
    } else if constexpr (std::is_same_v<T, Lora>) {
      put(v.file), put(v.scale);
    } else if constexpr (std::is_same_v<T, StageTime>) {
      put(v.name), put(v.stage), put(v.seconds);
    } else {
      static_assert(std::is_arithmetic_v<T>);
      out_.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
  }
  template <typename T> void put(const std::optional<T>& v) {
    put(uint8_t(v.has_value()));
    if (v) put(*v);
  }
  template <typename T> void put(const std::vector<T>& v) {
    put(uint64_t(v.size()));
    if constexpr (std::is_arithmetic_v<T>) out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
    else
      for (const T& e : v) put(e);
  }
  template <typename A, typename B> void put(const std::pair<A, B>& v) { put(v.first), put(v.second); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& bytes) : in_(bytes) {}
  template <typename T> void get(T& v) {
    if constexpr (std::is_same_v<T, std::string>) {
      const uint64_t n = size();
      v.assign(take(n), n);
    } else if constexpr (std::is_same_v<T, Rgb8Image>) {
      get(v.width), get(v.height), get(v.rgb);
    } else if constexpr (std::is_same_v<T, Inpainting>) {
      get(v.image), get(v.mask), get(v.strength);
    } else if constexpr (std::is_same_v<T, AudioClip>) {
      get(v.sample_rate), get(v.channels), get(v.samples);
    } else if constexpr (std::is_same_v<T, Lora>) {
      get(v.file), get(v.scale);
    } else if constexpr (std::is_same_v<T, StageTime>) {
      get(v.name), get(v.stage), get(v.seconds);
    } else {
      static_assert(std::is_arithmetic_v<T>);
      std::memcpy(&v, take(sizeof v), sizeof v);
    }
  }
  template <typename T> void get(std::optional<T>& v) {
    uint8_t given = 0;
    get(given);
    v.reset();
    if (given) get(v.emplace());
  }
  template <typename T> void get(std::vector<T>& v) {
    const uint64_t n = size();
    if constexpr (std::is_arithmetic_v<T>) {
      v.resize(n);
      std::memcpy(v.data(), take(n * sizeof(T)), n * sizeof(T));
    } else {
      v.assign(n, T{});
      for (T& e : v) get(e);
    }
  }
  template <typename A, typename B> void get(std::pair<A, B>& v) { get(v.first), get(v.second); }
  bool flag() {
    uint8_t f = 0;
    get(f);
    return f != 0;
  }
  void done() const { APUS_CHECK(at_ == in_.size(), "the bytes from another rank: ", in_.size() - at_, " left over"); }

 private:
  const std::string& in_;
  size_t at_ = 0;
  uint64_t size() {
    uint64_t n = 0;
    get(n);
    APUS_CHECK(n <= in_.size() - at_, "the bytes from another rank end early (", n, " items past the end)");
    return n;
  }
  const char* take(size_t bytes) {
    APUS_CHECK(bytes <= in_.size() - at_, "the bytes from another rank end early");
    at_ += bytes;
    return in_.data() + at_ - bytes;
  }
};

// What every request carries beside its settings: whether it has previews and a finish flag.
template <typename Request> void put_hooks(Writer& w, const Request& r) {
  w.put(uint8_t(bool(r.preview))), w.put(uint8_t(r.finish_steps != nullptr)), w.put(uint8_t(r.trace));
}
template <typename Request> void get_hooks(Reader& in, Request& r, const std::atomic<bool>* finish) {
  if (in.flag()) r.preview = [](const Preview&) {};
  if (in.flag()) r.finish_steps = finish;
  r.trace = in.flag();
}

}  // namespace

std::string encode(const std::vector<ImageRequest>& batch) {
  Writer w;
  w.put(uint64_t(batch.size()));
  for (const ImageRequest& r : batch) {
    w.put(r.prompt), w.put(r.width), w.put(r.height), w.put(r.references), w.put(r.inpaint), w.put(r.steps);
    w.put(r.cfg), w.put(r.negative_prompt), w.put(r.seed), w.put(r.noise_index), w.put(r.noise_file);
    w.put(uint8_t(r.fp32));
    w.put(r.loras);
    put_hooks(w, r);
  }
  return w.take();
}

std::vector<ImageRequest> decode_images(const std::string& bytes, const std::atomic<bool>* finish) {
  Reader in(bytes);
  std::vector<ImageRequest> batch;
  uint64_t n = 0;
  in.get(n);
  for (uint64_t i = 0; i < n; ++i) {
    ImageRequest& r = batch.emplace_back();
    in.get(r.prompt), in.get(r.width), in.get(r.height), in.get(r.references), in.get(r.inpaint), in.get(r.steps);
    in.get(r.cfg), in.get(r.negative_prompt), in.get(r.seed), in.get(r.noise_index), in.get(r.noise_file);
    r.fp32 = in.flag();
    in.get(r.loras);
    get_hooks(in, r, finish);
  }
  in.done();
  return batch;
}

std::string encode(const std::vector<AudioRequest>& batch) {
  Writer w;
  w.put(uint64_t(batch.size()));
  for (const AudioRequest& r : batch) {
    w.put(r.prompt), w.put(r.seconds), w.put(r.steps), w.put(r.seed), w.put(uint8_t(r.fp32));
    w.put(r.chunked_decode), w.put(r.cfg), w.put(r.apg), w.put(r.negative_prompt), w.put(r.init_audio);
    w.put(r.init_noise_level), w.put(r.inpaint_audio), w.put(r.inpaint_regions), w.put(r.loras);
    put_hooks(w, r);
  }
  return w.take();
}

std::vector<AudioRequest> decode_audio(const std::string& bytes, const std::atomic<bool>* finish) {
  Reader in(bytes);
  std::vector<AudioRequest> batch;
  uint64_t n = 0;
  in.get(n);
  for (uint64_t i = 0; i < n; ++i) {
    AudioRequest& r = batch.emplace_back();
    in.get(r.prompt), in.get(r.seconds), in.get(r.steps), in.get(r.seed);
    r.fp32 = in.flag();
    in.get(r.chunked_decode), in.get(r.cfg), in.get(r.apg), in.get(r.negative_prompt), in.get(r.init_audio);
    in.get(r.init_noise_level), in.get(r.inpaint_audio), in.get(r.inpaint_regions), in.get(r.loras);
    get_hooks(in, r, finish);
  }
  in.done();
  return batch;
}

namespace {

void put_result(Writer& w, const ImageResult& r) {
  w.put(r.width), w.put(r.height), w.put(r.seed), w.put(r.steps), w.put(r.steps_run), w.put(r.cfg), w.put(r.rgb);
  w.put(r.stages), w.put(r.trace);
}
void get_result(Reader& in, ImageResult& r) {
  in.get(r.width), in.get(r.height), in.get(r.seed), in.get(r.steps), in.get(r.steps_run), in.get(r.cfg);
  in.get(r.rgb), in.get(r.stages), in.get(r.trace);
}
void put_result(Writer& w, const AudioResult& r) {
  w.put(r.sample_rate), w.put(r.channels), w.put(r.samples), w.put(r.seed), w.put(r.prompt_tokens);
  w.put(r.stages), w.put(r.trace);
}
void get_result(Reader& in, AudioResult& r) {
  in.get(r.sample_rate), in.get(r.channels), in.get(r.samples), in.get(r.seed), in.get(r.prompt_tokens);
  in.get(r.stages), in.get(r.trace);
}

template <typename Result> std::string encode_results(const std::vector<Result>& results) {
  Writer w;
  w.put(uint64_t(results.size()));
  for (const Result& r : results) put_result(w, r);
  return w.take();
}

// Appended to `results`.
template <typename Result> void decode_results(const std::string& bytes, std::vector<Result>& results) {
  Reader in(bytes);
  uint64_t n = 0;
  in.get(n);
  for (uint64_t i = 0; i < n; ++i) get_result(in, results.emplace_back());
  in.done();
}

}  // namespace

std::string encode(const std::vector<ImageResult>& results) { return encode_results(results); }
std::string encode(const std::vector<AudioResult>& results) { return encode_results(results); }
void decode(const std::string& bytes, std::vector<ImageResult>& results) { decode_results(bytes, results); }
void decode(const std::string& bytes, std::vector<AudioResult>& results) { decode_results(bytes, results); }

}  // namespace apus::dist
