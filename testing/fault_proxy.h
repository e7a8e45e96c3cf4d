// A TCP forwarder on 127.0.0.1 between a node (or client) and its upstream that damages or
// shapes the byte streams on purpose, for fleet tests and benchmarks (the faults come from
// outside the code under test; this machine has no netem):
// - cut_after_bytes: the connection that carries the downstream byte number N (counted over
//   all connections) forwards bytes up to N only, then both of its sockets are shut down:
//   a cut in the middle of whatever frame was passing. It happens once.
// - cut_upstream_after_bytes: the same for the node -> upstream byte stream.
// - upstream_bytes_per_s: the node -> upstream direction of all connections together is
//   shaped to this rate (one transport::TokenBucket, 50 ms of burst): an upload link.
// - corrupt_pieces: downstream frames are parsed (transport/frame.h) and one payload byte
//   of each of the first N Piece frames is flipped; everything else passes unchanged.
// Blocking sockets, two threads per connection; the destructor shuts every socket down and
// joins every thread.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "transport/frame.h"
#include "transport/shaper.h"

namespace flywheel::testing {

struct FaultProxyOptions {
  uint64_t cut_after_bytes = 0;  // 0: never cut
  int corrupt_pieces = 0;        // Piece frames to corrupt, first ones first
  // The same cut in the other direction (node -> upstream, e.g. an upload): the connection
  // carrying upstream byte number N forwards bytes up to N only, once. 0: never.
  uint64_t cut_upstream_after_bytes = 0;
  double upstream_bytes_per_s = 0;  // 0: not shaped
};

class FaultProxy {
 public:
  FaultProxy(uint16_t target_port, FaultProxyOptions options)
      : target_port_(target_port), options_(options), corrupt_left_(options.corrupt_pieces) {
    if (options.upstream_bytes_per_s > 0) {
      upstream_bucket_ = std::make_unique<transport::TokenBucket>(
          options.upstream_bytes_per_s, static_cast<uint64_t>(options.upstream_bytes_per_s * 0.05));
    }
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address = Loopback(0);
    if (listen_fd_ < 0 ||
        ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listen_fd_, 64) != 0) {
      error_ = "cannot listen: " + std::string(std::strerror(errno));
      return;
    }
    socklen_t length = sizeof address;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~FaultProxy() {
    stop_ = true;
    if (accept_thread_.joinable()) accept_thread_.join();
    {
      std::lock_guard lock(mutex_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (std::thread& thread : threads_) thread.join();  // no new ones: accept loop ended
    for (int fd : fds_) ::close(fd);
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }

  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

  bool ok() const { return port_ != 0; }
  const std::string& error() const { return error_; }
  uint16_t port() const { return port_; }
  uint64_t downstream_bytes() const { return downstream_bytes_.load(); }
  uint64_t upstream_bytes() const { return upstream_bytes_.load(); }
  int connections() const { return connections_.load(); }
  int cuts() const { return cuts_.load(); }
  int corrupted() const { return corrupted_.load(); }

 private:
  static sockaddr_in Loopback(uint16_t port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return address;
  }

  static bool SendAll(int fd, const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t sent = ::send(fd, bytes, size, MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return false;
      bytes += sent;
      size -= static_cast<size_t>(sent);
    }
    return true;
  }

  static bool RecvAll(int fd, void* data, size_t size) {
    char* bytes = static_cast<char*>(data);
    while (size > 0) {
      const ssize_t got = ::recv(fd, bytes, size, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      bytes += got;
      size -= static_cast<size_t>(got);
    }
    return true;
  }

  void AcceptLoop() {
    while (!stop_) {
      pollfd ready{listen_fd_, POLLIN, 0};
      if (::poll(&ready, 1, 50) <= 0) continue;
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in target = Loopback(target_port_);
      if (server < 0 ||
          ::connect(server, reinterpret_cast<sockaddr*>(&target), sizeof target) != 0) {
        if (server >= 0) ::close(server);
        ::close(client);
        continue;
      }
      const int one = 1;
      ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ++connections_;
      std::lock_guard lock(mutex_);
      fds_.push_back(client);
      fds_.push_back(server);
      threads_.emplace_back([this, client, server] { PumpUp(client, server); });
      threads_.emplace_back([this, client, server] { PumpDown(server, client); });
    }
  }

  // Waits until `bytes` more may pass the upstream token bucket.
  void Shape(size_t bytes) {
    if (upstream_bucket_ == nullptr) return;
    std::this_thread::sleep_until(upstream_bucket_->Reserve(bytes, transport::Clock::now()));
  }

  // node -> upstream: forwarded as is, but for cut_upstream_after_bytes and shaping.
  void PumpUp(int client, int server) {
    std::vector<char> buffer(1 << 16);
    while (true) {
      const ssize_t got = ::recv(client, buffer.data(), buffer.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      Shape(static_cast<size_t>(got));
      const uint64_t before = upstream_bytes_.fetch_add(static_cast<uint64_t>(got));
      const uint64_t cut = options_.cut_upstream_after_bytes;
      if (cut > 0 && before < cut && before + static_cast<uint64_t>(got) >= cut) {
        SendAll(server, buffer.data(), static_cast<size_t>(cut - before));
        ++cuts_;
        break;
      }
      if (!SendAll(server, buffer.data(), static_cast<size_t>(got))) break;
    }
    ::shutdown(client, SHUT_RDWR);
    ::shutdown(server, SHUT_RDWR);
  }

  void PumpDown(int server, int client) {
    if (options_.corrupt_pieces > 0) {
      PumpFrames(server, client);
    } else {
      PumpBytes(server, client);
    }
    ::shutdown(client, SHUT_RDWR);
    ::shutdown(server, SHUT_RDWR);
  }

  void PumpBytes(int server, int client) {
    std::vector<char> buffer(1 << 16);
    while (true) {
      const ssize_t got = ::recv(server, buffer.data(), buffer.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return;
      const uint64_t before = downstream_bytes_.fetch_add(static_cast<uint64_t>(got));
      const uint64_t cut = options_.cut_after_bytes;
      if (cut > 0 && before < cut && before + static_cast<uint64_t>(got) >= cut) {
        SendAll(client, buffer.data(), static_cast<size_t>(cut - before));
        ++cuts_;
        return;
      }
      if (!SendAll(client, buffer.data(), static_cast<size_t>(got))) return;
    }
  }

  void PumpFrames(int server, int client) {
    while (true) {
      std::array<std::byte, transport::kFramePrefixBytes> prefix_bytes;
      if (!RecvAll(server, prefix_bytes.data(), prefix_bytes.size())) return;
      Result<transport::FramePrefix> prefix =
          transport::ParseFramePrefix(prefix_bytes, transport::FrameLimits{}, "fault proxy");
      if (!prefix.ok()) return;  // not a frame: the node sees the connection close
      std::vector<std::byte> header_bytes(prefix->header_bytes);
      std::vector<std::byte> payload(prefix->payload_bytes);
      if (!RecvAll(server, header_bytes.data(), header_bytes.size()) ||
          !RecvAll(server, payload.data(), payload.size())) {
        return;
      }
      Result<wire::Header> header =
          transport::ParseFrameHeader(header_bytes, *prefix, "fault proxy");
      if (header.ok() && header->has_piece() && !payload.empty() &&
          corrupt_left_.fetch_sub(1) > 0) {
        payload[payload.size() / 2] ^= std::byte{0x5a};
        ++corrupted_;
      }
      downstream_bytes_ += prefix_bytes.size() + header_bytes.size() + payload.size();
      if (!SendAll(client, prefix_bytes.data(), prefix_bytes.size()) ||
          !SendAll(client, header_bytes.data(), header_bytes.size()) ||
          !SendAll(client, payload.data(), payload.size())) {
        return;
      }
    }
  }

  const uint16_t target_port_;
  const FaultProxyOptions options_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::string error_;
  std::atomic<bool> stop_{false};
  std::thread accept_thread_;
  std::mutex mutex_;
  std::vector<int> fds_;              // GUARDED_BY(mutex_); closed in the destructor
  std::vector<std::thread> threads_;  // GUARDED_BY(mutex_) while the accept loop runs
  std::atomic<uint64_t> downstream_bytes_{0};
  std::atomic<uint64_t> upstream_bytes_{0};
  std::unique_ptr<transport::TokenBucket> upstream_bucket_;  // null: upstream not shaped
  std::atomic<int> connections_{0}, cuts_{0}, corrupted_{0}, corrupt_left_;
};

}  // namespace flywheel::testing
