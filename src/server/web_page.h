#pragma once
// The page `apus serve` answers GET / with: plain HTML, CSS and JS in src/server/page.html,
// compiled in as one string (tools/cmake/embed_page.cmake), no external requests. It lists the
// models, submits jobs through POST /v1/jobs, follows their progress and shows the image or plays
// the clip, keeping the last results in a gallery with downloads.
namespace apus::server {

const char* web_page();

}  // namespace apus::server
