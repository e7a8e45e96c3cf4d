#include "transport/tls_stream.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cstring>
#include <new>

namespace flywheel::transport {

// OpenSSL's side of the stream's buffers: it writes records into out_ and reads them from
// in_; an empty in_ is a retryable read (the stream then fills it from the socket).
struct TlsStreamBio {
  static int Write(BIO* bio, const char* data, size_t size, size_t* written) {
    BIO_clear_retry_flags(bio);
    auto* stream = static_cast<TlsStream*>(BIO_get_data(bio));
    const auto* bytes = reinterpret_cast<const unsigned char*>(data);
    stream->out_.insert(stream->out_.end(), bytes, bytes + size);
    *written = size;
    return 1;
  }
  static int Read(BIO* bio, char* data, size_t size, size_t* read) {
    BIO_clear_retry_flags(bio);
    auto* stream = static_cast<TlsStream*>(BIO_get_data(bio));
    const size_t available = stream->in_end_ - stream->in_begin_;
    if (available == 0) {
      BIO_set_retry_read(bio);
      *read = 0;
      return 0;
    }
    const size_t n = std::min(size, available);
    std::memcpy(data, stream->in_.data() + stream->in_begin_, n);
    stream->in_begin_ += n;
    if (stream->in_begin_ == stream->in_end_) stream->in_begin_ = stream->in_end_ = 0;
    *read = n;
    return 1;
  }
  static long Control(BIO*, int command, long, void*) {
    return command == BIO_CTRL_FLUSH ? 1 : 0;
  }
  static int Create(BIO* bio) {
    BIO_set_init(bio, 1);
    return 1;
  }
  static const BIO_METHOD* Method() {
    static BIO_METHOD* method = [] {
      BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "flywheel tls");
      if (m == nullptr) throw std::bad_alloc();
      BIO_meth_set_write_ex(m, Write);
      BIO_meth_set_read_ex(m, Read);
      BIO_meth_set_ctrl(m, Control);
      BIO_meth_set_create(m, Create);
      return m;
    }();
    return method;
  }
};

TlsStream::TlsStream(tcp::socket socket, asio::ssl::context& context)
    : socket_(std::move(socket)), flushed_(socket_.get_executor(), asio::steady_timer::time_point::max()) {
  ssl_ = SSL_new(context.native_handle());
  BIO* bio = ssl_ != nullptr ? BIO_new(TlsStreamBio::Method()) : nullptr;
  if (bio == nullptr) {
    SSL_free(ssl_);
    throw std::bad_alloc();
  }
  BIO_set_data(bio, this);
  SSL_set_bio(ssl_, bio, bio);  // one BIO both ways; the SSL owns it
  in_.resize(kBatchBytes);
  out_.reserve(kBatchBytes + (32u << 10));
}

TlsStream::~TlsStream() {
  SSL_free(ssl_);
}

bool TlsStream::SetServerName(const std::string& host) {
  error_code ec;
  asio::ip::make_address(host, ec);
  if (!ec) return X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), host.c_str()) == 1;
  // SNI carries names only, never addresses (RFC 6066).
  return SSL_set_tlsext_host_name(ssl_, host.c_str()) == 1 && SSL_set1_host(ssl_, host.c_str()) == 1;
}

error_code TlsStream::SslError(int result) {
  const int kind = SSL_get_error(ssl_, result);
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code != 0) return error_code(static_cast<int>(code), asio::error::get_ssl_category());
  if (kind == SSL_ERROR_ZERO_RETURN) return asio::error::eof;
  return asio::ssl::error::unspecified_system_error;
}

awaitable<void> TlsStream::Flush(error_code& ec) {
  while (flushing_) {  // the other side is writing: wait for its batch to go out first
    error_code ignored;
    co_await flushed_.async_wait(asio::redirect_error(use_awaitable, ignored));
  }
  if (out_.empty()) co_return;
  flushing_ = true;
  while (!out_.empty() && !ec) {
    sending_.swap(out_);
    co_await asio::async_write(socket_, asio::buffer(sending_),
                               asio::redirect_error(use_awaitable, ec));
    sending_.clear();
  }
  flushing_ = false;
  flushed_.cancel();
}

awaitable<void> TlsStream::Fill(error_code& ec) {
  if (in_begin_ > 0) {  // keep the unread tail at the front
    std::memmove(in_.data(), in_.data() + in_begin_, in_end_ - in_begin_);
    in_end_ -= in_begin_;
    in_begin_ = 0;
  }
  if (in_end_ == in_.size()) {  // cannot happen: OpenSSL asks for more only once it is drained
    ec = asio::error::no_buffer_space;
    co_return;
  }
  const size_t n = co_await socket_.async_read_some(
      asio::buffer(in_.data() + in_end_, in_.size() - in_end_),
      asio::redirect_error(use_awaitable, ec));
  in_end_ += n;
}

awaitable<void> TlsStream::Handshake(bool server, error_code& ec) {
  if (server) {
    SSL_set_accept_state(ssl_);
  } else {
    SSL_set_connect_state(ssl_);
  }
  while (true) {
    ERR_clear_error();
    const int result = SSL_do_handshake(ssl_);
    const int kind = result == 1 ? SSL_ERROR_NONE : SSL_get_error(ssl_, result);
    if (kind != SSL_ERROR_NONE && kind != SSL_ERROR_WANT_READ) {
      ec = SslError(result);
      // Our alert (e.g. "certificate verify failed") still goes out, best effort.
      error_code ignored;
      co_await Flush(ignored);
      co_return;
    }
    co_await Flush(ec);
    if (ec || kind == SSL_ERROR_NONE) co_return;
    co_await Fill(ec);
    if (ec) co_return;
  }
}

awaitable<size_t> TlsStream::Read(asio::mutable_buffer buffer, error_code& ec) {
  auto* data = static_cast<unsigned char*>(buffer.data());
  size_t done = 0;
  while (done < buffer.size()) {
    ERR_clear_error();
    size_t got = 0;
    const int result = SSL_read_ex(ssl_, data + done, buffer.size() - done, &got);
    if (result == 1) {
      done += got;
      continue;
    }
    const int kind = SSL_get_error(ssl_, result);
    if (kind != SSL_ERROR_WANT_READ) {
      ec = SslError(result);
      co_return done;
    }
    if (!out_.empty()) co_await Flush(ec);  // e.g. a reply to the peer's KeyUpdate
    if (!ec) co_await Fill(ec);
    if (ec) co_return done;
  }
  if (!out_.empty()) co_await Flush(ec);
  co_return done;
}

awaitable<size_t> TlsStream::WriteOne(asio::const_buffer buffer, error_code& ec) {
  const auto* data = static_cast<const unsigned char*>(buffer.data());
  size_t done = 0;
  while (done < buffer.size()) {
    // Encrypt about a batch, then hand it to the kernel in one write.
    const size_t chunk = std::min(buffer.size() - done, kBatchBytes);
    ERR_clear_error();
    size_t written = 0;
    const int result = SSL_write_ex(ssl_, data + done, chunk, &written);
    if (result != 1) {
      ec = SslError(result);
      co_return done;
    }
    done += written;
    if (out_.size() >= kBatchBytes) {
      co_await Flush(ec);
      if (ec) co_return done;
    }
  }
  co_return done;
}

}  // namespace flywheel::transport
