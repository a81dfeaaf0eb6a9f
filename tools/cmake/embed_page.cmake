# Writes OUT, a C++ source defining apus::server::web_page(), from the HTML file IN (the page
# `apus serve` answers GET / with): the page is edited as HTML and compiled in as one string.
#   cmake -DIN=<page.html> -DOUT=<web_page.cpp> -P embed_page.cmake
file(READ ${IN} page)
string(FIND "${page}" ")apus_page\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} holds the raw string's end marker )apus_page\"")
endif()
file(WRITE ${OUT}.new "// Generated from src/server/page.html by tools/cmake/embed_page.cmake: edit the HTML.
#include \"server/web_page.h\"

namespace apus::server {

const char* web_page() {
  return R\"apus_page(${page})apus_page\";
}

}  // namespace apus::server
")
file(COPY_FILE ${OUT}.new ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.new)
