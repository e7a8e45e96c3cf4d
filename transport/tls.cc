#include "transport/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

namespace flywheel::transport {
namespace {

// Distinguishes "cannot open" (IOError, with errno) from "OpenSSL cannot parse it" later.
Status CheckReadable(const std::string& what, const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return Status::IOError("cannot read " + what + " " + path + ": " + std::strerror(errno));
  }
  std::fclose(file);
  return Status::Ok();
}

// Encrypted keys are not supported; without this OpenSSL would prompt on the terminal.
int RefusePassphrase(char*, int, int, void*) {
  return 0;
}

Result<std::shared_ptr<asio::ssl::context>> NewContext(asio::ssl::context::method method) {
  std::shared_ptr<asio::ssl::context> context;
  try {
    context = std::make_shared<asio::ssl::context>(method);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("cannot create TLS context: ") + e.what());
  }
  SSL_CTX* native = context->native_handle();
  if (SSL_CTX_set_min_proto_version(native, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(native, TLS1_3_VERSION) != 1) {
    return Status::Internal("cannot restrict TLS context to TLS 1.3: " + OpenSslErrors());
  }
  SSL_CTX_set_default_passwd_cb(native, RefusePassphrase);
  if (SSL_CTX_set_ciphersuites(native, PreferredTlsSuites().c_str()) != 1) {
    return Status::Internal("cannot set TLS 1.3 cipher suites: " + OpenSslErrors());
  }
  // A server picks from its own order, and still takes ChaCha20 when the client prefers it
  // (a client without AES hardware lists it first).
  SSL_CTX_set_options(native, SSL_OP_CIPHER_SERVER_PREFERENCE | SSL_OP_PRIORITIZE_CHACHA);
  return context;
}

Status LoadIdentity(SSL_CTX* native, const TlsOptions& options) {
  FW_RETURN_IF_ERROR(CheckReadable("certificate", options.cert_file));
  FW_RETURN_IF_ERROR(CheckReadable("private key", options.key_file));
  ERR_clear_error();
  if (SSL_CTX_use_certificate_chain_file(native, options.cert_file.c_str()) != 1) {
    return Status::Corruption("cannot load certificate chain " + options.cert_file + ": " +
                              OpenSslErrors());
  }
  if (SSL_CTX_use_PrivateKey_file(native, options.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    // OpenSSL compares the key with the loaded certificate while loading it.
    const unsigned long error = ERR_peek_last_error();
    if (ERR_GET_LIB(error) == ERR_LIB_X509 && ERR_GET_REASON(error) == X509_R_KEY_VALUES_MISMATCH) {
      return Status::Mismatch("private key " + options.key_file + " does not match certificate " +
                              options.cert_file + ": " + OpenSslErrors());
    }
    return Status::Corruption("cannot load private key " + options.key_file + ": " +
                              OpenSslErrors());
  }
  if (SSL_CTX_check_private_key(native) != 1) {
    return Status::Mismatch("private key " + options.key_file + " does not match certificate " +
                            options.cert_file + ": " + OpenSslErrors());
  }
  return Status::Ok();
}

Status LoadCa(SSL_CTX* native, const std::string& ca_file) {
  FW_RETURN_IF_ERROR(CheckReadable("CA bundle", ca_file));
  ERR_clear_error();
  if (SSL_CTX_load_verify_locations(native, ca_file.c_str(), nullptr) != 1) {
    return Status::Corruption("cannot load CA bundle " + ca_file + ": " + OpenSslErrors());
  }
  return Status::Ok();
}

}  // namespace

bool HasAesHardware() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul");
#else
  return true;  // ARMv8 servers have the crypto extension
#endif
}

std::string PreferredTlsSuites() {
  return HasAesHardware()
             ? "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
             : "TLS_CHACHA20_POLY1305_SHA256:TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384";
}

std::string OpenSslErrors() {
  std::string text;
  while (unsigned long code = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    if (!text.empty()) text += "; ";
    text += buffer;
  }
  return text.empty() ? "unknown OpenSSL error" : text;
}

Result<std::shared_ptr<asio::ssl::context>> MakeServerTlsContext(const TlsOptions& options) {
  if (options.cert_file.empty() || options.key_file.empty()) {
    return Status::InvalidArgument("a TLS server needs both --tls-cert and --tls-key");
  }
  FW_ASSIGN_OR_RETURN(std::shared_ptr<asio::ssl::context> context,
                      NewContext(asio::ssl::context::tls_server));
  SSL_CTX* native = context->native_handle();
  FW_RETURN_IF_ERROR(LoadIdentity(native, options));
  if (!options.ca_file.empty()) {
    FW_RETURN_IF_ERROR(LoadCa(native, options.ca_file));
    // Tells clients which CAs are accepted, so one with several certificates picks right.
    if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(options.ca_file.c_str())) {
      SSL_CTX_set_client_CA_list(native, names);
    }
    error_code ec;
    context->set_verify_mode(asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert, ec);
    if (ec) return Status::Internal("cannot set TLS verify mode: " + ec.message());
  }
  ERR_clear_error();
  return context;
}

Result<std::shared_ptr<asio::ssl::context>> MakeClientTlsContext(const TlsOptions& options) {
  if (options.ca_file.empty()) {
    return Status::InvalidArgument("a TLS client needs --tls-ca to verify the server");
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return Status::InvalidArgument("--tls-cert and --tls-key must be given together");
  }
  FW_ASSIGN_OR_RETURN(std::shared_ptr<asio::ssl::context> context,
                      NewContext(asio::ssl::context::tls_client));
  SSL_CTX* native = context->native_handle();
  if (!options.cert_file.empty()) FW_RETURN_IF_ERROR(LoadIdentity(native, options));
  FW_RETURN_IF_ERROR(LoadCa(native, options.ca_file));
  error_code ec;
  context->set_verify_mode(asio::ssl::verify_peer, ec);
  if (ec) return Status::Internal("cannot set TLS verify mode: " + ec.message());
  ERR_clear_error();
  return context;
}

}  // namespace flywheel::transport
