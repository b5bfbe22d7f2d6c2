// dsrun ui's HTTP server: cpp-httplib's routes and responses, with every connection served here so
// that slow or greedy clients cannot hold its workers (a header deadline, connections per address).
#pragma once

#include <httplib.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>

namespace dsrun {

struct ConnectionLimits {
  // From a connection's accept (or a next request's first byte) to the blank line that ends the
  // request's headers, however slowly the bytes trickle in: past it the client is told 408.
  std::chrono::milliseconds header_deadline{5000};
  // Connects the kernel completes before the server accepts them. cpp-httplib (compiled, 0.11)
  // listens with 5: a burst beyond that waits for SYN-ACK retransmits (1 s, 2 s, 4 s) before the
  // server sees it, so a connection could be accepted seconds late (and its deadline with it).
  int listen_backlog = 128;
  // An open connection's wait for its next request (a browser's keep-alive).
  std::chrono::milliseconds keep_alive{2000};
  // One read of a body, or one write of a response, before the connection is dropped.
  std::chrono::milliseconds io_timeout{5000};
  // Open connections one address may hold; one more is told 503 at once.
  int connections_per_address = 8;
  int requests_per_connection = 100;
  size_t max_header_bytes = 16384;
};

// cpp-httplib (0.11) reads headers with a timeout that each byte renews and serves a connection on
// a worker as long as it trickles, so 33 slow clients held its 32 workers. This server replaces
// its per-connection loop (process_and_close_socket, a private virtual meant to be overridden)
// and hands each complete request to its request handling, unchanged.
class GatedHttpServer : public httplib::Server {
 public:
  explicit GatedHttpServer(ConnectionLimits limits);
  // Binds host:port (0: a free port) and listens with limits.listen_backlog: the port, or -1 when
  // the address cannot be bound. Then listen_after_bind() serves.
  int bind(const std::string& host, int port);

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Counts a connection against its address; false (and nothing counted) when it holds the most.
  bool take_slot(const std::string& address);
  void give_slot(const std::string& address);

  const ConnectionLimits limits_;
  socket_t listening_socket_ = INVALID_SOCKET;  // the last socket cpp-httplib made to bind
  std::mutex slots_mutex_;
  std::map<std::string, int> open_per_address_;
};

}  // namespace dsrun
