#include "sync/catalog.h"

#include <algorithm>
#include <cstring>
#include <tuple>

namespace flywheel::sync {

std::string HashBytesOf(const Hash128& hash) {
  std::string bytes(16, '\0');
  std::memcpy(bytes.data(), &hash.low, 8);
  std::memcpy(bytes.data() + 8, &hash.high, 8);
  return bytes;
}

Result<Hash128> HashFromBytes(const std::string& bytes, const std::string& what) {
  if (bytes.size() != 16) {
    return Status::Corruption(what + " is " + std::to_string(bytes.size()) + " bytes, not 16");
  }
  Hash128 hash;
  std::memcpy(&hash.low, bytes.data(), 8);
  std::memcpy(&hash.high, bytes.data() + 8, 8);
  return hash;
}

wire::Artifact ToWire(const ArtifactInfo& info) {
  wire::Artifact artifact;
  artifact.set_kind(info.kind == ArtifactKind::kKeyframe ? wire::KEYFRAME : wire::DELTA);
  artifact.set_base_version(info.base_version);
  artifact.set_target_version(info.target_version);
  if (info.kind == ArtifactKind::kDelta) artifact.set_base_hash(HashBytesOf(info.base_hash));
  if (!info.streaming) artifact.set_target_hash(HashBytesOf(info.target_hash));
  artifact.set_size_bytes(info.size_bytes);
  artifact.set_piece_bytes(info.piece_bytes);
  for (uint64_t hash : info.piece_hashes) artifact.add_piece_hashes(hash);
  if (info.streaming) {
    artifact.set_streaming(true);
    artifact.set_size_bound(info.size_bound);
  }
  return artifact;
}

std::string Describe(const ArtifactKey& key) {
  return std::string(ArtifactKindName(key.kind)) + " v" + std::to_string(key.target_version);
}

Result<ArtifactInfo> FromWire(const wire::Artifact& artifact, uint64_t max_piece_bytes) {
  ArtifactInfo info;
  info.kind = artifact.kind() == wire::KEYFRAME ? ArtifactKind::kKeyframe : ArtifactKind::kDelta;
  const std::string what = "catalog entry " + Describe(KeyOf(info));
  if (artifact.kind() != wire::KEYFRAME && artifact.kind() != wire::DELTA) {
    return Status::Corruption("catalog entry of unknown kind " + std::to_string(artifact.kind()));
  }
  info.base_version = artifact.base_version();
  info.target_version = artifact.target_version();
  if (info.target_version == 0) return Status::Corruption(what + ": target version 0");
  if (info.kind == ArtifactKind::kDelta) {
    if (info.base_version >= info.target_version) {
      return Status::Corruption(what + ": base version " + std::to_string(info.base_version) +
                                " is not below the target");
    }
    FW_ASSIGN_OR_RETURN(info.base_hash, HashFromBytes(artifact.base_hash(), what + " base hash"));
  }
  info.streaming = artifact.streaming();
  if (info.streaming) {
    // A delta or a keyframe still being encoded: its target hash comes with the finished entry.
    if (!artifact.target_hash().empty()) {
      return Status::Corruption(what + ": a streaming entry must come without a target hash");
    }
  } else {
    FW_ASSIGN_OR_RETURN(info.target_hash,
                        HashFromBytes(artifact.target_hash(), what + " target hash"));
  }
  info.size_bytes = artifact.size_bytes();
  info.piece_bytes = artifact.piece_bytes();
  if (info.piece_bytes == 0 || info.piece_bytes > max_piece_bytes) {
    return Status::Corruption(what + ": piece size " + std::to_string(info.piece_bytes) +
                              " outside [1, " + std::to_string(max_piece_bytes) + "]");
  }
  if (info.streaming) {
    info.size_bound = artifact.size_bound();
    if (info.size_bytes % info.piece_bytes != 0 || info.size_bound < info.size_bytes ||
        info.size_bound > kMaxStreamingBound) {
      return Status::Corruption(what + ": streaming entry of " + std::to_string(info.size_bytes) +
                                " bytes (whole pieces only) bounded by " +
                                std::to_string(info.size_bound) + " (at most " +
                                std::to_string(kMaxStreamingBound) + ")");
    }
  }
  const uint64_t pieces = (info.size_bytes + info.piece_bytes - 1) / info.piece_bytes;
  if (pieces != static_cast<uint64_t>(artifact.piece_hashes_size())) {
    return Status::Corruption(what + ": " + std::to_string(artifact.piece_hashes_size()) +
                              " piece hashes for " + std::to_string(pieces) + " pieces");
  }
  info.piece_hashes.assign(artifact.piece_hashes().begin(), artifact.piece_hashes().end());
  return info;
}

const ArtifactInfo* Catalog::Find(const ArtifactKey& key) const {
  for (const ArtifactInfo& info : artifacts) {
    if (KeyOf(info) == key) return &info;
  }
  return nullptr;
}

const SignedManifest* Catalog::SignatureOf(const ArtifactKey& key) const {
  auto it = signatures.find(key);
  return it == signatures.end() ? nullptr : &it->second;
}

void SortArtifacts(std::vector<ArtifactInfo>* artifacts) {
  std::sort(artifacts->begin(), artifacts->end(), [](const auto& a, const auto& b) {
    return std::tie(a.target_version, a.kind) < std::tie(b.target_version, b.kind);
  });
}

wire::Catalog ToWire(const Catalog& catalog) {
  wire::Catalog out;
  for (const ArtifactInfo& info : catalog.artifacts) {
    wire::Artifact* artifact = out.add_artifacts();
    *artifact = ToWire(info);
    if (const SignedManifest* signed_manifest = catalog.SignatureOf(KeyOf(info))) {
      artifact->set_manifest(signed_manifest->manifest);
      artifact->set_signature(signed_manifest->signature);
    }
  }
  out.set_head_version(catalog.head_version);
  out.set_head_hash(HashBytesOf(catalog.head_hash));
  out.set_max_staleness(catalog.max_staleness);
  return out;
}

Result<Catalog> FromWire(const wire::Catalog& catalog, uint64_t max_piece_bytes) {
  Catalog out;
  for (const wire::Artifact& artifact : catalog.artifacts()) {
    FW_ASSIGN_OR_RETURN(ArtifactInfo info, FromWire(artifact, max_piece_bytes));
    if (out.Find(KeyOf(info)) != nullptr) {
      return Status::Corruption("catalog lists " + Describe(KeyOf(info)) + " twice");
    }
    if (!artifact.manifest().empty() || !artifact.signature().empty()) {
      // Checked against trusted keys by whoever needs it; here only bounded.
      if (artifact.manifest().size() > 4096 || artifact.signature().size() > 512) {
        return Status::Corruption("catalog entry " + Describe(KeyOf(info)) +
                                  ": oversized manifest or signature");
      }
      out.signatures[KeyOf(info)] = {artifact.manifest(), artifact.signature()};
    }
    out.artifacts.push_back(std::move(info));
  }
  SortArtifacts(&out.artifacts);
  out.head_version = catalog.head_version();
  if (out.head_version != 0) {
    FW_ASSIGN_OR_RETURN(out.head_hash, HashFromBytes(catalog.head_hash(), "catalog head hash"));
  }
  out.max_staleness = catalog.max_staleness();
  return out;
}

}  // namespace flywheel::sync
