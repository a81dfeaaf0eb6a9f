#include "server/http.h"

#include <sys/socket.h>

#include <array>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <thread>

#include "server/bodies.h"

namespace apus::server::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;

std::string Request::header(const std::string& name) const {
  for (const auto& [key, value] : headers)
    if (beast::iequals(key, name)) return value;
  return "";
}

std::optional<std::string> Request::query(const std::string& name) const { return query_value(target, name); }

bool Request::client_gone() const {
  if (socket < 0) return false;
  char byte;
  const ssize_t n = ::recv(socket, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return true;  // the client's FIN, with nothing left unread before it
  return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

namespace {

struct Route {
  std::string method, pattern;
  std::regex regex;
  Handler handler;
};

std::string reason(int status) {
  if (status == 499) return "Client Closed Request";
  const beast::string_view text = bhttp::obsolete_reason(bhttp::int_to_status(unsigned(status)));
  return text.empty() || text.front() == '<' ? "Unknown" : std::string(text);
}

std::string head_of(const Response& res, bool chunked, bool keep_alive) {
  std::string out = "HTTP/1.1 " + std::to_string(res.status) + " " + reason(res.status) + "\r\n";
  out += "Content-Type: " + res.content_type + "\r\n";
  for (const auto& [name, value] : res.headers) out += name + ": " + value + "\r\n";
  out += chunked ? std::string("Transfer-Encoding: chunked\r\n")
                 : "Content-Length: " + std::to_string(res.body.size()) + "\r\n";
  if (!keep_alive) out += "Connection: close\r\n";
  return out + "\r\n";
}

class Session;

}  // namespace

struct Server::Impl {
  Limits limits;
  std::vector<Route> routes;
  std::function<bool(const Request&, Response&)> before;
  std::function<void(const Request&, Response&)> after;
  std::function<void(Response&, int, const std::string&)> refusal;
  std::function<void(Response&, std::exception_ptr)> exception;
  std::function<void(const Request&, const std::string&, int)> log;

  // Declared before the I/O context: sessions still queued in it when it is destroyed release
  // their counts here.
  std::mutex mutex;
  size_t connections = 0;
  std::map<std::string, size_t> per_address;
  std::set<Session*> sessions;
  bool stopping = false;  // on the I/O thread: answers in flight are written, nothing more is read

  asio::io_context io{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  tcp::acceptor acceptor{io};
  asio::thread_pool pool;
  std::thread io_thread;

  explicit Impl(Limits l) : limits(l), pool(l.threads) {}

  void accept();
  void admit(tcp::socket socket);
  Response refused(int status, const std::string& message) const {
    Response res;
    res.status = status;
    if (refusal) refusal(res, status, message);
    else res.set_content(message, "text/plain");
    return res;
  }
  // Routes a complete request; `pattern` is the route that answered it ("" for none).
  void handle(Request& req, Response& res, std::string& pattern) const;
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Server::Impl& server, tcp::socket socket, std::string address)
      : server_(server), socket_(std::move(socket)), timer_(server.io), poll_(server.io), address_(std::move(address)) {
    std::lock_guard<std::mutex> lock(server_.mutex);
    server_.sessions.insert(this);
  }
  ~Session() {
    std::lock_guard<std::mutex> lock(server_.mutex);
    server_.sessions.erase(this);
    --server_.connections;
    if (--server_.per_address[address_] == 0) server_.per_address.erase(address_);
  }

  void start() { read_header(); }

  // Whether a request of this connection is being handled or answered.
  bool busy() const { return busy_; }

  // On the I/O thread: ends whatever the session waits for.
  void close() {
    beast::error_code ignored;
    socket_.close(ignored);
    disarm();
    poll_.cancel();
  }

 private:
  // How soon a stream with nothing to send is asked again.
  static constexpr std::chrono::milliseconds kStreamPoll{50};

  Server::Impl& server_;
  tcp::socket socket_;
  asio::steady_timer timer_, poll_;
  unsigned deadline_ = 0;  // which arm() the pending timer belongs to
  std::string address_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  Request request_;
  bool keep_alive_ = false;
  bool busy_ = false;
  std::string head_, body_;  // what is being written
  std::optional<Stream> stream_;
  std::array<char, 4096> discard_{};

  const Limits& limits() const { return server_.limits; }

  // A deadline for what the session waits for now: when it passes, the socket is closed and the
  // pending read or write ends with an error.
  void arm(double seconds) {
    const unsigned generation = ++deadline_;
    timer_.expires_after(std::chrono::milliseconds(int64_t(seconds * 1000)));
    timer_.async_wait([self = shared_from_this(), generation](beast::error_code ec) {
      if (ec || generation != self->deadline_) return;
      beast::error_code ignored;
      self->socket_.close(ignored);
    });
  }
  void disarm() {
    ++deadline_;
    timer_.cancel();
  }

  void read_header() {
    parser_.emplace();
    parser_->header_limit(uint32_t(limits().max_header));
    parser_->body_limit(uint64_t(limits().max_body));
    arm(limits().header_seconds);
    bhttp::async_read_header(socket_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    // A Content-Length beyond the body limit is refused as the header is parsed.
    if (ec == bhttp::error::body_limit)
      return refuse(413,
                    "the body is larger than the " + std::to_string(limits().max_body) + " bytes the server takes");
    if (ec == bhttp::error::header_limit)
      return refuse(431, "the request line and headers are larger than the " + std::to_string(limits().max_header) +
                             " bytes the server takes");
    if (ec == bhttp::error::end_of_stream || ec == asio::error::operation_aborted ||
        ec == asio::error::bad_descriptor || ec == asio::error::eof || ec == asio::error::connection_reset ||
        ec == bhttp::error::partial_message)
      return close();  // the client left, or its deadline passed
    if (ec) return refuse(400, "malformed request: " + ec.message());
    if (beast::iequals(parser_->get()[bhttp::field::expect], "100-continue")) {
      head_ = "HTTP/1.1 100 Continue\r\n\r\n";
      body_.clear();
      return write([self = shared_from_this()] { self->read_body(); });
    }
    read_body();
  }

  void read_body() {
    if (parser_->is_done()) return dispatch();
    const double bytes = double(parser_->content_length().value_or(limits().max_body));
    arm(limits().header_seconds + bytes / limits().min_bytes_per_second);
    bhttp::async_read(socket_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec == bhttp::error::body_limit)
        return self->refuse(
            413, "the body is larger than the " + std::to_string(self->limits().max_body) + " bytes the server takes");
      if (ec == bhttp::error::partial_message || ec == asio::error::operation_aborted || ec == asio::error::eof ||
          ec == asio::error::bad_descriptor || ec == asio::error::connection_reset)
        return self->close();
      if (ec) return self->refuse(400, "malformed request body: " + ec.message());
      self->dispatch();
    });
  }

  void dispatch() {
    disarm();
    busy_ = true;
    auto& message = parser_->get();
    request_ = Request{};
    request_.method = std::string(message.method_string());
    request_.target = std::string(message.target());
    request_.path = request_.target.substr(0, request_.target.find('?'));
    for (const auto& field : message)
      request_.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    request_.body = std::move(message.body());
    request_.remote_address = address_;
    request_.socket = socket_.native_handle();
    keep_alive_ = message.keep_alive();
    parser_.reset();
    asio::post(server_.pool, [self = shared_from_this()] {
      auto res = std::make_shared<Response>();
      std::string pattern;
      self->server_.handle(self->request_, *res, pattern);
      asio::post(self->server_.io, [self, res] { self->respond(std::move(*res)); });
    });
  }

  // The transport's own refusal of what it read; the connection is not reused after it.
  void refuse(int status, const std::string& message) {
    disarm();
    busy_ = true;
    request_ = Request{};
    request_.remote_address = address_;
    Response res = server_.refused(status, message);
    if (server_.after) server_.after(request_, res);
    if (server_.log) server_.log(request_, "", status);
    keep_alive_ = false;
    respond(std::move(res));
  }

  void respond(Response res) {
    const bool head = request_.method == "HEAD";
    stream_ = head ? std::nullopt : std::move(res.stream);
    head_ = head_of(res, stream_.has_value(), keep_alive_);
    body_ = head ? std::string() : std::move(res.body);
    write([self = shared_from_this()] { self->written(); });
  }

  template <typename Then> void write(Then then) {
    arm(limits().header_seconds + double(head_.size() + body_.size()) / limits().min_bytes_per_second);
    const std::array<asio::const_buffer, 2> buffers = {asio::buffer(head_), asio::buffer(body_)};
    asio::async_write(socket_, buffers, [self = shared_from_this(), then](beast::error_code ec, size_t) {
      if (ec) {
        if (self->stream_ && self->stream_->abandoned) self->stream_->abandoned();
        return self->close();
      }
      self->disarm();
      then();
    });
  }

  void written() {
    if (stream_) return next_piece();
    busy_ = false;
    if (server_.stopping) return close();
    if (keep_alive_) return read_header();
    linger();
  }

  // A streamed body's next piece, made on a handler thread and sent as a chunk. Nothing yet (an
  // empty piece) is asked again a moment later from a timer, so a waiting stream holds no handler
  // thread: thirty event streams on a queued job once held them all and /health timed out.
  void next_piece() {
    asio::post(server_.pool, [self = shared_from_this()] {
      std::optional<std::string> piece = self->stream_->next();
      asio::post(self->server_.io, [self, piece = std::move(piece)] {
        if (piece && piece->empty()) {
          self->poll_.expires_after(kStreamPoll);
          return self->poll_.async_wait([self](beast::error_code ec) {
            if (!ec && self->socket_.is_open()) self->next_piece();
          });
        }
        if (!piece) {
          self->stream_.reset();
          self->head_ = "0\r\n\r\n";
          self->body_.clear();
          return self->write([self] { self->written(); });
        }
        char size[32];
        std::snprintf(size, sizeof size, "%zx\r\n", piece->size());
        self->head_ = size;
        self->body_ = *piece + "\r\n";
        self->write([self] { self->next_piece(); });
      });
    });
  }

  // After an answer on a connection that is not reused: what the client still sends is read and
  // dropped for a moment, so closing does not reset the connection before it reads the answer.
  void linger() {
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    arm(2);
    drain();
  }
  void drain() {
    socket_.async_read_some(asio::buffer(discard_), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }
};

}  // namespace

void Server::Impl::accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) admit(std::move(socket));
    accept();
  });
}

void Server::Impl::admit(tcp::socket socket) {
  beast::error_code ec;
  const tcp::endpoint peer = socket.remote_endpoint(ec);
  if (ec) return;
  const std::string address = peer.address().to_string();
  bool over = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    over = connections >= limits.max_connections || per_address[address] >= limits.max_connections_per_address;
    if (!over) {
      ++connections;
      ++per_address[address];
    } else if (per_address[address] == 0) {
      per_address.erase(address);
    }
  }
  if (over) {
    // Answered at once and closed, holding nothing: a flood of connections costs no thread or wait.
    const Response res =
        refused(503, "too many connections (this server takes " + std::to_string(limits.max_connections) + ", " +
                         std::to_string(limits.max_connections_per_address) + " from one address)");
    const std::string bytes = head_of(res, false, false) + res.body;
    [[maybe_unused]] const ssize_t sent =
        ::send(socket.native_handle(), bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    socket.shutdown(tcp::socket::shutdown_both, ec);
    return;
  }
  socket.set_option(tcp::no_delay(true), ec);
  std::make_shared<Session>(*this, std::move(socket), address)->start();
}

void Server::Impl::handle(Request& req, Response& res, std::string& pattern) const {
  try {
    if (!before || !before(req, res)) {
      const std::string method = req.method == "HEAD" ? "GET" : req.method;
      std::string allowed;
      bool answered = false;
      for (const Route& route : routes) {
        std::smatch match;
        if (!std::regex_match(req.path, match, route.regex)) continue;
        if (route.method != method) {
          allowed += (allowed.empty() ? "" : ", ") + route.method;
          continue;
        }
        pattern = route.pattern;
        req.matches.assign(match.begin(), match.end());
        route.handler(req, res);
        answered = true;
        break;
      }
      if (!answered && allowed.empty()) {
        res = refused(404, "no such route: " + req.path);
      } else if (!answered) {
        res = refused(405, req.method + " is not a method of " + req.path + " (it takes " + allowed + ")");
        res.set_header("Allow", allowed);
      }
    }
  } catch (...) {
    res = Response{};
    if (exception) exception(res, std::current_exception());
    else res = refused(500, "the handler failed");
  }
  if (after) after(req, res);
  if (log) log(req, pattern, res.status);
}

Server::Server(Limits limits) : impl_(std::make_unique<Impl>(limits)) {}

Server::~Server() { stop(); }

void Server::route(const std::string& method, const std::string& pattern, Handler handler) {
  impl_->routes.push_back({method, pattern, std::regex(pattern), std::move(handler)});
}

int Server::listen(const std::string& host, int port) {
  Impl& s = *impl_;
  s.before = before;
  s.after = after;
  s.refusal = refusal;
  s.exception = exception;
  s.log = log;
  beast::error_code ec;
  tcp::resolver resolver(s.io);
  const auto found = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
  if (ec || found.empty()) return -1;
  const tcp::endpoint endpoint = *found.begin();
  s.acceptor.open(endpoint.protocol(), ec);
  if (!ec) s.acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(endpoint, ec);
  if (!ec) s.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return -1;
  const int bound = s.acceptor.local_endpoint().port();
  s.work.emplace(s.io.get_executor());
  s.accept();
  s.io_thread = std::thread([&s] { s.io.run(); });
  return bound;
}

void Server::stop() {
  Impl& s = *impl_;
  if (!s.io_thread.joinable()) return;
  auto close_sessions = [&s](bool idle_only) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (Session* session : s.sessions)
      if (!idle_only || !session->busy()) session->close();
  };
  // Graceful: no new connection or request; the requests being handled are answered.
  asio::post(s.io, [&s, close_sessions] {
    beast::error_code ignored;
    s.acceptor.close(ignored);
    s.stopping = true;
    close_sessions(true);
  });
  s.pool.join();
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.sessions.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  asio::post(s.io, [close_sessions] { close_sessions(false); });
  s.work.reset();
  s.io.stop();
  s.io_thread.join();
}

}  // namespace apus::server::http
