#include "runner/gated_http_server.hpp"

#include "engine/common/error.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dsrun {

namespace {

using Clock = std::chrono::steady_clock;

// Waits until `fd` can be read (or written), up to `wait`; false at the end of it or on an error.
bool wait_for(int fd, short events, std::chrono::milliseconds wait) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int ready = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, wait.count())));
    if (ready < 0 && errno == EINTR) continue;
    return ready > 0;
  }
}

std::chrono::milliseconds until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

std::string numeric_host(const sockaddr_storage& address, socklen_t length) {
  char host[NI_MAXHOST] = {0};
  const int status = ::getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, host, sizeof(host), nullptr, 0, NI_NUMERICHOST);
  return status == 0 ? std::string(host) : std::string("unknown");
}

int numeric_port(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
  return 0;
}

// One connection as cpp-httplib reads and writes it: bytes already read while waiting for the
// headers are served first, then the socket, each read and write bounded by io_timeout.
class ConnectionStream : public httplib::Stream {
 public:
  ConnectionStream(int fd, std::chrono::milliseconds io_timeout) : fd_(fd), io_timeout_(io_timeout) {}

  // What has arrived and not been handed to cpp-httplib yet.
  size_t buffered() const { return buffer_.size() - consumed_; }
  bool headers_complete() const { return buffer_.find("\r\n\r\n", consumed_) != std::string::npos; }
  // Reads what the socket has into the buffer: the bytes read, 0 when the peer closed, -1 on error.
  ssize_t fill() {
    if (consumed_ > 0) {
      buffer_.erase(0, consumed_);
      consumed_ = 0;
    }
    char chunk[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) buffer_.append(chunk, static_cast<size_t>(n));
      return n;
    }
  }

  bool is_readable() const override { return buffered() > 0 || wait_for(fd_, POLLIN, io_timeout_); }
  bool is_writable() const override { return wait_for(fd_, POLLOUT, io_timeout_); }
  ssize_t read(char* ptr, size_t size) override {
    // cpp-httplib reads the request line and headers a byte at a time: served from the buffer.
    if (buffered() == 0) {
      if (!wait_for(fd_, POLLIN, io_timeout_)) return -1;
      const ssize_t n = fill();
      if (n <= 0) return n;
    }
    const size_t n = std::min(size, buffered());
    std::memcpy(ptr, buffer_.data() + consumed_, n);
    consumed_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    for (;;) {
      const ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address_of(::getpeername, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address_of(::getsockname, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  void address_of(int (*query)(int, sockaddr*, socklen_t*), std::string& ip, int& port) const {
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    if (query(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ip = "unknown";
      port = 0;
      return;
    }
    ip = numeric_host(address, length);
    port = numeric_port(address);
  }

  const int fd_;
  const std::chrono::milliseconds io_timeout_;
  std::string buffer_;
  size_t consumed_ = 0;
};

// A short answer to a client not served (503, 408, 431), sent without waiting: the connection is
// closed next whether or not it arrived.
void refuse(int fd, const char* status, const char* text) {
  const std::string body = std::string(text) + "\n";
  const std::string response = std::string("HTTP/1.1 ") + status + "\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: " +
                               std::to_string(body.size()) + "\r\n\r\n" + body;
  if (::send(fd, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
    // The client is gone or not reading: it is closed next either way.
  }
}

// The connection's socket, shut down and closed on every way out. What the client sent and was
// not read is read first: closing over unread bytes sends a reset, which lets a client's stack
// drop the answer (408, 503) still waiting in its receive buffer.
class ConnectionOwner {
 public:
  explicit ConnectionOwner(int fd) : fd_(fd) {}
  ~ConnectionOwner() {
    ::shutdown(fd_, SHUT_WR);
    char unread[4096];
    for (int chunks = 0; chunks < 16 && ::recv(fd_, unread, sizeof(unread), MSG_DONTWAIT) > 0; ++chunks) {
    }
    ::close(fd_);
  }
  ConnectionOwner(const ConnectionOwner&) = delete;
  ConnectionOwner& operator=(const ConnectionOwner&) = delete;

 private:
  const int fd_;
};

}  // namespace

GatedHttpServer::GatedHttpServer(ConnectionLimits limits) : limits_(limits) {
  set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    listening_socket_ = sock;
  });
}

int GatedHttpServer::bind(const std::string& host, int port) {
  const int bound = port == 0 ? bind_to_any_port(host) : (bind_to_port(host, port) ? port : -1);
  if (bound < 0) return -1;
  if (::listen(listening_socket_, limits_.listen_backlog) != 0) {
    fail_at(__FILE__, __LINE__, "cannot listen on " + host + ":" + std::to_string(bound) + ": " + std::strerror(errno));
  }
  return bound;
}

bool GatedHttpServer::take_slot(const std::string& address) {
  std::lock_guard<std::mutex> lock(slots_mutex_);
  int& open = open_per_address_[address];
  if (open >= limits_.connections_per_address) return false;
  ++open;
  return true;
}

void GatedHttpServer::give_slot(const std::string& address) {
  std::lock_guard<std::mutex> lock(slots_mutex_);
  if (--open_per_address_[address] <= 0) open_per_address_.erase(address);
}

bool GatedHttpServer::process_and_close_socket(socket_t sock) {
  const ConnectionOwner owner(sock);
  const Clock::time_point accepted = Clock::now();
  std::string address;
  int port = 0;
  ConnectionStream stream(sock, limits_.io_timeout);
  stream.get_remote_ip_and_port(address, port);
  if (!take_slot(address)) {
    refuse(sock, "503 Service Unavailable", "too many open connections from this address; close some and retry");
    return false;
  }
  struct Slot {
    GatedHttpServer& server;
    const std::string& address;
    ~Slot() { server.give_slot(address); }
  } slot{*this, address};

  // Waits in short slices so that stop() (Ctrl-C) is not held up by a waiting client.
  const std::chrono::milliseconds slice(200);
  for (int served = 0; served < limits_.requests_per_connection && is_running(); ++served) {
    // The first request's deadline runs from the accept; a next one's from its first byte, after
    // up to keep_alive of quiet.
    Clock::time_point deadline = accepted + limits_.header_deadline;
    if (served > 0) {
      if (stream.buffered() == 0) {
        const Clock::time_point idle_end = Clock::now() + limits_.keep_alive;
        bool arrived = false;
        while (!arrived && is_running() && Clock::now() < idle_end) arrived = wait_for(sock, POLLIN, std::min(slice, until(idle_end)));
        if (!arrived) return true;
      }
      deadline = Clock::now() + limits_.header_deadline;
    }
    while (!stream.headers_complete()) {
      if (!is_running()) return true;
      if (stream.buffered() > limits_.max_header_bytes) {
        refuse(sock, "431 Request Header Fields Too Large", "the request's headers are too large");
        return false;
      }
      if (Clock::now() >= deadline) {
        refuse(sock, "408 Request Timeout", "the request's headers did not arrive in time");
        return false;
      }
      if (!wait_for(sock, POLLIN, std::min(slice, until(deadline)))) continue;
      if (stream.fill() <= 0) return served > 0;  // closed (or failed) before a whole request
    }
    const bool last = served + 1 == limits_.requests_per_connection;
    bool connection_closed = false;
    if (!process_request(stream, last, connection_closed, nullptr) || connection_closed) return true;
  }
  return true;
}

}  // namespace dsrun
