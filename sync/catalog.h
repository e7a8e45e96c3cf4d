// The catalog on the wire: the artifacts a publisher or relay serves (checked and ordered
// as received), the head version and hash, the staleness bound, and the publisher's
// signed manifests. ToWire/FromWire convert to and from transport/flywheel.proto; FromWire
// checks everything a peer may get wrong (sizes, hash lengths, piece counts).
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/hash.h"
#include "sync/signing.h"
#include "sync/version_log.h"
#include "transport/flywheel.pb.h"

namespace flywheel::sync {

std::string HashBytesOf(const Hash128& hash);  // 16 bytes, low half first
Result<Hash128> HashFromBytes(const std::string& bytes, const std::string& what);

// The largest bound a streaming catalog entry may announce (address space a node reserves
// for it; memory is used only as pieces arrive).
inline constexpr uint64_t kMaxStreamingBound = uint64_t{4} << 40;

wire::Artifact ToWire(const ArtifactInfo& info);
// Checks what a peer sent: sizes, hash lengths, piece count consistent with the size.
Result<ArtifactInfo> FromWire(const wire::Artifact& artifact, uint64_t max_piece_bytes);

// Identifies an artifact within a catalog.
struct ArtifactKey {
  ArtifactKind kind = ArtifactKind::kKeyframe;
  uint64_t target_version = 0;
  auto operator<=>(const ArtifactKey&) const = default;
};
inline ArtifactKey KeyOf(const ArtifactInfo& info) { return {info.kind, info.target_version}; }
std::string Describe(const ArtifactKey& key);  // "delta v12", "keyframe v10"

// A catalog as received: artifacts checked and ordered, head and staleness bound.
struct Catalog {
  std::vector<ArtifactInfo> artifacts;
  uint64_t head_version = 0;
  Hash128 head_hash;
  uint64_t max_staleness = 0;
  // The publisher's signed manifests (sync/signing.h), for the artifacts it signed.
  std::map<ArtifactKey, SignedManifest> signatures;
  const ArtifactInfo* Find(const ArtifactKey& key) const;
  const SignedManifest* SignatureOf(const ArtifactKey& key) const;
};
// Sorts artifacts in the order of Catalog::artifacts: by target version, a keyframe
// before the delta of the same version.
void SortArtifacts(std::vector<ArtifactInfo>* artifacts);
wire::Catalog ToWire(const Catalog& catalog);
Result<Catalog> FromWire(const wire::Catalog& catalog, uint64_t max_piece_bytes);

}  // namespace flywheel::sync
