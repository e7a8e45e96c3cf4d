// Test and development certificates, generated with OpenSSL's API (no openssl binary
// needed): a CA, a server and a client certificate signed by it, and a second, unrelated
// CA with a client certificate that the first CA does not trust.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::transport {

struct CertificateOptions {
  // Subject alternative names of the server certificate: DNS names or IP addresses.
  std::vector<std::string> hosts = {"localhost", "127.0.0.1", "::1"};
  int valid_days = 30;
};

// Writes into `dir` (created if missing), each file atomically, keys with mode 0600:
//   ca.crt ca.key            the CA (self-signed)
//   server.crt server.key    a node certificate: serverAuth and clientAuth (a relay or a
//                            worker both listens and dials), SANs from options.hosts, signed by ca
//   client.crt client.key    clientAuth, signed by ca
//   rogue-ca.crt rogue.crt rogue.key   a client certificate from a CA that ca does not trust
// EC P-256 keys, SHA-256 signatures, serial numbers random.
Status WriteTestCertificates(const std::string& dir, const CertificateOptions& options = {});

}  // namespace flywheel::transport
