// A TLS 1.3 stream over a TCP socket that moves records in large batches.
//
// Asio's ssl::stream passes records through a 17 KB BIO pair, so every 16 KB record costs
// a socket write (and a read on the other side), and the bytes are copied twice on the way.
// Here OpenSSL reads and writes our own buffers through a custom BIO: a Write encrypts up
// to kBatchBytes of records into one buffer and hands it to the kernel in one write; a
// Read pulls up to kBatchBytes of records from the socket in one read and decrypts them
// straight into the caller's buffer. There is no kTLS on the machines this runs on, so
// this is the user-space path to line rate.
//
// Single-threaded use on the socket's executor: one Read and one Write may be pending at
// once (the connection's read and write loops); whichever needs the socket for records it
// produced (a handshake message, a KeyUpdate reply) takes turns with the other.
#pragma once

#include <openssl/ssl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "transport/asio.h"

namespace flywheel::transport {

class TlsStream {
 public:
  static constexpr size_t kBatchBytes = 512u << 10;

  // A TLS endpoint over `socket` with the context's settings (verify mode, identity).
  // Throws std::bad_alloc only when OpenSSL cannot allocate.
  TlsStream(tcp::socket socket, asio::ssl::context& context);
  ~TlsStream();
  TlsStream(const TlsStream&) = delete;
  TlsStream& operator=(const TlsStream&) = delete;

  SSL* native_handle() { return ssl_; }
  tcp::socket& next_layer() { return socket_; }

  // A client verifies that the server's certificate names `host` (a DNS name, or an IP
  // address matched against the certificate's IP entries) and sends it as SNI when it is
  // a name. Returns false when OpenSSL refuses the name.
  bool SetServerName(const std::string& host);

  // Runs the TLS 1.3 handshake; ec carries OpenSSL's reason on failure.
  awaitable<void> Handshake(bool server, error_code& ec);

  // Fills `buffer` completely (ec = eof when the peer closed first); returns bytes read.
  awaitable<size_t> Read(asio::mutable_buffer buffer, error_code& ec);

  // Writes every byte of `buffers`; returns the plaintext bytes written.
  template <typename ConstBufferSequence>
  awaitable<size_t> Write(const ConstBufferSequence& buffers, error_code& ec) {
    size_t total = 0;
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers);
         ++it) {
      const asio::const_buffer buffer = *it;
      total += co_await WriteOne(buffer, ec);
      if (ec) co_return total;
    }
    co_await Flush(ec);
    co_return total;
  }

 private:
  friend struct TlsStreamBio;

  awaitable<size_t> WriteOne(asio::const_buffer buffer, error_code& ec);
  awaitable<void> Flush(error_code& ec);  // puts every produced record on the wire
  awaitable<void> Fill(error_code& ec);   // reads more records from the socket
  error_code SslError(int result);

  tcp::socket socket_;
  SSL* ssl_ = nullptr;
  // Records from the socket not yet consumed by OpenSSL: in_[in_begin_, in_end_).
  std::vector<unsigned char> in_;
  size_t in_begin_ = 0, in_end_ = 0;
  // Records produced by OpenSSL, not yet handed to the socket; `sending_` is the batch on
  // its way (swapped out so that the other side may keep producing meanwhile).
  std::vector<unsigned char> out_, sending_;
  bool flushing_ = false;
  asio::steady_timer flushed_;  // cancelled whenever a flush ends (a one-shot signal)
};

}  // namespace flywheel::transport
