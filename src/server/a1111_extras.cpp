// AUTOMATIC1111's extras routes (extra-single-image, extra-batch-images): its Upscale
// postprocessing with the upscalers it has without model files. "None" leaves the image as it
// is; "Lanczos" and "Nearest" are Pillow's resizes to int(side x scale), then (as A1111's
// Upscaler.upscale) a Lanczos resize to the sides floored to multiples of 8; "scale to" with crop
// pastes that centred on a black canvas of the sides asked. A second upscaler blends in as
// Pillow's Image.blend. Face restoration (GFPGAN, CodeFormer) needs models apus does not have and
// is refused when asked for; upscale_first and show_extras_results change nothing on these
// routes in A1111 either and are accepted.
#include <algorithm>
#include <charconv>
#include <cmath>

#include "io/media/image.h"
#include "io/media/png.h"
#include "io/media/resize.h"
#include "server/server_impl.h"

namespace apus::server {

namespace {

const char* const kUpscalers[] = {"None", "Lanczos", "Nearest"};

// A float as Python's str() writes it (A1111's infotext): the shortest digits, ".0" if whole.
std::string python_float(double v) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, v).ptr;
  std::string s(text, end);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string upscaler_field(const Fields& f, const char* field) {
  const std::string name = f.string(field, "None");
  if (std::find(std::begin(kUpscalers), std::end(kUpscalers), name) == std::end(kUpscalers))
    refuse(400,
           std::string("'") + field + "' is '" + name +
               "': apus has the upscalers None, Lanczos and Nearest (GET /sdapi/v1/upscalers)",
           field);
  return name;
}

// What an extras request asks of each image.
struct Extras {
  std::string upscaler_1, upscaler_2;
  double upscaler_2_visibility = 0;
  int resize_mode = 0;
  double scale = 2;
  int to_width = 512, to_height = 512;
  bool crop = true;
};

Extras extras_request(const Fields& f) {
  for (const char* face : {"gfpgan_visibility", "codeformer_visibility"})
    if (f.number(face, 0.0) != 0)
      refuse(400,
             std::string("'") + face + "' asks for face restoration, which needs GFPGAN or CodeFormer models apus " +
                 "does not have (0 leaves it off)",
             face);
  const double weight = f.number("codeformer_weight", 0.0);  // unused while CodeFormer is off, as in A1111
  if (!std::isfinite(weight)) refuse(400, "'codeformer_weight' must be a finite number", "codeformer_weight");
  f.boolean("upscale_first", false);
  f.boolean("show_extras_results", true);
  Extras e;
  e.upscaler_1 = upscaler_field(f, "upscaler_1");
  e.upscaler_2 = upscaler_field(f, "upscaler_2");
  e.upscaler_2_visibility = f.number("extras_upscaler_2_visibility", 0.0);
  if (!(e.upscaler_2_visibility >= 0 && e.upscaler_2_visibility <= 1))
    refuse(400, "'extras_upscaler_2_visibility' must be in [0, 1]", "extras_upscaler_2_visibility");
  e.resize_mode = int(f.integer("resize_mode", 0, 0, 1));
  e.scale = f.number("upscaling_resize", 2.0);
  if (!(std::isfinite(e.scale) && e.scale > 0 && e.scale <= 16))
    refuse(400, "'upscaling_resize' must be a scale in (0, 16]", "upscaling_resize");
  e.to_width = int(f.integer("upscaling_resize_w", 512, 1, 16384));
  e.to_height = int(f.integer("upscaling_resize_h", 512, 1, 16384));
  e.crop = f.boolean("upscaling_crop", true);
  return e;
}

// One upscaler's pass, as A1111's Upscale script runs it (upscale mode, scale, crop).
Rgb8Image upscaled(const Rgb8Image& image, const Extras& e, const std::string& upscaler) {
  const double scale =
      e.resize_mode == 1 ? std::max(double(e.to_width) / image.width, double(e.to_height) / image.height) : e.scale;
  const int64_t dest_w = int64_t(std::floor(image.width * scale / 8)) * 8,
                dest_h = int64_t(std::floor(image.height * scale / 8)) * 8;
  const int64_t step_w = int64_t(image.width * scale), step_h = int64_t(image.height * scale);
  if (dest_w < 1 || dest_h < 1 || dest_w * dest_h > kMaxDecodedPixels)
    refuse(400,
           "the " + std::to_string(image.width) + "x" + std::to_string(image.height) + " image scaled by " +
               python_float(scale) + " would be " + std::to_string(dest_w) + "x" + std::to_string(dest_h) +
               " (sides floored to multiples of 8, at most " + std::to_string(kMaxDecodedPixels) + " pixels)",
           e.resize_mode == 1 ? "upscaling_resize_w" : "upscaling_resize");
  Rgb8Image out = upscaler == "Lanczos"   ? resize_lanczos(image, int(step_w), int(step_h))
                  : upscaler == "Nearest" ? resize_nearest(image, int(step_w), int(step_h))
                                          : image;
  if (out.width != dest_w || out.height != dest_h) out = resize_lanczos(out, int(dest_w), int(dest_h));
  if (e.resize_mode == 1 && e.crop)
    out = pasted(out, e.to_width, e.to_height, e.to_width / 2 - out.width / 2, e.to_height / 2 - out.height / 2);
  return out;
}

// Pillow's Image.blend: a + alpha (b - a) in single precision, truncated.
Rgb8Image blended(const Rgb8Image& a, const Rgb8Image& b, double alpha) {
  Rgb8Image out = a;
  const float f = float(alpha);
  for (size_t i = 0; i < out.rgb.size(); ++i)
    out.rgb[i] = uint8_t(float(a.rgb[i]) + f * float(int(b.rgb[i]) - int(a.rgb[i])));
  return out;
}

// An image through the request's upscaling, its infotext entries (A1111's order) added to info.
Rgb8Image postprocessed(const Rgb8Image& image, const Extras& e,
                        std::vector<std::pair<std::string, std::string>>& info) {
  if (e.upscaler_1 == "None") return image;
  if (e.resize_mode == 1)
    info.emplace_back("Postprocess upscale to", std::to_string(e.to_width) + "x" + std::to_string(e.to_height));
  else info.emplace_back("Postprocess upscale by", python_float(e.scale));
  Rgb8Image out = upscaled(image, e, e.upscaler_1);
  if (e.resize_mode == 1 && e.crop)
    info.emplace_back("Postprocess crop to", std::to_string(out.width) + "x" + std::to_string(out.height));
  info.emplace_back("Postprocess upscaler", e.upscaler_1);
  if (e.upscaler_2 != "None" && e.upscaler_2_visibility > 0) {
    out = blended(out, upscaled(image, e, e.upscaler_2), e.upscaler_2_visibility);
    info.emplace_back("Postprocess upscaler 2", e.upscaler_2);
  }
  return out;
}

std::string infotext_of(const std::vector<std::pair<std::string, std::string>>& info) {
  std::string s;
  for (const auto& [key, value] : info) s += (s.empty() ? "" : ", ") + key + ": " + value;
  return s;
}

// One base64 image through the extras: a PNG carrying the input PNG's text and "postprocessing"
// (as A1111's answer does), as base64.
std::string extras_image(const Json& value, const std::string& what, const char* param, const Extras& e,
                         std::string& infotext) {
  const std::string bytes = a1111_image(value, what, param);
  Rgb8Image image;
  std::vector<std::pair<std::string, std::string>> text;
  try {
    if (bytes.rfind("\x89PNG", 0) == 0) {
      PngImage png = decode_png(bytes, what);
      image = {png.width, png.height, std::move(png.rgb)};
      text = std::move(png.text);
    } else {
      image = decode_image(bytes, what);
    }
  } catch (const Error& err) {
    refuse(400, err.what(), param);
  }
  std::vector<std::pair<std::string, std::string>> info;
  const Rgb8Image out = postprocessed(image, e, info);
  infotext = infotext_of(info);
  std::erase_if(text, [](const auto& entry) { return entry.first == "postprocessing"; });
  if (!infotext.empty()) text.emplace_back("postprocessing", infotext);
  return base64(encode_png(out.width, out.height, out.rgb, text, what));
}

std::string html_info(const std::string& infotext) {
  std::string escaped;
  for (const char c : infotext) {
    switch (c) {
      case '&':
        escaped += "&amp;";
        break;
      case '<':
        escaped += "&lt;";
        break;
      case '>':
        escaped += "&gt;";
        break;
      case '"':
        escaped += "&quot;";
        break;
      case '\'':
        escaped += "&#x27;";
        break;
      default:
        escaped += c;
    }
  }
  return "<p>" + escaped + "</p>";
}

}  // namespace

void Server::Impl::a1111_extra_single(const http::Request& req, http::Response& res) {
  const Json in = parse_body(req);
  const Fields f{in};
  const Extras e = extras_request(f);
  if (!f.has("image")) refuse(400, "'image' must hold the image to process, as base64", "image");
  std::string infotext;
  const std::string image = extras_image(in["image"], "image", "image", e, infotext);
  res.set_content(dump(Json{{"html_info", html_info(infotext)}, {"image", image}}), "application/json");
}

void Server::Impl::a1111_extra_batch(const http::Request& req, http::Response& res) {
  const Json in = parse_body(req);
  const Fields f{in};
  const Extras e = extras_request(f);
  if (!f.has("imageList") || !in["imageList"].is_array())
    refuse(400, "'imageList' must be a list of {\"data\": base64, \"name\"}", "imageList");
  Json images = Json::array();
  std::string infotext;
  for (size_t i = 0; i < in["imageList"].size(); ++i) {
    const Json& item = in["imageList"][i];
    const std::string what = "imageList[" + std::to_string(i) + "]";
    if (!item.is_object() || !item.contains("data"))
      refuse(400, "'" + what + "' must be {\"data\": base64, \"name\"}", "imageList");
    images.push_back(extras_image(item["data"], what + ".data", "imageList", e, infotext));
  }
  res.set_content(dump(Json{{"html_info", html_info(infotext)}, {"images", images}}), "application/json");
}

}  // namespace apus::server
