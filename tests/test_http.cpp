// The server's HTTP transport (src/server/http.cpp) over raw loopback sockets, with the exact
// bytes a hostile or careless client sends: bodies never parsed as requests, slow clients cut off
// by their deadline without holding the server, connections bounded per address and in total,
// multipart bodies that say what is wrong with them.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "server/bodies.h"
#include "server/http.h"
#include "test_util.h"

namespace apus {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A TCP connection to the server from `from` (any 127/8 address is this machine's loopback).
int connect_from(int port, const char* from = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, from, &local.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) ADD_FAILURE() << "bind " << from;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ADD_FAILURE() << "connect";
  return fd;
}

void send_all(int fd, const std::string& bytes) {
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
}

// What the server sends until it closes the connection or `seconds` pass without a byte.
std::string read_until_quiet(int fd, double seconds) {
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(seconds * 1000)) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  return out;
}

// Whether the server closed the connection within `seconds` (what it sent before is dropped).
bool closed_within(int fd, double seconds) {
  const auto t0 = Clock::now();
  char buf[4096];
  while (since(t0) < seconds) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
  return false;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A transport with the routes the tests need: /health, an echo of the body's size, a slow route.
class Transport {
 public:
  explicit Transport(server::http::Limits limits = {}) : http_(limits) {
    http_.route("GET", "/health", [](const server::http::Request&, server::http::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    http_.route("GET", "/secret", [](const server::http::Request&, server::http::Response& res) {
      res.set_content("the secret route ran", "text/plain");
    });
    http_.route("POST", "/echo", [](const server::http::Request& req, server::http::Response& res) {
      res.set_content("got " + std::to_string(req.body.size()) + " bytes", "text/plain");
    });
    http_.route("GET", "/gone", [this](const server::http::Request& req, server::http::Response& res) {
      const auto t0 = Clock::now();
      while (!req.client_gone() && since(t0) < 10) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      noticed_gone_ = req.client_gone();
      res.set_content("late", "text/plain");
    });
    port_ = http_.listen("127.0.0.1", 0);
    EXPECT_GT(port_, 0);
  }
  int port() const { return port_; }
  bool noticed_gone() const { return noticed_gone_; }

 private:
  server::http::Server http_;
  int port_ = 0;
  std::atomic<bool> noticed_gone_{false};
};

// A request with an unknown method and a body, whose body holds a request of its own: the body is
// read as a body (the hidden request never runs) and the connection goes on with the next request.
TEST(HttpTransport, ABodyIsNeverParsedAsARequest) {
  Transport t;
  const std::string hidden = "GET /secret HTTP/1.1\r\nHost: x\r\n\r\n";
  const int fd = connect_from(t.port());
  send_all(fd, "QUERY /health HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(hidden.size()) + "\r\n\r\n" +
                   hidden + "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string answers = read_until_quiet(fd, 1.0);
  ::close(fd);
  EXPECT_EQ(count(answers, "HTTP/1.1 "), 2u) << answers;
  EXPECT_EQ(answers.rfind("HTTP/1.1 405 Method Not Allowed\r\n", 0), 0u) << answers;
  EXPECT_NE(answers.find("Allow: GET"), std::string::npos) << answers;
  EXPECT_NE(answers.find(R"({"status":"ok"})"), std::string::npos) << answers;
  EXPECT_EQ(answers.find("the secret route ran"), std::string::npos) << answers;
}

// What cannot be framed is answered once and the connection closed: nothing after it is parsed.
TEST(HttpTransport, WhatCannotBeFramedClosesTheConnection) {
  server::http::Limits limits;
  limits.max_body = 1000;
  Transport t(limits);
  const std::string hidden = "GET /secret HTTP/1.1\r\nHost: x\r\n\r\n";
  struct Case {
    std::string bytes, status;
  };
  const Case cases[] = {
      {"GARBAGE\r\n\r\n" + hidden, "HTTP/1.1 400 "},
      {"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345" + hidden,
       "HTTP/1.1 400 "},
      {"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n" + hidden, "HTTP/1.1 413 "},
      {"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n" + hidden, "HTTP/1.1 400 "},
      {"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n" + hidden, "HTTP/1.1 431 "},
  };
  for (const Case& c : cases) {
    const int fd = connect_from(t.port());
    send_all(fd, c.bytes);
    const std::string answers = read_until_quiet(fd, 1.0);
    ::close(fd);
    EXPECT_EQ(answers.rfind(c.status, 0), 0u) << c.bytes.substr(0, 80) << "\n" << answers;
    EXPECT_EQ(count(answers, "HTTP/1.1 "), 1u) << answers;
    EXPECT_NE(answers.find("Connection: close"), std::string::npos) << answers;
    EXPECT_EQ(answers.find("the secret route ran"), std::string::npos) << answers;
  }
  // A body within the limit, chunked or not, and a client that waits for 100 Continue.
  int fd = connect_from(t.port());
  send_all(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
  EXPECT_NE(read_until_quiet(fd, 0.5).find("got 5 bytes"), std::string::npos);
  ::close(fd);
  fd = connect_from(t.port());
  send_all(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n");
  EXPECT_EQ(read_until_quiet(fd, 0.5), "HTTP/1.1 100 Continue\r\n\r\n");
  send_all(fd, "wxyz");
  EXPECT_NE(read_until_quiet(fd, 0.5).find("got 4 bytes"), std::string::npos);
  ::close(fd);
}

// 200 connections sending a header line every 300 ms (a slowloris) from one address: beyond the
// per-address bound they are refused at once, the rest are cut off when their header deadline
// passes, and meanwhile every health check from another address is answered within a second.
TEST(HttpTransport, SlowClientsCannotStarveTheServer) {
  server::http::Limits limits;
  limits.header_seconds = 2;
  limits.max_connections_per_address = 32;
  Transport t(limits);
  std::vector<int> slow;
  for (int i = 0; i < 200; ++i) {
    slow.push_back(connect_from(t.port(), "127.0.0.2"));
    send_all(slow.back(), "GET /health HTTP/1.1\r\n");
  }
  std::atomic<bool> done{false};
  std::thread drip([&] {
    for (int line = 0; !done; ++line) {
      for (int fd : slow) ::send(fd, "X-Drip: 1\r\n", 11, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
  });
  double worst = 0;
  const auto t0 = Clock::now();
  while (since(t0) < 3) {
    const auto asked = Clock::now();
    const int fd = connect_from(t.port());
    send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    const std::string answer = read_until_quiet(fd, 2.0);
    ::close(fd);
    EXPECT_NE(answer.find(R"({"status":"ok"})"), std::string::npos) << answer;
    worst = std::max(worst, since(asked));
  }
  std::printf("[ measure ] /health under a 200-connection slowloris: slowest answer %.1f ms\n", worst * 1e3);
  EXPECT_LT(worst, 1.0);
  // Every slow connection is closed by now: refused ones at once (with a 503), held ones at
  // their 2 s deadline however steadily they drip.
  size_t refused = 0;
  for (int fd : slow) {
    const std::string answer = read_until_quiet(fd, 0.05);
    refused += answer.rfind("HTTP/1.1 503 ", 0) == 0;
    EXPECT_TRUE(closed_within(fd, 0.5));
  }
  EXPECT_EQ(refused, 200u - 32u);
  done = true;
  drip.join();
  for (int fd : slow) ::close(fd);
}

// The total bound: connections beyond it are answered 503 and closed, whatever their address.
TEST(HttpTransport, ConnectionsAreBoundedInTotal) {
  server::http::Limits limits;
  limits.max_connections = 4;
  Transport t(limits);
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) held.push_back(connect_from(t.port(), ("127.0.0." + std::to_string(10 + i)).c_str()));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int extra = connect_from(t.port(), "127.0.0.20");
  const std::string answer = read_until_quiet(extra, 1.0);
  EXPECT_EQ(answer.rfind("HTTP/1.1 503 ", 0), 0u) << answer;
  EXPECT_NE(answer.find("too many connections"), std::string::npos) << answer;
  ::close(extra);
  ::close(held.front());
  held.erase(held.begin());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int again = connect_from(t.port(), "127.0.0.20");
  send_all(again, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(read_until_quiet(again, 0.5).find(R"({"status":"ok"})"), std::string::npos);
  ::close(again);
  for (int fd : held) ::close(fd);
}

// A handler learns that its client hung up (no /proc, the socket itself).
TEST(HttpTransport, AHandlerSeesItsClientHangUp) {
  Transport t;
  const int fd = connect_from(t.port());
  send_all(fd, "GET /gone HTTP/1.1\r\nHost: x\r\n\r\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = Clock::now();
  ::close(fd);
  while (!t.noticed_gone() && since(t0) < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(t.noticed_gone());
}

TEST(Multipart, PartsInOrderWithTheirNames) {
  const std::string body =
      "preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na \"fox\"\r\n"
      "--XyZ\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n"
      "\x89PNG\r\n--XyZnot-a-boundary\r\n--XyZ\r\ncontent-disposition: FORM-DATA; name=image; "
      "filename=\"b\\\".png\"\r\n\r\n"
      "\r\n--XyZ--\r\nepilogue";
  const auto parts = server::parse_multipart("multipart/form-data; boundary=\"XyZ\"", body);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].name, "prompt");
  EXPECT_EQ(parts[0].content, "a \"fox\"");
  EXPECT_EQ(parts[1].name, "image");
  EXPECT_EQ(parts[1].filename, "a.png");
  EXPECT_EQ(parts[1].content_type, "image/png");
  EXPECT_EQ(parts[1].content, "\x89PNG\r\n--XyZnot-a-boundary");
  EXPECT_EQ(parts[2].filename, "b\".png");
  EXPECT_EQ(parts[2].content, "");
}

TEST(Multipart, AMalformedBodySaysWhatIsWrong) {
  const std::string type = "multipart/form-data; boundary=b";
  const std::string first = "--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhello";
  struct Case {
    std::string type, body;
    std::vector<std::string> fragments;
  };
  const Case cases[] = {
      {type, first, {"part 1 ('prompt'): no boundary closes it: the body is truncated (", " bytes"}},
      {type, first + "\r\n--b", {"part 2: the body ends after its boundary without the closing '--b--'"}},
      {type, "--b\r\nContent-Disposition: form-data; name=\"x\"\r\n", {"part 1: its headers never end"}},
      {type,
       "--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--",
       {"part 1: no Content-Disposition: form-data with a name"}},
      {type,
       "--b\r\nContent-Disposition: attachment; name=\"x\"\r\n\r\nx\r\n--b--",
       {"Content-Disposition is 'attachment"}},
      {type, "--b\r\nContent-Disposition: form-data; name=\"x\r\n\r\nx\r\n--b--", {"opens a quote it never closes"}},
      {type, "no boundary at all", {"no boundary line '--b'"}},
      {"multipart/form-data", "--b--", {"Content-Type names no boundary"}},
      {"application/json", "{}", {"expected a multipart/form-data body, not Content-Type 'application/json'"}},
  };
  for (const Case& c : cases) test::expect_error([&] { server::parse_multipart(c.type, c.body); }, c.fragments);
}

}  // namespace
}  // namespace apus
