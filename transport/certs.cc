#include "transport/certs.h"

#include <fcntl.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "base/env.h"
#include "transport/tls.h"

namespace flywheel::transport {
namespace {

template <auto Free>
struct Deleter {
  template <typename T>
  void operator()(T* p) const {
    Free(p);
  }
};
using KeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY_free>>;
using CertPtr = std::unique_ptr<X509, Deleter<X509_free>>;
using BioPtr = std::unique_ptr<BIO, Deleter<BIO_free>>;
using BignumPtr = std::unique_ptr<BIGNUM, Deleter<BN_free>>;
using ExtensionPtr = std::unique_ptr<X509_EXTENSION, Deleter<X509_EXTENSION_free>>;
using NamesPtr = std::unique_ptr<GENERAL_NAMES, Deleter<GENERAL_NAMES_free>>;


Status OpenSslFailure(const std::string& what) {
  return Status::Internal("cannot " + what + ": " + OpenSslErrors());
}

Result<KeyPtr> NewKey() {
  KeyPtr key(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"));
  if (!key) return OpenSslFailure("generate an EC P-256 key");
  return key;
}

struct Issuer {
  X509* cert;  // null: self-signed
  EVP_PKEY* key;
};

Status AddExtension(X509* cert, X509* issuer_cert, int nid, const char* value) {
  X509V3_CTX context;
  X509V3_set_ctx(&context, issuer_cert, cert, nullptr, nullptr, 0);
  ExtensionPtr extension(X509V3_EXT_conf_nid(nullptr, &context, nid, value));
  if (!extension || X509_add_ext(cert, extension.get(), -1) != 1) {
    return OpenSslFailure(std::string("add certificate extension ") + OBJ_nid2sn(nid) + "=" +
                          value);
  }
  return Status::Ok();
}

// Entries that parse as IPv4/IPv6 addresses become IP names, everything else DNS names.
Status AddSubjectAltNames(X509* cert, const std::vector<std::string>& hosts) {
  NamesPtr names(sk_GENERAL_NAME_new_null());
  if (!names) return OpenSslFailure("allocate subjectAltName");
  for (std::string host : hosts) {
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    GENERAL_NAME* name = GENERAL_NAME_new();
    if (name == nullptr) return OpenSslFailure("allocate subjectAltName");
    if (ASN1_OCTET_STRING* address = a2i_IPADDRESS(host.c_str())) {
      GENERAL_NAME_set0_value(name, GEN_IPADD, address);
    } else {
      ERR_clear_error();
      ASN1_IA5STRING* dns = ASN1_IA5STRING_new();
      if (dns == nullptr || ASN1_STRING_set(dns, host.data(), static_cast<int>(host.size())) != 1) {
        ASN1_IA5STRING_free(dns);
        GENERAL_NAME_free(name);
        return OpenSslFailure("encode DNS name " + host);
      }
      GENERAL_NAME_set0_value(name, GEN_DNS, dns);
    }
    if (sk_GENERAL_NAME_push(names.get(), name) == 0) {
      GENERAL_NAME_free(name);
      return OpenSslFailure("build subjectAltName");
    }
  }
  if (X509_add1_ext_i2d(cert, NID_subject_alt_name, names.get(), 0, X509V3_ADD_DEFAULT) != 1) {
    return OpenSslFailure("add subjectAltName");
  }
  return Status::Ok();
}

struct CertSpec {
  std::string common_name;
  bool is_ca = false;
  const char* extended_key_usage = nullptr;  // "serverAuth", "clientAuth"
  std::vector<std::string> alt_names;
  int valid_days = 30;
};

// Issues a certificate for `key`; signed by `issuer`, or self-signed when issuer.cert is null.
Result<CertPtr> Issue(const CertSpec& spec, EVP_PKEY* key, const Issuer& issuer) {
  CertPtr cert(X509_new());
  if (!cert) return OpenSslFailure("allocate a certificate");
  X509* x = cert.get();

  BignumPtr serial(BN_new());
  if (!serial || BN_rand(serial.get(), 159, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
      BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(x)) == nullptr) {
    return OpenSslFailure("draw a serial number");
  }
  X509_NAME* subject = X509_get_subject_name(x);
  const auto* cn = reinterpret_cast<const unsigned char*>(spec.common_name.c_str());
  if (X509_set_version(x, X509_VERSION_3) != 1 ||
      X509_NAME_add_entry_by_txt(subject, "O", MBSTRING_ASC,
                                 reinterpret_cast<const unsigned char*>("flywheel"), -1, -1,
                                 0) != 1 ||
      X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC, cn, -1, -1, 0) != 1 ||
      X509_set_issuer_name(x, issuer.cert ? X509_get_subject_name(issuer.cert) : subject) != 1 ||
      // An hour of slack for clocks that are slightly behind.
      X509_gmtime_adj(X509_getm_notBefore(x), -3600) == nullptr ||
      X509_gmtime_adj(X509_getm_notAfter(x), 86400L * spec.valid_days) == nullptr ||
      X509_set_pubkey(x, key) != 1) {
    return OpenSslFailure("fill in certificate " + spec.common_name);
  }

  X509* issuer_cert = issuer.cert ? issuer.cert : x;
  if (spec.is_ca) {
    FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_basic_constraints, "critical,CA:TRUE"));
    FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_key_usage, "critical,keyCertSign,cRLSign"));
  } else {
    FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_basic_constraints, "critical,CA:FALSE"));
    FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_key_usage, "critical,digitalSignature"));
  }
  if (spec.extended_key_usage != nullptr) {
    FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_ext_key_usage, spec.extended_key_usage));
  }
  FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_subject_key_identifier, "hash"));
  FW_RETURN_IF_ERROR(AddExtension(x, issuer_cert, NID_authority_key_identifier, "keyid:always"));
  if (!spec.alt_names.empty()) FW_RETURN_IF_ERROR(AddSubjectAltNames(x, spec.alt_names));

  if (X509_sign(x, issuer.key, EVP_sha256()) == 0) {
    return OpenSslFailure("sign certificate " + spec.common_name);
  }
  return cert;
}

Result<CertPtr> IssueCa(const std::string& common_name, EVP_PKEY* key, int valid_days) {
  CertSpec spec;
  spec.common_name = common_name;
  spec.is_ca = true;
  spec.valid_days = valid_days;
  return Issue(spec, key, {nullptr, key});
}

Result<CertPtr> IssueLeaf(const std::string& common_name, const char* extended_key_usage,
                          const std::vector<std::string>& alt_names, EVP_PKEY* key,
                          const Issuer& issuer, int valid_days) {
  CertSpec spec;
  spec.common_name = common_name;
  spec.extended_key_usage = extended_key_usage;
  spec.alt_names = alt_names;
  spec.valid_days = valid_days;
  return Issue(spec, key, issuer);
}

Result<std::string> BioContents(BIO* bio) {
  char* data = nullptr;
  long size = BIO_get_mem_data(bio, &data);
  if (size < 0) return OpenSslFailure("read PEM buffer");
  return std::string(data, static_cast<size_t>(size));
}

Result<std::string> CertPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1) return OpenSslFailure("encode PEM");
  return BioContents(bio.get());
}

Result<std::string> KeyPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio ||
      PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslFailure("encode PEM");
  }
  return BioContents(bio.get());
}

// Writes through the Env's one atomic write (temporary file, fsync, rename, directory
// fsync), so a reader never sees a partial file and a failure leaves any previous file
// untouched; `mode` is the file's mode exactly (0600 for a private key).
Status WritePem(const std::string& path, const std::string& contents, uint32_t mode) {
  return WriteFileAtomically(path, std::as_bytes(std::span(contents.data(), contents.size())),
                             Env::Default(), mode);
}

Status WriteCert(const std::string& dir, const char* name, X509* cert) {
  FW_ASSIGN_OR_RETURN(std::string pem, CertPem(cert));
  return WritePem(dir + "/" + name, pem, 0644);
}

Status WriteKey(const std::string& dir, const char* name, EVP_PKEY* key) {
  FW_ASSIGN_OR_RETURN(std::string pem, KeyPem(key));
  return WritePem(dir + "/" + name, pem, 0600);
}

}  // namespace

Status WriteTestCertificates(const std::string& dir, const CertificateOptions& options) {
  if (options.hosts.empty()) {
    return Status::InvalidArgument("the server certificate needs at least one host name");
  }
  if (options.valid_days < 1 || options.valid_days > 36500) {
    return Status::InvalidArgument("certificate validity of " + std::to_string(options.valid_days) +
                                   " days, expected 1..36500");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create directory " + dir + ": " + ec.message());
  ERR_clear_error();

  FW_ASSIGN_OR_RETURN(KeyPtr ca_key, NewKey());
  FW_ASSIGN_OR_RETURN(KeyPtr server_key, NewKey());
  FW_ASSIGN_OR_RETURN(KeyPtr client_key, NewKey());
  FW_ASSIGN_OR_RETURN(KeyPtr rogue_ca_key, NewKey());
  FW_ASSIGN_OR_RETURN(KeyPtr rogue_key, NewKey());

  const int days = options.valid_days;
  FW_ASSIGN_OR_RETURN(CertPtr ca, IssueCa("flywheel test CA", ca_key.get(), days));
  const Issuer by_ca{ca.get(), ca_key.get()};
  FW_ASSIGN_OR_RETURN(CertPtr server, IssueLeaf(options.hosts.front(), "serverAuth,clientAuth",
                                                options.hosts, server_key.get(), by_ca, days));
  FW_ASSIGN_OR_RETURN(CertPtr client, IssueLeaf("flywheel client", "clientAuth", {},
                                                client_key.get(), by_ca, days));
  FW_ASSIGN_OR_RETURN(CertPtr rogue_ca, IssueCa("flywheel rogue CA", rogue_ca_key.get(), days));
  FW_ASSIGN_OR_RETURN(CertPtr rogue, IssueLeaf("flywheel client", "clientAuth", {}, rogue_key.get(),
                                               {rogue_ca.get(), rogue_ca_key.get()}, days));

  FW_RETURN_IF_ERROR(WriteCert(dir, "ca.crt", ca.get()));
  FW_RETURN_IF_ERROR(WriteKey(dir, "ca.key", ca_key.get()));
  FW_RETURN_IF_ERROR(WriteCert(dir, "server.crt", server.get()));
  FW_RETURN_IF_ERROR(WriteKey(dir, "server.key", server_key.get()));
  FW_RETURN_IF_ERROR(WriteCert(dir, "client.crt", client.get()));
  FW_RETURN_IF_ERROR(WriteKey(dir, "client.key", client_key.get()));
  FW_RETURN_IF_ERROR(WriteCert(dir, "rogue-ca.crt", rogue_ca.get()));
  FW_RETURN_IF_ERROR(WriteCert(dir, "rogue.crt", rogue.get()));
  FW_RETURN_IF_ERROR(WriteKey(dir, "rogue.key", rogue_key.get()));
  return Status::Ok();
}

}  // namespace flywheel::transport
