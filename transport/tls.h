// TLS 1.3 contexts (OpenSSL through Asio) for the data plane and the HTTP endpoints.
//
// The same three flags configure every role: --tls-cert/--tls-key are this process's
// certificate chain and private key (PEM), --tls-ca the CA bundle that peers are verified
// against. A server with a CA requires and verifies client certificates (mutual auth); a
// client always verifies the server against the CA and presents its certificate when it
// has one.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "transport/asio.h"

namespace flywheel::transport {

struct TlsOptions {
  std::string cert_file;
  std::string key_file;
  std::string ca_file;
  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !ca_file.empty(); }
};

// TLS 1.3 only. REQUIRES cert_file and key_file (InvalidArgument otherwise). With ca_file,
// clients must present a certificate signed by it (verify_peer | fail_if_no_peer_cert).
// Errors name the file and OpenSSL's reason (missing file, key does not match cert, ...).
Result<std::shared_ptr<asio::ssl::context>> MakeServerTlsContext(const TlsOptions& options);

// TLS 1.3 only. REQUIRES ca_file (the server is always verified). cert_file/key_file, when
// given (both or neither), are presented for mutual authentication.
Result<std::shared_ptr<asio::ssl::context>> MakeClientTlsContext(const TlsOptions& options);

// TLS 1.3 suites in order of preference: AES-128-GCM first where this CPU has AES-NI and
// carry-less multiply (the cheapest AEAD there), ChaCha20-Poly1305 first where it does not.
// Servers choose by their own order but take ChaCha20 when a client lists it first.
bool HasAesHardware();
std::string PreferredTlsSuites();

// Drains OpenSSL's thread-local error queue into one line ("unknown OpenSSL error" when
// empty), for the error messages of this module and of transport/certs.h.
std::string OpenSslErrors();

}  // namespace flywheel::transport
