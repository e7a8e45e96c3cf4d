// Publisher-signed versions: what a relay or worker checks before it caches, forwards or
// applies anything, so that whoever serves the bytes (a relay with a valid certificate, a
// compromised host) cannot make a worker serve weights the publisher did not publish.
//
// Keys are Ed25519 (OpenSSL EVP), in PEM files: the private key as PKCS#8 (`signing.key`,
// which must not be readable by group or others: 0600), the public key as
// SubjectPublicKeyInfo (`signing.pub`). A key's id is the hex of the first 8 bytes of the
// SHA-256 of its 32 raw public bytes.
//
// For every artifact it serves, a publisher with a signing key signs an ArtifactManifest
// (transport/flywheel.proto): the run id, kind, version, base version and hash, target
// weights hash, size, the SHA-256 of the whole artifact, the piece size and a SHA-256 over
// the piece hashes, the creation time and the key id. The catalog carries the serialized
// manifest and the signature over exactly those bytes (wire::Artifact fields 9 and 10).
//
// A verifier (`--trust-key`, repeatable so a key can be rotated):
//   1. VerifyManifest: the signature verifies under a trusted key whose id the manifest
//      names, the domain is flywheel's, and every field equals the catalog entry (so the
//      catalog's XXH3 piece hashes, which pieces are checked against in transit, are the
//      publisher's);
//   2. CheckArtifactBytes: before applying (a worker) or keeping (a relay) a downloaded
//      artifact, its SHA-256 equals the manifest's — XXH3 catches transmission errors, the
//      SHA-256 catches a forger;
//   3. Freshness (ReplayRule): under one run id versions only go up; a manifest of another
//      run id is accepted only if it was created after the one served (a new run, not an
//      old one replayed).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/env.h"
#include "base/status.h"
#include "sync/version_log.h"

namespace flywheel::sync {

inline constexpr const char* kManifestDomain = "flywheel.artifact.v1";

using Sha256 = std::array<uint8_t, 32>;
Sha256 Sha256Of(std::span<const std::byte> bytes);

// A key pair on disk. Generate refuses to overwrite either file.
struct KeyFiles {
  std::string private_key;  // <dir>/signing.key, mode 0600
  std::string public_key;   // <dir>/signing.pub
  std::string key_id;
};
Result<KeyFiles> GenerateSigningKeys(const std::string& dir, Env* env = Env::Default());

class SigningKey {
 public:
  // Refuses a file readable by group or others, a missing file, and anything that is not
  // an Ed25519 private key, each with the path in the message.
  static Result<SigningKey> Load(const std::string& path);
  const std::string& key_id() const { return key_id_; }
  std::string public_pem() const;
  // The 64-byte Ed25519 signature of `message`.
  std::string Sign(std::string_view message) const;

 private:
  friend class TrustedKeys;
  std::shared_ptr<void> key_;  // EVP_PKEY
  std::string key_id_;
};

class TrustedKeys {
 public:
  // Each file is a public key (signing.pub); a private key file is refused (it must not be
  // copied to the fleet). No files: an empty set (nothing is checked).
  static Result<TrustedKeys> Load(const std::vector<std::string>& paths);
  static TrustedKeys Of(const SigningKey& key);  // the key's own public half
  bool empty() const { return keys_.empty(); }
  std::vector<std::string> key_ids() const;
  // OK iff `signature` is a valid signature of `message` by the key named `key_id`.
  Status Verify(const std::string& key_id, std::string_view message,
                std::string_view signature) const;

 private:
  std::map<std::string, std::shared_ptr<void>> keys_;  // key id -> EVP_PKEY
};

// What the catalog carries beside an artifact.
struct SignedManifest {
  std::string manifest;   // a serialized wire::ArtifactManifest
  std::string signature;  // Ed25519, 64 bytes
  bool operator==(const SignedManifest&) const = default;
};

// The fields of a verified manifest that later checks use.
struct ManifestFacts {
  std::string run_id;
  uint64_t version = 0;
  uint64_t created_unix_ms = 0;
  std::string key_id;
  Sha256 sha256{};
};

// Signs `info` (an artifact whose bytes are `artifact`).
Result<SignedManifest> SignArtifact(const SigningKey& key, const ArtifactInfo& info,
                                    std::span<const std::byte> artifact,
                                    const std::string& run_id, uint64_t created_unix_ms);

// Step 1 above. Errors are kMismatch and name the artifact and what did not hold
// ("unsigned", "signed by unknown key 1a2b...", "bad signature", "says v7 but the catalog
// says v9", ...).
Result<ManifestFacts> VerifyManifest(const TrustedKeys& trusted, const SignedManifest& signed_manifest,
                                     const ArtifactInfo& info);

// Step 2 above.
Status CheckArtifactBytes(const ManifestFacts& facts, const ArtifactInfo& info,
                          std::span<const std::byte> bytes);

// Step 3 above: `served` is the manifest of the version served now (run_id empty: none).
// OK, or kMismatch naming the replay.
Status CheckFresh(const ManifestFacts& served, const ManifestFacts& candidate);

// A new random run id: 16 hex digits.
std::string NewRunId();

}  // namespace flywheel::sync
