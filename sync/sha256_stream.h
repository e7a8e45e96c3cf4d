// The SHA-256 of an artifact computed while it downloads: every time a piece arrives, the
// hash advances over the pieces received in order from the start, so that when the last
// piece lands only the tail is left to hash (the transfer hides the rest). A relay and a
// worker check signed artifacts (sync/signing.h) with it. Not thread-safe: one per
// download, used on the network thread.
#pragma once

#include <openssl/evp.h>

#include <cstdint>
#include <memory>

#include "sync/upstream.h"
#include "sync/signing.h"

namespace flywheel::sync {

class PrefixSha256 {
 public:
  PrefixSha256() : context_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
    EVP_DigestInit_ex(context_.get(), EVP_sha256(), nullptr);
  }

  // Hashes the pieces of `download` from the first not yet hashed up to the first missing.
  void Advance(const Download& download) {
    while (next_ < download.have.size() && download.have[next_]) {
      const std::span<const std::byte> piece = download.piece(next_);
      EVP_DigestUpdate(context_.get(), piece.data(), piece.size());
      ++next_;
    }
  }

  // REQUIRES: download.complete(). The digest of the whole artifact.
  Sha256 Finish(const Download& download) {
    Advance(download);
    Sha256 digest{};
    unsigned int length = 0;
    EVP_DigestFinal_ex(context_.get(), digest.data(), &length);
    return digest;
  }

  // Whether a complete download has the signed SHA-256; kMismatch naming it otherwise
  // (the message CheckArtifactBytes gives).
  Status Check(const Download& download, const ManifestFacts& facts) {
    if (Finish(download) == facts.sha256) return Status::Ok();
    return Status::Mismatch(Describe(KeyOf(download.info)) +
                            ": its bytes do not have the signed SHA-256 (forged or corrupted upstream)");
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context_;
  uint32_t next_ = 0;
};

}  // namespace flywheel::sync
