// Test certificates and TLS contexts: good configurations load, bad ones fail with a
// status that names the file.
#include "transport/tls.h"

#include <gtest/gtest.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "tests/transport/cert_suite.h"
#include "transport/certs.h"

namespace flywheel::transport {
namespace {

namespace fs = std::filesystem;

class TlsTest : public CertificateSuite {};

struct X509Deleter {
  void operator()(X509* cert) const { X509_free(cert); }
};
using CertPtr = std::unique_ptr<X509, X509Deleter>;

CertPtr ReadCert(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return nullptr;
  CertPtr cert(PEM_read_X509(file, nullptr, nullptr, nullptr));
  std::fclose(file);
  return cert;
}

// Verifies `leaf` against `ca` for `purpose` (X509_PURPOSE_SSL_SERVER / _CLIENT).
bool Verifies(X509* leaf, X509* ca, int purpose) {
  X509_STORE* store = X509_STORE_new();
  X509_STORE_add_cert(store, ca);
  X509_STORE_CTX* context = X509_STORE_CTX_new();
  X509_STORE_CTX_init(context, store, leaf, nullptr);
  X509_STORE_CTX_set_purpose(context, purpose);
  bool ok = X509_verify_cert(context) == 1;
  X509_STORE_CTX_free(context);
  X509_STORE_free(store);
  return ok;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
}

TEST_F(TlsTest, WritesEveryFileWithKeysPrivate) {
  for (const char* name : {"ca.crt", "server.crt", "client.crt", "rogue-ca.crt", "rogue.crt"}) {
    struct stat info {};
    ASSERT_EQ(::stat(Path(name).c_str(), &info), 0) << name;
    EXPECT_EQ(info.st_mode & 0777, 0644u) << name;
  }
  for (const char* name : {"ca.key", "server.key", "client.key", "rogue.key"}) {
    struct stat info {};
    ASSERT_EQ(::stat(Path(name).c_str(), &info), 0) << name;
    EXPECT_EQ(info.st_mode & 0777, 0600u) << name;
  }
  for (const auto& entry : fs::directory_iterator(*dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos)
        << "temporary file left behind: " << entry.path();
  }
}

TEST_F(TlsTest, CertificatesChainToTheRightCa) {
  CertPtr ca = ReadCert(Path("ca.crt"));
  CertPtr server = ReadCert(Path("server.crt"));
  CertPtr client = ReadCert(Path("client.crt"));
  CertPtr rogue_ca = ReadCert(Path("rogue-ca.crt"));
  CertPtr rogue = ReadCert(Path("rogue.crt"));
  ASSERT_TRUE(ca && server && client && rogue_ca && rogue);

  EXPECT_EQ(X509_check_ca(ca.get()), 1);
  EXPECT_TRUE(Verifies(server.get(), ca.get(), X509_PURPOSE_SSL_SERVER));
  EXPECT_TRUE(Verifies(client.get(), ca.get(), X509_PURPOSE_SSL_CLIENT));
  EXPECT_FALSE(Verifies(client.get(), ca.get(), X509_PURPOSE_SSL_SERVER));
  // The server certificate is a node's: relays and workers listen and dial with it.
  EXPECT_TRUE(Verifies(server.get(), ca.get(), X509_PURPOSE_SSL_CLIENT));
  EXPECT_FALSE(Verifies(rogue.get(), ca.get(), X509_PURPOSE_SSL_CLIENT));
  EXPECT_TRUE(Verifies(rogue.get(), rogue_ca.get(), X509_PURPOSE_SSL_CLIENT));

  // Different serials, even for certificates with identical subjects.
  EXPECT_NE(
      ASN1_INTEGER_cmp(X509_get_serialNumber(client.get()), X509_get_serialNumber(rogue.get())), 0);
}

TEST_F(TlsTest, ServerCertificateNamesTheDefaultHosts) {
  CertPtr server = ReadCert(Path("server.crt"));
  ASSERT_TRUE(server);
  EXPECT_EQ(X509_check_host(server.get(), "localhost", 0, 0, nullptr), 1);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "127.0.0.1", 0), 1);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "::1", 0), 1);
  EXPECT_NE(X509_check_host(server.get(), "example.com", 0, 0, nullptr), 1);
  EXPECT_NE(X509_check_ip_asc(server.get(), "10.0.0.1", 0), 1);
  // An address must not match as a DNS name, nor a name as an address.
  EXPECT_NE(X509_check_host(server.get(), "127.0.0.1", 0, 0, nullptr), 1);
}

TEST_F(TlsTest, CustomHostsBecomeDnsOrIpNames) {
  const std::string dir = *dir_ + "/custom";
  CertificateOptions options;
  options.hosts = {"node-7.cluster.internal", "10.1.2.3", "[fd00::7]"};
  options.valid_days = 2;
  ASSERT_TRUE(WriteTestCertificates(dir, options).ok());
  CertPtr server = ReadCert(dir + "/server.crt");
  ASSERT_TRUE(server);
  EXPECT_EQ(X509_check_host(server.get(), "node-7.cluster.internal", 0, 0, nullptr), 1);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "10.1.2.3", 0), 1);
  EXPECT_EQ(X509_check_ip_asc(server.get(), "fd00::7", 0), 1);
  EXPECT_NE(X509_check_host(server.get(), "localhost", 0, 0, nullptr), 1);
}

TEST_F(TlsTest, CertificateOptionsAreChecked) {
  CertificateOptions no_hosts;
  no_hosts.hosts.clear();
  EXPECT_EQ(WriteTestCertificates(*dir_ + "/bad", no_hosts).code(), StatusCode::kInvalidArgument);
  CertificateOptions no_days;
  no_days.valid_days = 0;
  EXPECT_EQ(WriteTestCertificates(*dir_ + "/bad", no_days).code(), StatusCode::kInvalidArgument);
}

TEST_F(TlsTest, UnwritableDirectoryFails) {
  const std::string file = Path("not-a-dir");
  WriteFile(file, "x");
  Status status = WriteTestCertificates(file + "/sub");
  EXPECT_EQ(status.code(), StatusCode::kIOError) << status.ToString();
  EXPECT_NE(status.message().find("not-a-dir"), std::string::npos) << status.ToString();
}

TEST_F(TlsTest, GoodConfigurationsLoad) {
  auto server = MakeServerTlsContext({Path("server.crt"), Path("server.key"), ""});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto mutual_server =
      MakeServerTlsContext({Path("server.crt"), Path("server.key"), Path("ca.crt")});
  ASSERT_TRUE(mutual_server.ok()) << mutual_server.status().ToString();
  EXPECT_EQ(SSL_CTX_get_verify_mode((*mutual_server)->native_handle()),
            SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT);
  auto client = MakeClientTlsContext({"", "", Path("ca.crt")});
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  EXPECT_EQ(SSL_CTX_get_verify_mode((*client)->native_handle()), SSL_VERIFY_PEER);
  auto mutual_client =
      MakeClientTlsContext({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  ASSERT_TRUE(mutual_client.ok()) << mutual_client.status().ToString();

  for (SSL_CTX* native : {(*server)->native_handle(), (*client)->native_handle()}) {
    EXPECT_EQ(SSL_CTX_get_min_proto_version(native), TLS1_3_VERSION);
    EXPECT_EQ(SSL_CTX_get_max_proto_version(native), TLS1_3_VERSION);
  }
}

TEST_F(TlsTest, MissingOptionsAreInvalidArguments) {
  EXPECT_EQ(MakeServerTlsContext({"", "", Path("ca.crt")}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeServerTlsContext({Path("server.crt"), "", ""}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeClientTlsContext({Path("client.crt"), Path("client.key"), ""}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeClientTlsContext({Path("client.crt"), "", Path("ca.crt")}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeClientTlsContext({"", Path("client.key"), Path("ca.crt")}).status().code(),
            StatusCode::kInvalidArgument);
}

// Expects `result` to fail with `code` and a message that contains `needle`.
template <typename T>
void ExpectFailure(const Result<T>& result, StatusCode code, const std::string& needle) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), code) << result.status().ToString();
  EXPECT_NE(result.status().message().find(needle), std::string::npos)
      << "'" << needle << "' not in: " << result.status().ToString();
}

TEST_F(TlsTest, MissingFilesAreNamed) {
  const std::string missing = Path("missing.crt");
  ExpectFailure(MakeServerTlsContext({missing, Path("server.key"), ""}), StatusCode::kIOError,
                missing);
  ExpectFailure(MakeServerTlsContext({Path("server.crt"), missing, ""}), StatusCode::kIOError,
                missing);
  ExpectFailure(MakeServerTlsContext({Path("server.crt"), Path("server.key"), missing}),
                StatusCode::kIOError, missing);
  ExpectFailure(MakeClientTlsContext({"", "", missing}), StatusCode::kIOError, missing);
  ExpectFailure(MakeClientTlsContext({missing, Path("client.key"), Path("ca.crt")}),
                StatusCode::kIOError, missing);
}

TEST_F(TlsTest, MismatchedKeyIsRejected) {
  auto server = MakeServerTlsContext({Path("server.crt"), Path("client.key"), ""});
  ExpectFailure(server, StatusCode::kMismatch, Path("client.key"));
  EXPECT_NE(server.status().message().find(Path("server.crt")), std::string::npos);
  auto client = MakeClientTlsContext({Path("client.crt"), Path("rogue.key"), Path("ca.crt")});
  ExpectFailure(client, StatusCode::kMismatch, Path("rogue.key"));
}

TEST_F(TlsTest, GarbageFilesAreCorruption) {
  const std::string garbage = Path("garbage.pem");
  WriteFile(garbage, "this is not PEM\n");
  ExpectFailure(MakeServerTlsContext({garbage, Path("server.key"), ""}), StatusCode::kCorruption,
                garbage);
  ExpectFailure(MakeServerTlsContext({Path("server.crt"), garbage, ""}), StatusCode::kCorruption,
                garbage);
  ExpectFailure(MakeClientTlsContext({"", "", garbage}), StatusCode::kCorruption, garbage);
  // A certificate where the key should be.
  ExpectFailure(MakeServerTlsContext({Path("server.crt"), Path("server.crt"), ""}),
                StatusCode::kCorruption, Path("server.crt"));
}

}  // namespace
}  // namespace flywheel::transport
