#include "sync/signing.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>

#include "base/env.h"
#include "base/hex.h"
#include "sync/catalog.h"
#include "transport/flywheel.pb.h"

namespace flywheel::sync {

namespace {

EVP_PKEY* Key(const std::shared_ptr<void>& key) { return static_cast<EVP_PKEY*>(key.get()); }

std::shared_ptr<void> Own(EVP_PKEY* key) {
  return std::shared_ptr<void>(key, [](void* p) { EVP_PKEY_free(static_cast<EVP_PKEY*>(p)); });
}

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  if (code == 0) return "unknown OpenSSL error";
  char text[256];
  ERR_error_string_n(code, text, sizeof text);
  ERR_clear_error();
  return text;
}

Result<std::string> RawPublic(EVP_PKEY* key) {
  std::string raw(32, '\0');
  size_t length = raw.size();
  if (EVP_PKEY_get_raw_public_key(key, reinterpret_cast<unsigned char*>(raw.data()), &length) != 1 ||
      length != 32) {
    return Status::Internal("cannot read an Ed25519 public key: " + OpenSslError());
  }
  return raw;
}

Result<std::string> KeyIdOf(EVP_PKEY* key) {
  FW_ASSIGN_OR_RETURN(std::string raw, RawPublic(key));
  const Sha256 digest = Sha256Of(std::as_bytes(std::span(raw.data(), raw.size())));
  return HexEncode(std::span<const uint8_t>(digest.data(), 8));
}

Result<std::string> ReadSmallFile(const std::string& path, const std::string& what) {
  Result<std::vector<std::byte>> bytes = Env::Default()->ReadFile(path);
  if (!bytes.ok()) return bytes.status().WithContext(what);
  if (bytes->size() > 64 * 1024) return Status::InvalidArgument(what + " " + path + " is not a key file (over 64 KiB)");
  return std::string(reinterpret_cast<const char*>(bytes->data()), bytes->size());
}

// Writes `text` to a new file `path` with exactly `mode` (whatever the umask), synced;
// refuses an existing file. The directory is synced by the caller once both halves are
// written.
Status WriteNewFile(Env* env, const std::string& path, const std::string& text, uint32_t mode) {
  if (env->FileExists(path)) {
    return Status::InvalidArgument(path + " exists; refusing to overwrite a key (move it away first)");
  }
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                      env->NewWritableFile(path, Env::OpenMode::kCreateNew, mode));
  Status status = file->Append(std::as_bytes(std::span(text.data(), text.size())));
  if (status.ok()) status = file->Sync();
  if (status.ok()) status = file->Close();
  if (!status.ok()) (void)env->RemoveFile(path);
  return status;
}

// Parses an Ed25519 key from PEM text: the private half (PKCS#8) or the public one (SPKI).
// `what` ("signing key", "trusted key") and `path` name it in errors; `expected` says what
// a file of the wrong kind should have been.
Result<std::shared_ptr<void>> ParseEd25519(const std::string& pem, bool private_half,
                                           const std::string& what, const std::string& path,
                                           const std::string& expected) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())),
                                                BIO_free);
  EVP_PKEY* raw = private_half ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr)
                               : PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr);
  if (raw == nullptr) {
    ERR_clear_error();
    return Status::InvalidArgument(what + " " + path + " is not " + expected);
  }
  std::shared_ptr<void> key = Own(raw);
  if (EVP_PKEY_get_id(raw) != EVP_PKEY_ED25519) {
    return Status::InvalidArgument(what + " " + path + " is not an Ed25519 key");
  }
  return key;
}

Result<std::string> Pem(EVP_PKEY* key, bool private_half) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
  const int ok = private_half
                     ? PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr)
                     : PEM_write_bio_PUBKEY(bio.get(), key);
  if (ok != 1) return Status::Internal("cannot encode a key as PEM: " + OpenSslError());
  char* data = nullptr;
  const long length = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(length));
}

std::string Bytes(const Sha256& digest) {
  return std::string(reinterpret_cast<const char*>(digest.data()), digest.size());
}

Sha256 PiecesSha256(const ArtifactInfo& info) {
  std::vector<uint8_t> bytes(info.piece_hashes.size() * 8);
  for (size_t i = 0; i < info.piece_hashes.size(); ++i) {
    for (int b = 0; b < 8; ++b) bytes[i * 8 + b] = static_cast<uint8_t>(info.piece_hashes[i] >> (8 * b));
  }
  return Sha256Of(std::as_bytes(std::span(bytes)));
}

}  // namespace

Sha256 Sha256Of(std::span<const std::byte> bytes) {
  Sha256 digest{};
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

std::string NewRunId() {
  unsigned char bytes[8];
  if (RAND_bytes(bytes, sizeof bytes) != 1) {
    std::random_device device;
    for (auto& b : bytes) b = static_cast<unsigned char>(device());
  }
  return HexEncode(std::span<const uint8_t>(bytes, sizeof bytes));
}

Result<KeyFiles> GenerateSigningKeys(const std::string& dir, Env* env) {
  FW_RETURN_IF_ERROR(env->CreateDirs(dir).WithContext("the key directory"));
  EVP_PKEY* raw = EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519");
  if (raw == nullptr) return Status::Internal("cannot generate an Ed25519 key: " + OpenSslError());
  std::shared_ptr<void> key = Own(raw);
  KeyFiles files;
  files.private_key = (std::filesystem::path(dir) / "signing.key").string();
  files.public_key = (std::filesystem::path(dir) / "signing.pub").string();
  if (env->FileExists(files.private_key) || env->FileExists(files.public_key)) {
    return Status::InvalidArgument(dir + " already holds signing.key or signing.pub; refusing to overwrite a key");
  }
  FW_ASSIGN_OR_RETURN(std::string private_pem, Pem(raw, true));
  FW_ASSIGN_OR_RETURN(std::string public_pem, Pem(raw, false));
  FW_RETURN_IF_ERROR(WriteNewFile(env, files.private_key, private_pem, 0600));
  Status written = WriteNewFile(env, files.public_key, public_pem, 0644);
  if (written.ok()) written = env->SyncDir(DirName(files.private_key));
  if (!written.ok()) {
    (void)env->RemoveFile(files.private_key);
    (void)env->RemoveFile(files.public_key);
    return written;
  }
  FW_ASSIGN_OR_RETURN(files.key_id, KeyIdOf(raw));
  return files;
}

Result<SigningKey> SigningKey::Load(const std::string& path) {
  FW_RETURN_IF_ERROR(CheckPrivateFile(path, "signing key"));
  FW_ASSIGN_OR_RETURN(std::string pem, ReadSmallFile(path, "signing key"));
  SigningKey key;
  FW_ASSIGN_OR_RETURN(key.key_, ParseEd25519(pem, true, "signing key", path,
                                             "a PEM private key (flywheel keys generate writes one)"));
  FW_ASSIGN_OR_RETURN(key.key_id_, KeyIdOf(Key(key.key_)));
  return key;
}

std::string SigningKey::public_pem() const {
  Result<std::string> pem = Pem(Key(key_), false);
  return pem.ok() ? *pem : std::string();
}

std::string SigningKey::Sign(std::string_view message) const {
  std::string signature(64, '\0');
  size_t length = signature.size();
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (EVP_DigestSignInit(context.get(), nullptr, nullptr, nullptr, Key(key_)) != 1 ||
      EVP_DigestSign(context.get(), reinterpret_cast<unsigned char*>(signature.data()), &length,
                     reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1) {
    // Ed25519 signing cannot fail on a loaded key short of memory exhaustion.
    throw std::runtime_error("Ed25519 signing failed: " + OpenSslError());
  }
  signature.resize(length);
  return signature;
}

Result<TrustedKeys> TrustedKeys::Load(const std::vector<std::string>& paths) {
  TrustedKeys trusted;
  for (const std::string& path : paths) {
    FW_ASSIGN_OR_RETURN(std::string pem, ReadSmallFile(path, "trusted key"));
    if (pem.find("PRIVATE KEY") != std::string::npos) {
      return Status::InvalidArgument("trusted key " + path +
                                     " is a private key: give the public half (signing.pub); "
                                     "the private key stays on the publisher");
    }
    FW_ASSIGN_OR_RETURN(std::shared_ptr<void> key,
                        ParseEd25519(pem, false, "trusted key", path,
                                     "a PEM public key (signing.pub from flywheel keys generate)"));
    FW_ASSIGN_OR_RETURN(std::string id, KeyIdOf(Key(key)));
    trusted.keys_[id] = key;
  }
  return trusted;
}

TrustedKeys TrustedKeys::Of(const SigningKey& key) {
  TrustedKeys trusted;
  trusted.keys_[key.key_id()] = key.key_;
  return trusted;
}

std::vector<std::string> TrustedKeys::key_ids() const {
  std::vector<std::string> ids;
  for (const auto& [id, key] : keys_) ids.push_back(id);
  return ids;
}

Status TrustedKeys::Verify(const std::string& key_id, std::string_view message,
                           std::string_view signature) const {
  auto it = keys_.find(key_id);
  if (it == keys_.end()) return Status::Mismatch("signed by key " + key_id + ", which is not trusted");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (EVP_DigestVerifyInit(context.get(), nullptr, nullptr, nullptr, Key(it->second)) != 1) {
    return Status::Internal("cannot start an Ed25519 verification: " + OpenSslError());
  }
  const int ok = EVP_DigestVerify(context.get(), reinterpret_cast<const unsigned char*>(signature.data()),
                                  signature.size(), reinterpret_cast<const unsigned char*>(message.data()),
                                  message.size());
  ERR_clear_error();
  if (ok != 1) return Status::Mismatch("bad signature (key " + key_id + ")");
  return Status::Ok();
}

Result<SignedManifest> SignArtifact(const SigningKey& key, const ArtifactInfo& info,
                                    std::span<const std::byte> artifact, const std::string& run_id,
                                    uint64_t created_unix_ms) {
  if (artifact.size() != info.size_bytes) {
    return Status::Mismatch(Describe(KeyOf(info)) + ": " + std::to_string(artifact.size()) +
                            " bytes on disk, " + std::to_string(info.size_bytes) + " in the log");
  }
  wire::ArtifactManifest manifest;
  manifest.set_domain(kManifestDomain);
  manifest.set_run_id(run_id);
  manifest.set_kind(info.kind == ArtifactKind::kKeyframe ? wire::KEYFRAME : wire::DELTA);
  manifest.set_version(info.target_version);
  if (info.kind == ArtifactKind::kDelta) {
    manifest.set_base_version(info.base_version);
    manifest.set_base_hash(HashBytesOf(info.base_hash));
  }
  manifest.set_target_hash(HashBytesOf(info.target_hash));
  manifest.set_size_bytes(info.size_bytes);
  manifest.set_sha256(Bytes(Sha256Of(artifact)));
  manifest.set_piece_bytes(info.piece_bytes);
  manifest.set_pieces_sha256(Bytes(PiecesSha256(info)));
  manifest.set_created_unix_ms(created_unix_ms);
  manifest.set_key_id(key.key_id());
  SignedManifest signed_manifest;
  if (!manifest.SerializeToString(&signed_manifest.manifest)) {
    return Status::Internal("cannot serialize the manifest of " + Describe(KeyOf(info)));
  }
  signed_manifest.signature = key.Sign(signed_manifest.manifest);
  return signed_manifest;
}

Result<ManifestFacts> VerifyManifest(const TrustedKeys& trusted, const SignedManifest& signed_manifest,
                                     const ArtifactInfo& info) {
  const std::string what = Describe(KeyOf(info));
  if (signed_manifest.manifest.empty() || signed_manifest.signature.empty()) {
    return Status::Mismatch(what + " is unsigned");
  }
  wire::ArtifactManifest manifest;
  if (signed_manifest.manifest.size() > 4096 || !manifest.ParseFromString(signed_manifest.manifest)) {
    return Status::Mismatch(what + ": the signed manifest does not parse");
  }
  if (Status verified = trusted.Verify(manifest.key_id(), signed_manifest.manifest, signed_manifest.signature);
      !verified.ok()) {
    return verified.WithContext(what);
  }
  // Signed by a trusted key: now it must describe exactly this catalog entry.
  auto differs = [&](const std::string& field) {
    return Status::Mismatch(what + ": the signed manifest's " + field + " differs from the catalog's");
  };
  if (manifest.domain() != kManifestDomain) return differs("domain");
  const wire::ArtifactKind kind = info.kind == ArtifactKind::kKeyframe ? wire::KEYFRAME : wire::DELTA;
  if (manifest.kind() != kind) return differs("kind");
  if (manifest.version() != info.target_version) {
    return Status::Mismatch(what + ": the signed manifest is for v" + std::to_string(manifest.version()));
  }
  if (info.kind == ArtifactKind::kDelta &&
      (manifest.base_version() != info.base_version || manifest.base_hash() != HashBytesOf(info.base_hash))) {
    return differs("base");
  }
  if (manifest.target_hash() != HashBytesOf(info.target_hash)) return differs("target hash");
  if (manifest.size_bytes() != info.size_bytes) return differs("size");
  if (manifest.piece_bytes() != info.piece_bytes) return differs("piece size");
  if (manifest.pieces_sha256() != Bytes(PiecesSha256(info))) return differs("piece hashes");
  if (manifest.sha256().size() != 32) return differs("sha256");
  ManifestFacts facts;
  facts.run_id = manifest.run_id();
  facts.version = manifest.version();
  facts.created_unix_ms = manifest.created_unix_ms();
  facts.key_id = manifest.key_id();
  std::memcpy(facts.sha256.data(), manifest.sha256().data(), 32);
  return facts;
}

Status CheckArtifactBytes(const ManifestFacts& facts, const ArtifactInfo& info,
                          std::span<const std::byte> bytes) {
  if (Sha256Of(bytes) != facts.sha256) {
    return Status::Mismatch(Describe(KeyOf(info)) +
                            ": its bytes do not have the signed SHA-256 (forged or corrupted upstream)");
  }
  return Status::Ok();
}

Status CheckFresh(const ManifestFacts& served, const ManifestFacts& candidate) {
  if (served.run_id.empty()) return Status::Ok();
  if (candidate.run_id == served.run_id) {
    if (candidate.version > served.version) return Status::Ok();
    return Status::Mismatch("v" + std::to_string(candidate.version) + " of run " + candidate.run_id +
                            " is not above the served v" + std::to_string(served.version) +
                            " (a replayed version)");
  }
  if (candidate.created_unix_ms > served.created_unix_ms) return Status::Ok();
  return Status::Mismatch("v" + std::to_string(candidate.version) + " of run " + candidate.run_id +
                          " was signed before the served v" + std::to_string(served.version) +
                          " of run " + served.run_id + " (an older run replayed)");
}

}  // namespace flywheel::sync
