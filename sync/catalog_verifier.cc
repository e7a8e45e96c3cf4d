#include "sync/catalog_verifier.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <span>
#include <vector>

namespace flywheel::sync {

namespace {

// Lowers the head to the newest finished artifact left (a forged head cannot make a node
// look stale).
void LowerHead(Catalog* catalog) {
  uint64_t newest = 0;
  Hash128 newest_hash;
  for (const ArtifactInfo& info : catalog->artifacts) {
    if (!info.streaming && info.target_version >= newest) {
      newest = info.target_version;
      newest_hash = info.target_hash;
    }
  }
  if (catalog->head_version > newest ||
      (catalog->head_version == newest && catalog->head_hash != newest_hash)) {
    catalog->head_version = newest;
    catalog->head_hash = newest_hash;
  }
}

}  // namespace

// The refusals of one Filter call, for its log line.
struct CatalogVerifier::Refusals {
  size_t count = 0;
  std::string first;
};

void CatalogVerifier::Filter(Catalog* catalog, const std::string& who) {
  if (!enabled()) return;
  // Refusals of artifacts this catalog no longer lists are forgotten (see the header).
  std::set<ArtifactKey> listed;
  for (const ArtifactInfo& info : catalog->artifacts) listed.insert(KeyOf(info));
  std::erase_if(counted_, [&](const auto& refusal) { return !listed.count(refusal.first); });
  Refusals refusals;
  std::vector<ArtifactInfo> streaming;
  std::vector<ArtifactInfo> kept = KeepVerified(catalog, &streaming, &refusals);
  KeepBoundedStreaming(std::move(streaming), &kept, &refusals);
  if (refusals.count == 1) {
    spdlog::error("{}: refused: {}", who, refusals.first);
  } else if (refusals.count > 1) {
    spdlog::error("{}: refused {} artifacts of a catalog, the first: {}", who, refusals.count,
                  refusals.first);
  }
  SortArtifacts(&kept);
  catalog->artifacts = std::move(kept);
  LowerHead(catalog);
}

std::vector<ArtifactInfo> CatalogVerifier::KeepVerified(Catalog* catalog,
                                                        std::vector<ArtifactInfo>* streaming,
                                                        Refusals* refusals) {
  facts_.clear();
  std::vector<ArtifactInfo> kept;
  for (ArtifactInfo& info : catalog->artifacts) {
    const ArtifactKey key = KeyOf(info);
    if (info.streaming) {
      streaming->push_back(std::move(info));
      continue;
    }
    const SignedManifest* signed_manifest = catalog->SignatureOf(key);
    static const SignedManifest kUnsigned;
    Result<ManifestFacts> verified =
        VerifyManifest(trusted_, signed_manifest ? *signed_manifest : kUnsigned, info);
    if (!verified.ok()) {
      const std::string& signature = signed_manifest ? signed_manifest->signature : std::string();
      // 0 stands for the streaming bound below; a signature hashing to 0 is only counted
      // together with it.
      Refuse(refusals, key, HashBytes64(std::as_bytes(std::span(signature))) | 1,
             verified.status().message(), /*failure=*/true);
      catalog->signatures.erase(key);
      continue;
    }
    facts_[key] = *verified;
    kept.push_back(std::move(info));
  }
  return kept;
}

void CatalogVerifier::KeepBoundedStreaming(std::vector<ArtifactInfo> streaming,
                                           std::vector<ArtifactInfo>* kept, Refusals* refusals) {
  // Deltas (and keyframes) still streaming cannot be signed yet: they pass unverified, and nothing of
  // them is applied or kept before their finished, signed entry verifies. So that a forged
  // one cannot make a node fetch without end, one may list at most twice the largest
  // verified artifact (a delta is never larger than the dense checkpoint) plus 64 MiB.
  uint64_t largest = 0;
  for (const ArtifactInfo& info : *kept) largest = std::max(largest, info.size_bytes);
  const uint64_t streaming_limit = 2 * largest + (uint64_t{64} << 20);
  for (ArtifactInfo& info : streaming) {
    // A keyframe streams to nodes that hold nothing yet: only from a publisher that has
    // shown it signs (a verified artifact in this catalog), so that an unsigned publisher
    // makes a verifying fleet fetch nothing at all.
    if (info.kind == ArtifactKind::kKeyframe && largest == 0) continue;
    if (info.size_bound <= streaming_limit) {
      kept->push_back(std::move(info));
      continue;
    }
    Refuse(refusals, KeyOf(info), 0,
           Describe(KeyOf(info)) + " streams with a bound of " + std::to_string(info.size_bound) +
               " bytes, over " + std::to_string(streaming_limit) +
               " (twice the largest verified artifact); not fetched",
           /*failure=*/false);
  }
}

void CatalogVerifier::Refuse(Refusals* refusals, const ArtifactKey& key, uint64_t signature_hash,
                             std::string message, bool failure) {
  auto [it, inserted] = counted_.try_emplace(key, signature_hash);
  if (!inserted) {
    if (it->second == signature_hash) return;  // refused before with this signature
    it->second = signature_hash;
  }
  if (failure) ++failures_;
  if (refusals->count++ == 0) refusals->first = message;
  last_error_ = std::move(message);
}

const ManifestFacts* CatalogVerifier::FactsOf(const ArtifactKey& key) const {
  auto it = facts_.find(key);
  return it == facts_.end() ? nullptr : &it->second;
}

void CatalogVerifier::CountForged(const std::string& message) {
  ++failures_;
  last_error_ = message;
}

void CatalogVerifier::CountReplay(const std::string& message) {
  ++replays_;
  last_error_ = message;
}

}  // namespace flywheel::sync
