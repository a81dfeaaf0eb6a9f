#pragma once
// libjpeg reports fatal errors by longjmp: the reader and the writer (image.cpp, image_encode.cpp)
// set `jump` in their own frame and turn `message` into an Error once no libjpeg frame is left on
// the stack.
#include <csetjmp>
#include <cstdio>

#include <jpeglib.h>

namespace apus {

struct JpegErrors {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

// libjpeg's error manager reporting into `e` (the message kept, then the jump).
inline jpeg_error_mgr* jpeg_errors(JpegErrors& e) {
  jpeg_std_error(&e.mgr);
  e.mgr.error_exit = [](j_common_ptr c) {
    auto* errors = reinterpret_cast<JpegErrors*>(c->err);
    (*c->err->format_message)(c, errors->message);
    std::longjmp(errors->jump, 1);
  };
  return &e.mgr;
}

}  // namespace apus
