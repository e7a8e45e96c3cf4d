// A relay's or worker's check of the catalogs it receives against its trusted keys
// (sync/signing.h): unsigned or forged artifacts are dropped before anything is fetched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "sync/catalog.h"
#include "sync/signing.h"

namespace flywheel::sync {

// Steps 1-3 of sync/signing.h. Network-thread state; not thread-safe.
class CatalogVerifier {
 public:
  explicit CatalogVerifier(TrustedKeys trusted) : trusted_(std::move(trusted)) {}
  bool enabled() const { return !trusted_.empty(); }
  uint64_t trusted_keys() const { return trusted_.key_ids().size(); }
  // Without trusted keys, does nothing. Else drops every artifact whose signed manifest
  // does not verify or describe it, keeps the facts of the others, and lowers the head to
  // the newest artifact left (a forged head cannot make a node look stale).
  //
  // A refusal is counted (failures()) and logged once per artifact and signature while
  // remembered: only the last refused signature of each artifact is remembered (as a
  // 64-bit hash), and only while catalogs keep listing the artifact. So what a node keeps
  // is bounded by the last catalog (itself bounded by the frame header limit), however
  // many forgeries arrive; an artifact refused again with another signature, or after
  // leaving the catalog, is counted again. One log line per catalog with new refusals.
  void Filter(Catalog* catalog, const std::string& who);
  // Refusals remembered now (see Filter): at most one per artifact of the last catalog.
  size_t remembered_refusals() const { return counted_.size(); }
  // The verified facts of an artifact of the last filtered catalog; null if none.
  const ManifestFacts* FactsOf(const ArtifactKey& key) const;
  // A downloaded artifact whose bytes do not have the signed SHA-256, or a validly signed
  // version that CheckFresh refused.
  void CountForged(const std::string& message);
  void CountReplay(const std::string& message);
  uint64_t failures() const { return failures_; }
  uint64_t replays() const { return replays_; }
  const std::string& last_error() const { return last_error_; }

 private:
  // The steps of Filter (catalog_verifier.cc).
  struct Refusals;
  // Keeps the finished artifacts whose signed manifest verifies (their facts in facts_),
  // moves the streaming ones to `streaming`, and refuses the rest with their signatures.
  std::vector<ArtifactInfo> KeepVerified(Catalog* catalog, std::vector<ArtifactInfo>* streaming,
                                         Refusals* refusals);
  // Adds to `kept` the streaming entries within the bound that the verified ones set.
  void KeepBoundedStreaming(std::vector<ArtifactInfo> streaming, std::vector<ArtifactInfo>* kept,
                            Refusals* refusals);
  // Counts and remembers a refusal of `key` (see Filter) unless this signature was refused
  // before.
  void Refuse(Refusals* refusals, const ArtifactKey& key, uint64_t signature_hash,
              std::string message, bool failure);

  TrustedKeys trusted_;
  std::map<ArtifactKey, ManifestFacts> facts_;
  // Artifact of the last catalog -> hash of its last refused signature (0: refused for
  // its streaming bound).
  std::map<ArtifactKey, uint64_t> counted_;
  uint64_t failures_ = 0;
  uint64_t replays_ = 0;
  std::string last_error_;
};

}  // namespace flywheel::sync
