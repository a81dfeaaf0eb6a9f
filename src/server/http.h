#pragma once
// The server's HTTP/1.1 transport, on Boost.Beast's parser and Asio's sockets. Reading a request
// never holds a thread: sockets are read asynchronously on one I/O thread, under deadlines that
// cover a whole request line and header block (a client sending a header line a second is cut
// off when the deadline passes, not kept alive by each byte), and a body at a minimum rate.
// Only a complete request reaches a handler thread. Every request's body is read (or the
// connection closed) before anything else is parsed from the connection, so a body can never be
// taken for a second request. Connections are bounded in total and per client address.
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace apus::server::http {

struct Request {
  std::string method, target, path;  // path: the target without its query
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::vector<std::string> matches;  // the route pattern's groups; [0] is the whole path
  std::string remote_address;
  int socket = -1;  // the connection, for client_gone()

  // A header's value ("" when absent); names compare without case.
  std::string header(const std::string& name) const;
  // The first value of a parameter in the target's query (?a=1&b=x%20y), percent-decoded, '+'
  // as a space; nullopt when absent.
  std::optional<std::string> query(const std::string& name) const;
  // The client has closed its connection (its FIN or a reset seen by the kernel): nobody waits
  // for the answer any more.
  bool client_gone() const;
};

// A body sent in pieces as they come. next() must not wait: it returns the next piece, an empty
// string when there is nothing yet (it is asked again shortly, no thread held meanwhile), or
// nullopt at the end. abandoned() runs when the client goes away first.
struct Stream {
  std::function<std::optional<std::string>()> next;
  std::function<void()> abandoned;
};

struct Response {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string content_type = "text/plain";
  std::optional<Stream> stream;

  void set_content(std::string content, std::string type) {
    body = std::move(content);
    content_type = std::move(type);
  }
  void set_header(const std::string& name, const std::string& value) { headers.emplace_back(name, value); }
};

using Handler = std::function<void(const Request&, Response&)>;

struct Limits {
  size_t max_body = size_t(32) << 20;
  size_t max_header = size_t(16) << 10;  // the request line and every header together
  // The whole request line and header block, the wait for it on a kept-alive connection included.
  double header_seconds = 10;
  // A body (and an answer) must move at least this fast, after header_seconds of grace.
  double min_bytes_per_second = 64 << 10;
  size_t max_connections = 512;
  size_t max_connections_per_address = 64;
  size_t threads = 16;  // handlers running at once
};

class Server {
 public:
  explicit Server(Limits limits);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // `pattern` is an ECMAScript regular expression matched against the whole path.
  void route(const std::string& method, const std::string& pattern, Handler handler);

  // Runs before routing; returns true when it answered (a missing key) and the route must not run.
  std::function<bool(const Request&, Response&)> before;
  // Runs on every answer, the transport's own refusals included (CORS headers).
  std::function<void(const Request&, Response&)> after;
  // Shapes the transport's own refusals (no route 404, wrong method 405, body too large 413,
  // malformed request 400, too many connections 503) and a handler's exceptions.
  std::function<void(Response&, int status, const std::string& message)> refusal;
  std::function<void(Response&, std::exception_ptr)> exception;
  // Told of every answered request: its route pattern ("" for none) and status.
  std::function<void(const Request&, const std::string& pattern, int status)> log;

  // Binds (port 0: any free port) and returns the port; then serves on background threads.
  int listen(const std::string& host, int port);
  // Stops accepting, closes every connection, waits for running handlers.
  void stop();

  struct Impl;  // the sockets, the handler threads and the connection counts (http.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace apus::server::http
