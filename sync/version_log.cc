#include "sync/version_log.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "base/env.h"
#include "base/hex.h"
#include "delta/delta_file.h"
#include "checkpoint/parallel.h"
#include "checkpoint/safetensors.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr uint64_t kLogFormat = 1;
constexpr const char* kLogFileName = "log.json";
constexpr const char* kLockFileName = "LOCK";
constexpr const char* kArtifactsDirName = "artifacts";

// The only name an artifact may have: log.json is checked against it, so a tampered log
// cannot make Open read or delete anything outside artifacts/.
std::string ArtifactFileName(ArtifactKind kind, uint64_t target_version) {
  char name[64];
  std::snprintf(name, sizeof(name), "v%020llu.%s", static_cast<unsigned long long>(target_version),
                kind == ArtifactKind::kKeyframe ? "keyframe" : "delta");
  return name;
}

std::string RelativeArtifactPath(const ArtifactInfo& info) {
  return std::string(kArtifactsDirName) + "/" + ArtifactFileName(info.kind, info.target_version);
}

bool ArtifactOrder(const ArtifactInfo& a, const ArtifactInfo& b) {
  if (a.target_version != b.target_version) return a.target_version < b.target_version;
  return a.kind < b.kind;
}

bool SameLayout(const CheckpointView& a, const CheckpointView& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape) {
      return false;
    }
  }
  return true;
}

const ArtifactInfo* LatestKeyframe(const std::vector<ArtifactInfo>& artifacts) {
  for (auto it = artifacts.rbegin(); it != artifacts.rend(); ++it) {
    if (it->kind == ArtifactKind::kKeyframe) return &*it;
  }
  return nullptr;
}

// Versions published after the latest keyframe. Retention keeps all of them, so the
// count survives restarts without being recorded.
uint64_t VersionsSinceKeyframe(const std::vector<ArtifactInfo>& artifacts) {
  const ArtifactInfo* keyframe = LatestKeyframe(artifacts);
  if (keyframe == nullptr) return 0;
  std::set<uint64_t> versions;
  for (const ArtifactInfo& a : artifacts) {
    if (a.target_version > keyframe->target_version) versions.insert(a.target_version);
  }
  return versions.size();
}

// Bytes of the deltas after the latest keyframe (one per version).
uint64_t DeltaBytesSinceKeyframe(const std::vector<ArtifactInfo>& artifacts) {
  const ArtifactInfo* keyframe = LatestKeyframe(artifacts);
  uint64_t bytes = 0;
  for (const ArtifactInfo& a : artifacts) {
    if (a.kind == ArtifactKind::kDelta && keyframe != nullptr && a.target_version > keyframe->target_version) {
      bytes += a.size_bytes;
    }
  }
  return bytes;
}

std::vector<ArtifactInfo> ApplyRetention(const std::vector<ArtifactInfo>& artifacts,
                                         uint64_t retain) {
  const ArtifactInfo* keyframe = LatestKeyframe(artifacts);
  const uint64_t keyframe_version = keyframe ? keyframe->target_version : 0;
  std::set<uint64_t, std::greater<>> versions;
  for (const ArtifactInfo& a : artifacts) versions.insert(a.target_version);
  uint64_t retain_from = UINT64_MAX;  // oldest version among the newest `retain`
  uint64_t counted = 0;
  for (uint64_t v : versions) {
    if (counted++ == retain) break;
    retain_from = v;
  }
  std::vector<ArtifactInfo> kept;
  for (const ArtifactInfo& a : artifacts) {
    if (a.target_version >= keyframe_version || a.target_version >= retain_from) {
      kept.push_back(a);
    }
  }
  return kept;
}

Json LogToJson(const std::vector<ArtifactInfo>& artifacts, uint64_t last_version,
               uint64_t head_version, const Hash128& head_hash, uint64_t keyframe_every) {
  Json artifact_list = Json::array();
  for (const ArtifactInfo& a : artifacts) {
    Json pieces = Json::array();
    for (uint64_t h : a.piece_hashes) pieces.push_back(Hex64(h));
    artifact_list.push_back({
        {"kind", ArtifactKindName(a.kind)},
        {"base_version", a.base_version},
        {"target_version", a.target_version},
        {"base_hash", a.base_hash.ToHex()},
        {"target_hash", a.target_hash.ToHex()},
        {"size_bytes", a.size_bytes},
        {"piece_bytes", a.piece_bytes},
        {"piece_hashes", std::move(pieces)},
        {"file", RelativeArtifactPath(a)},
    });
  }
  return Json{{"format", kLogFormat},
              {"last_version", last_version},
              {"head_version", head_version},
              {"head_hash", head_hash.ToHex()},
              {"keyframe_every", keyframe_every},
              {"artifacts", std::move(artifact_list)}};
}

Status WriteLog(Env* env, const std::string& path, const Json& log) {
  const std::string text = log.dump(1) + "\n";
  return WriteFileAtomically(path, std::as_bytes(std::span<const char>(text.data(), text.size())),
                             env);
}

// Field readers for log.json; `where` names the object ("log.json artifacts[2]").
Result<const Json*> Field(const Json& object, const char* field, const std::string& where) {
  auto it = object.find(field);
  if (it == object.end()) return Status::Corruption(where + ": missing field '" + field + "'");
  return &*it;
}

Result<uint64_t> U64Field(const Json& object, const char* field, const std::string& where) {
  FW_ASSIGN_OR_RETURN(const Json* value, Field(object, field, where));
  if (!value->is_number_unsigned()) {
    return Status::Corruption(where + ": field '" + field + "' is not an unsigned integer");
  }
  return value->get<uint64_t>();
}

Result<std::string> StringField(const Json& object, const char* field, const std::string& where) {
  FW_ASSIGN_OR_RETURN(const Json* value, Field(object, field, where));
  if (!value->is_string()) {
    return Status::Corruption(where + ": field '" + field + "' is not a string");
  }
  return value->get<std::string>();
}

Result<Hash128> HashField(const Json& object, const char* field, const std::string& where) {
  FW_ASSIGN_OR_RETURN(std::string hex, StringField(object, field, where));
  auto hash = Hash128::FromHex(hex);
  if (!hash.ok()) {
    return Status::Corruption(where + ": field '" + field + "': " + hash.status().message());
  }
  return *hash;
}

Result<uint64_t> PieceHash(const Json& value, const std::string& where) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_string()) {
    Result<uint64_t> hash = HexDecode64(value.get_ref<const std::string&>(), HexCase::kLower);
    if (hash.ok()) return *hash;
  }
  return Status::Corruption(where +
                            " is neither 1-16 lowercase hex digits nor an unsigned integer");
}

struct LogRecord {
  uint64_t last_version = 0;
  uint64_t head_version = 0;
  Hash128 head_hash;
  std::vector<ArtifactInfo> artifacts;
};

Result<ArtifactInfo> ParseArtifact(const Json& entry, const std::string& where,
                                   const std::string& dir) {
  if (!entry.is_object()) return Status::Corruption(where + " is not an object");
  ArtifactInfo info;
  FW_ASSIGN_OR_RETURN(std::string kind, StringField(entry, "kind", where));
  if (kind == "keyframe") {
    info.kind = ArtifactKind::kKeyframe;
  } else if (kind == "delta") {
    info.kind = ArtifactKind::kDelta;
  } else {
    return Status::Corruption(where + ": field 'kind' is '" + kind +
                              "', not 'keyframe' or 'delta'");
  }
  FW_ASSIGN_OR_RETURN(info.base_version, U64Field(entry, "base_version", where));
  FW_ASSIGN_OR_RETURN(info.target_version, U64Field(entry, "target_version", where));
  FW_ASSIGN_OR_RETURN(info.base_hash, HashField(entry, "base_hash", where));
  FW_ASSIGN_OR_RETURN(info.target_hash, HashField(entry, "target_hash", where));
  FW_ASSIGN_OR_RETURN(info.size_bytes, U64Field(entry, "size_bytes", where));
  FW_ASSIGN_OR_RETURN(info.piece_bytes, U64Field(entry, "piece_bytes", where));
  FW_ASSIGN_OR_RETURN(std::string file, StringField(entry, "file", where));
  FW_ASSIGN_OR_RETURN(const Json* pieces, Field(entry, "piece_hashes", where));

  if (info.target_version == 0) {
    return Status::Corruption(where + ": field 'target_version' is 0");
  }
  if (info.kind == ArtifactKind::kDelta && info.base_version >= info.target_version) {
    return Status::Corruption(where + ": delta base_version " + std::to_string(info.base_version) +
                              " is not below target_version " +
                              std::to_string(info.target_version));
  }
  if (info.kind == ArtifactKind::kKeyframe &&
      (info.base_version != 0 || info.base_hash != Hash128{})) {
    return Status::Corruption(where + ": keyframe has a base_version or base_hash");
  }
  if (info.piece_bytes == 0) return Status::Corruption(where + ": field 'piece_bytes' is 0");
  if (file != RelativeArtifactPath(info)) {
    return Status::Corruption(where + ": field 'file' is '" + file + "', expected '" +
                              RelativeArtifactPath(info) + "'");
  }
  if (!pieces->is_array()) {
    return Status::Corruption(where + ": field 'piece_hashes' is not an array");
  }
  const uint64_t expected_pieces =
      info.size_bytes / info.piece_bytes + (info.size_bytes % info.piece_bytes != 0);
  if (pieces->size() != expected_pieces) {
    return Status::Corruption(where + ": field 'piece_hashes' has " +
                              std::to_string(pieces->size()) + " entries, but size_bytes " +
                              std::to_string(info.size_bytes) + " in pieces of piece_bytes " +
                              std::to_string(info.piece_bytes) + " needs " +
                              std::to_string(expected_pieces));
  }
  for (size_t i = 0; i < pieces->size(); ++i) {
    FW_ASSIGN_OR_RETURN(uint64_t hash, PieceHash((*pieces)[i], where + ": piece_hashes[" +
                                                                   std::to_string(i) + "]"));
    info.piece_hashes.push_back(hash);
  }
  info.path = dir + "/" + file;
  return info;
}

Result<LogRecord> ParseLog(std::string_view text, const std::string& path, const std::string& dir) {
  Json log;
  try {
    log = Json::parse(text.begin(), text.end());
  } catch (const Json::parse_error& e) {
    return Status::Corruption(path + ": not valid JSON (byte " + std::to_string(e.byte) + ")");
  }
  if (!log.is_object()) return Status::Corruption(path + ": not a JSON object");
  FW_ASSIGN_OR_RETURN(uint64_t format, U64Field(log, "format", path));
  if (format != kLogFormat) {
    return Status::Corruption(path + ": field 'format' is " + std::to_string(format) +
                              ", this build reads format " + std::to_string(kLogFormat));
  }
  LogRecord record;
  FW_ASSIGN_OR_RETURN(record.last_version, U64Field(log, "last_version", path));
  FW_ASSIGN_OR_RETURN(record.head_version, U64Field(log, "head_version", path));
  FW_ASSIGN_OR_RETURN(record.head_hash, HashField(log, "head_hash", path));
  FW_ASSIGN_OR_RETURN(const Json* artifacts, Field(log, "artifacts", path));
  if (!artifacts->is_array()) {
    return Status::Corruption(path + ": field 'artifacts' is not an array");
  }
  for (size_t i = 0; i < artifacts->size(); ++i) {
    const std::string where = path + " artifacts[" + std::to_string(i) + "]";
    FW_ASSIGN_OR_RETURN(ArtifactInfo info, ParseArtifact((*artifacts)[i], where, dir));
    if (!record.artifacts.empty() && !ArtifactOrder(record.artifacts.back(), info)) {
      return Status::Corruption(where + ": out of order or duplicate (" +
                                ArtifactKindName(info.kind) + " of version " +
                                std::to_string(info.target_version) + ")");
    }
    record.artifacts.push_back(std::move(info));
  }
  if (record.artifacts.empty()) {
    if (record.head_version != 0 || record.last_version != 0) {
      return Status::Corruption(path + ": no artifacts but head_version/last_version not 0");
    }
    return record;
  }
  if (LatestKeyframe(record.artifacts) == nullptr) {
    return Status::Corruption(path + ": field 'artifacts' holds no keyframe");
  }
  const ArtifactInfo& newest = record.artifacts.back();
  if (record.head_version != newest.target_version) {
    return Status::Corruption(path + ": field 'head_version' is " +
                              std::to_string(record.head_version) + ", the newest artifact is of " +
                              std::to_string(newest.target_version));
  }
  if (record.head_hash != newest.target_hash) {
    return Status::Corruption(path + ": field 'head_hash' differs from the newest artifact's " +
                              "target_hash");
  }
  if (record.last_version < record.head_version) {
    return Status::Corruption(path + ": field 'last_version' " +
                              std::to_string(record.last_version) + " is below head_version " +
                              std::to_string(record.head_version));
  }
  return record;
}

// Maps an artifact and checks it against its record: size and every piece hash. Mapped,
// not read, so that rebuilding the head never holds a second copy of a keyframe.
Result<MappedFile> MapArtifact(Env* env, const ArtifactInfo& info) {
  if (!env->FileExists(info.path)) {
    return Status::NotFound("artifact " + info.path + " named in log.json is missing");
  }
  FW_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(info.path, env));
  const std::span<const std::byte> bytes = file.bytes();
  if (bytes.size() != info.size_bytes) {
    return Status::Corruption("artifact " + info.path + " is " + std::to_string(bytes.size()) +
                              " bytes, log.json records " + std::to_string(info.size_bytes));
  }
  const std::vector<uint64_t> hashes = PieceHashes(bytes, info.piece_bytes);
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (hashes[i] != info.piece_hashes[i]) {
      const uint64_t begin = i * info.piece_bytes;
      const uint64_t end = std::min<uint64_t>(begin + info.piece_bytes, bytes.size());
      return Status::Corruption("artifact " + info.path + ": piece " + std::to_string(i) +
                                " (bytes " + std::to_string(begin) + ".." + std::to_string(end) +
                                ") does not match its hash in log.json");
    }
  }
  return file;
}

struct RebuiltHead {
  OwnedCheckpoint checkpoint;
  std::vector<Hash128> tensor_hashes;
};

// Decodes `chain` (a keyframe, then deltas each from the previous one's version) into one
// checkpoint, checking every artifact's manifest against its record.
Result<RebuiltHead> DecodeChain(Env* env, const std::vector<const ArtifactInfo*>& chain,
                                int threads) {
  RebuiltHead head;
  uint64_t version = 0;
  Hash128 hash;
  for (const ArtifactInfo* info : chain) {
    FW_ASSIGN_OR_RETURN(MappedFile file, MapArtifact(env, *info));
    auto parsed = delta::DeltaView::Parse(file.bytes());
    if (!parsed.ok()) return parsed.status().WithContext("artifact " + info->path);
    const delta::DeltaView& view = *parsed;
    const delta::Manifest& manifest = view.manifest();
    if (manifest.keyframe != (info->kind == ArtifactKind::kKeyframe) ||
        manifest.target_version != info->target_version ||
        manifest.target_hash != info->target_hash ||
        (!manifest.keyframe &&
         (manifest.base_version != info->base_version || manifest.base_hash != info->base_hash))) {
      return Status::Corruption("artifact " + info->path +
                                ": its manifest does not match its record in log.json");
    }
    if (info == chain.front()) {
      auto decoded = delta::DecodeKeyframe(view, threads);
      if (!decoded.ok()) return decoded.status().WithContext("artifact " + info->path);
      head.checkpoint = std::move(decoded).value();
      // DecodeKeyframe verified these and lays tensors out in manifest order.
      head.tensor_hashes.clear();
      for (const delta::TensorEntry& t : manifest.tensors) head.tensor_hashes.push_back(t.target_hash);
    } else {
      if (info->base_version != version || info->base_hash != hash) {
        return Status::Corruption(
            "artifact " + info->path + ": delta from version " + std::to_string(info->base_version) +
            " does not follow the rebuilt head (version " + std::to_string(version) + ")");
      }
      MutableCheckpointView state_view = head.checkpoint.mutable_view();
      delta::ApplyOptions apply;
      apply.threads = threads;
      apply.state_tensor_hashes = head.tensor_hashes;
      apply.restore_on_failure = false;  // the head is thrown away if this fails
      auto stats = delta::ApplyInPlace(state_view, view, apply);
      if (!stats.ok()) return stats.status().WithContext("artifact " + info->path);
      head.tensor_hashes = std::move(stats->tensor_hashes);
    }
    version = info->target_version;
    hash = info->target_hash;
  }
  return head;
}

// The artifacts that rebuild `version`: the newest keyframe at or below it from which a
// chain of deltas reaches it, then those deltas. Empty when none does.
std::vector<const ArtifactInfo*> ChainTo(const std::vector<ArtifactInfo>& artifacts,
                                         uint64_t version) {
  for (auto keyframe = artifacts.rbegin(); keyframe != artifacts.rend(); ++keyframe) {
    if (keyframe->kind != ArtifactKind::kKeyframe || keyframe->target_version > version) continue;
    std::vector<const ArtifactInfo*> chain{&*keyframe};
    uint64_t at = keyframe->target_version;
    while (at < version) {
      const ArtifactInfo* next = nullptr;
      for (const ArtifactInfo& info : artifacts) {
        if (info.kind == ArtifactKind::kDelta && info.base_version == at &&
            info.target_version <= version) {
          next = &info;
        }
      }
      if (next == nullptr) break;
      chain.push_back(next);
      at = next->target_version;
    }
    if (at == version) return chain;
  }
  return {};
}

// Every artifact is verified piece by piece; the latest keyframe and the deltas after it
// are decoded into the head, which must come out with the recorded hash.
// REQUIRES: record.artifacts holds a keyframe (ParseLog checks it).
Result<RebuiltHead> VerifyAndRebuildHead(Env* env, const LogRecord& record,
                                         const std::string& log_path, int threads) {
  const ArtifactInfo& keyframe = *LatestKeyframe(record.artifacts);
  std::vector<const ArtifactInfo*> chain;
  for (const ArtifactInfo& info : record.artifacts) {
    FW_RETURN_IF_ERROR(MapArtifact(env, info).status());
    if (info.target_version < keyframe.target_version) continue;
    if (info.target_version == keyframe.target_version && &info != &keyframe) continue;
    chain.push_back(&info);
  }
  FW_ASSIGN_OR_RETURN(RebuiltHead head, DecodeChain(env, chain, threads));
  const uint64_t version = chain.back()->target_version;
  FW_ASSIGN_OR_RETURN(Hash128 rebuilt,
                      CheckpointHashFromTensorHashes(head.checkpoint.view(), head.tensor_hashes));
  if (version != record.head_version || rebuilt != record.head_hash) {
    return Status::Corruption(
        log_path + ": the head rebuilt from the artifacts (version " + std::to_string(version) +
        ", hash " + rebuilt.ToHex() + ") is not the recorded one (version " +
        std::to_string(record.head_version) + ", hash " + record.head_hash.ToHex() + ")");
  }
  return head;
}

std::string VersionList(const std::vector<uint64_t>& versions) {
  std::string text;
  for (uint64_t v : versions) text += (text.empty() ? "v" : ", v") + std::to_string(v);
  return text.empty() ? "none" : text;
}

std::vector<uint64_t> Rebuildable(const std::vector<ArtifactInfo>& artifacts) {
  std::set<uint64_t> versions;
  for (const ArtifactInfo& info : artifacts) {
    if (!ChainTo(artifacts, info.target_version).empty()) versions.insert(info.target_version);
  }
  return {versions.begin(), versions.end()};
}

// A copy of a verified delta container from the head to `version` (AppendOptions).
// Checks a given delta (AppendOptions::encoded_delta); its bytes are used where they are,
// never copied (a pushed delta may be a mapped file of gigabytes).
Status CheckGivenDelta(std::span<const std::byte> container, uint64_t base, uint64_t version) {
  FW_ASSIGN_OR_RETURN(delta::DeltaView view, delta::DeltaView::Parse(container));
  const delta::Manifest& manifest = view.manifest();
  if (manifest.keyframe || manifest.base_version != base || manifest.target_version != version) {
    return Status::InvalidArgument("the given delta is not one from version " +
                                   std::to_string(base) + " to " + std::to_string(version));
  }
  return Status::Ok();
}

// Anything in artifacts/ that log.json does not name, and any temporary log.json, is a
// leftover of an interrupted Append (or of the retention after a committed one).
Status RemoveLeftovers(Env* env, const std::string& dir, const std::vector<ArtifactInfo>& artifacts) {
  std::set<std::string> named;
  for (const ArtifactInfo& info : artifacts) {
    named.insert(ArtifactFileName(info.kind, info.target_version));
  }
  const std::string log_temp_prefix = std::string(".") + kLogFileName + ".tmp-";
  const std::string artifacts_dir = dir + "/" + kArtifactsDirName;
  std::vector<std::string> leftovers;
  FW_ASSIGN_OR_RETURN(std::vector<std::string> files, env->ListDir(artifacts_dir));
  for (const std::string& name : files) {
    if (!named.count(name)) leftovers.push_back(artifacts_dir + "/" + name);
  }
  FW_ASSIGN_OR_RETURN(std::vector<std::string> top, env->ListDir(dir));
  for (const std::string& name : top) {
    if (name.starts_with(log_temp_prefix)) leftovers.push_back(dir + "/" + name);
  }
  for (const std::string& path : leftovers) {
    FW_RETURN_IF_ERROR(env->RemoveAll(path).WithContext("cannot remove a leftover"));
    spdlog::info("version log: removed leftover {}", path);
  }
  return Status::Ok();
}

std::vector<Hash128> TensorHashes(const CheckpointView& checkpoint, int threads) {
  std::vector<Hash128> hashes(checkpoint.size());
  ParallelFor(checkpoint.size(), threads, [&](size_t i) { hashes[i] = TensorHash(checkpoint[i]); });
  return hashes;
}

// The caller's tensor hashes when it gave them (checked for count only: see AppendOptions),
// else every tensor hashed here.
Result<std::vector<Hash128>> GivenOrComputedHashes(const CheckpointView& checkpoint,
                                                   const AppendOptions& given, int threads,
                                                   AppendResult* result) {
  if (given.tensor_hashes.empty()) {
    result->tensors_hashed = checkpoint.size();
    return TensorHashes(checkpoint, threads);
  }
  if (given.tensor_hashes.size() != checkpoint.size()) {
    return Status::InvalidArgument("version log: " + std::to_string(given.tensor_hashes.size()) +
                                   " tensor hashes given for " + std::to_string(checkpoint.size()) +
                                   " tensors");
  }
  return given.tensor_hashes;
}

// The target's tensor hashes an encoder computed, read back from the manifest it wrote
// (in target tensor order).
Result<std::vector<Hash128>> TargetTensorHashes(std::span<const std::byte> container) {
  FW_ASSIGN_OR_RETURN(delta::DeltaView view, delta::DeltaView::Parse(container));
  std::vector<Hash128> hashes;
  for (const delta::TensorEntry& entry : view.manifest().tensors) hashes.push_back(entry.target_hash);
  return hashes;
}

// The encoder's own counts, read back from the manifest it just wrote (a parse of the
// manifest only; no chunk is decoded and the checkpoint is not read again).
Status CountChangedWords(std::span<const std::byte> container, AppendResult* result) {
  FW_ASSIGN_OR_RETURN(delta::DeltaView view, delta::DeltaView::Parse(container));
  result->wrote_delta = true;
  result->changed_words = view.manifest().changed_words();
  result->total_words = view.manifest().total_words();
  return Status::Ok();
}

Result<OwnedCheckpoint> CopyCheckpoint(const CheckpointView& checkpoint) {
  try {
    OwnedCheckpoint copy;
    copy.tensors.reserve(checkpoint.size());
    for (const TensorView& t : checkpoint) {
      copy.tensors.push_back(OwnedTensor{t.name, t.dtype, t.shape, {t.data.begin(), t.data.end()}});
    }
    return copy;
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("cannot hold a copy of the checkpoint in memory");
  }
}

}  // namespace

const char* ArtifactKindName(ArtifactKind kind) {
  switch (kind) {
    case ArtifactKind::kKeyframe:
      return "keyframe";
    case ArtifactKind::kDelta:
      return "delta";
  }
  return "unknown";
}

std::vector<uint64_t> PieceHashes(std::span<const std::byte> bytes, uint64_t piece_bytes) {
  if (piece_bytes == 0) piece_bytes = std::max<uint64_t>(bytes.size(), 1);
  std::vector<uint64_t> hashes;
  hashes.reserve(bytes.size() / piece_bytes + 1);
  for (uint64_t offset = 0; offset < bytes.size(); offset += piece_bytes) {
    hashes.push_back(
        HashBytes64(bytes.subspan(offset, std::min(piece_bytes, bytes.size() - offset))));
  }
  return hashes;
}

namespace {

// Writes `bytes` to `path` atomically (nothing is left there on failure) one piece at a
// time, hashing each piece as it is written: PieceHashes(bytes, piece_bytes) in the same
// pass. Each piece is then reported to `read` (optional).
Result<std::vector<uint64_t>> WriteHashedPieces(Env* env, const std::string& path,
                                                std::span<const std::byte> bytes,
                                                uint64_t piece_bytes, const BytesReadFn& read) {
  if (piece_bytes == 0) piece_bytes = std::max<uint64_t>(bytes.size(), 1);
  FW_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path, env));
  std::vector<uint64_t> hashes;
  hashes.reserve(bytes.size() / piece_bytes + 1);
  for (uint64_t offset = 0; offset < bytes.size(); offset += piece_bytes) {
    const std::span<const std::byte> piece =
        bytes.subspan(offset, std::min(piece_bytes, bytes.size() - offset));
    hashes.push_back(HashBytes64(piece));
    FW_RETURN_IF_ERROR(file.Append(piece));
    if (read) read(piece);
  }
  FW_RETURN_IF_ERROR(file.Commit());
  return hashes;
}

}  // namespace

struct VersionLog::State {
  VersionLogOptions options;
  Env* env = nullptr;  // options.env, or Env::Default()
  std::string dir;     // absolute
  std::string log_path;
  std::unique_ptr<Env::FileLock> lock;

  std::mutex append_mu;  // held for a whole Append

  // Written only by Append (holding append_mu and mu); read under mu by any thread.
  mutable std::mutex mu;
  std::vector<ArtifactInfo> artifacts;      // GUARDED_BY(mu), in ArtifactOrder
  uint64_t last_version = 0;                // GUARDED_BY(mu)
  uint64_t head_version = 0;                // GUARDED_BY(mu)
  Hash128 head_hash;                        // GUARDED_BY(mu)
  std::vector<Hash128> head_tensor_hashes;  // GUARDED_BY(mu)

  // The head's bytes are touched only by Open and Append (under append_mu): readers
  // never see them, so they are not under mu and a large copy does not block readers.
  OwnedCheckpoint head;  // GUARDED_BY(append_mu)
};

VersionLog::VersionLog(std::unique_ptr<State> state) : state_(std::move(state)) {}
VersionLog::~VersionLog() = default;

namespace {

Status CheckOptions(const VersionLogOptions& options) {
  if (options.dir.empty()) return Status::InvalidArgument("version log: no state directory given");
  const std::string log = "version log " + options.dir;
  if (!(options.keyframe_cost >= 0)) {
    return Status::InvalidArgument(log + ": keyframe_cost must be >= 0");
  }
  if (options.keyframe_every == 0) {
    return Status::InvalidArgument(log + ": keyframe_every must be >= 1");
  }
  if (options.piece_bytes == 0) return Status::InvalidArgument(log + ": piece_bytes must be >= 1");
  if (options.threads < 1 || options.threads > delta::kMaxThreads) {
    return Status::InvalidArgument(log + ": threads " + std::to_string(options.threads) +
                                   " not in [1, " + std::to_string(delta::kMaxThreads) + "]");
  }
  return Status::Ok();
}

// The record log.json holds; an empty one when there is no log.json (a new directory).
Result<LogRecord> ReadLog(Env* env, const std::string& log_path, const std::string& dir) {
  if (!env->FileExists(log_path)) return LogRecord{};
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> text, delta::ReadDeltaFile(log_path, env));
  return ParseLog(std::string_view(reinterpret_cast<const char*>(text.data()), text.size()),
                  log_path, dir);
}

}  // namespace

Result<std::unique_ptr<VersionLog>> VersionLog::Open(const VersionLogOptions& options) {
  FW_RETURN_IF_ERROR(CheckOptions(options));
  auto state = std::make_unique<State>();
  state->options = options;
  state->env = options.env != nullptr ? options.env : Env::Default();
  Env* const env = state->env;
  std::error_code ec;
  const fs::path dir = fs::absolute(options.dir, ec).lexically_normal();
  if (ec) return Status::IOError("version log " + options.dir + ": " + ec.message());
  state->dir = dir.string();
  if (state->dir.size() > 1 && state->dir.back() == '/') {
    state->dir.pop_back();
  }
  state->log_path = state->dir + "/" + kLogFileName;
  FW_RETURN_IF_ERROR(env->CreateDirs(state->dir + "/" + kArtifactsDirName));
  const std::string lock_path = state->dir + "/" + kLockFileName;
  Result<std::unique_ptr<Env::FileLock>> lock = env->LockFile(lock_path);
  if (lock.status().code() == StatusCode::kUnavailable) {
    return Status::Unavailable("state directory " + state->dir +
                               " is in use: another version log holds " + lock_path);
  }
  FW_RETURN_IF_ERROR(lock.status());
  state->lock = std::move(*lock);

  FW_ASSIGN_OR_RETURN(LogRecord record, ReadLog(env, state->log_path, state->dir));
  if (!record.artifacts.empty()) {
    FW_ASSIGN_OR_RETURN(RebuiltHead head,
                        VerifyAndRebuildHead(env, record, state->log_path, options.threads));
    state->head = std::move(head.checkpoint);
    state->head_tensor_hashes = std::move(head.tensor_hashes);
  }
  FW_RETURN_IF_ERROR(RemoveLeftovers(env, state->dir, record.artifacts));

  state->artifacts = std::move(record.artifacts);
  state->last_version = record.last_version;
  state->head_version = record.head_version;
  state->head_hash = record.head_hash;
  return std::unique_ptr<VersionLog>(new VersionLog(std::move(state)));
}

uint64_t JoinBytes(const std::vector<ArtifactInfo>& artifacts) {
  const ArtifactInfo* keyframe = LatestKeyframe(artifacts);
  return keyframe == nullptr ? 0 : keyframe->size_bytes + DeltaBytesSinceKeyframe(artifacts);
}

Result<std::vector<ArtifactInfo>> VersionLog::Append(uint64_t version,
                                                     const CheckpointView& checkpoint) {
  FW_ASSIGN_OR_RETURN(AppendResult result, Append(version, checkpoint, AppendOptions{}));
  return std::move(result.artifacts);
}

namespace {

// Where a streamed delta is encoded to: memory that keeps its address (so whoever serves
// the pieces meanwhile may hold on to it), with the hashes of the whole pieces so far.
class PieceStreamSink : public delta::StreamSink {
 public:
  PieceStreamSink(ArtifactInfo entry, const AppendOptions& given)
      : entry_(std::move(entry)), given_(given) {
    entry_.streaming = true;
  }
  Status Begin(uint64_t size_bound) override {
    FW_ASSIGN_OR_RETURN(bytes_, GrowableBytes::Create(size_bound));
    entry_.size_bound = size_bound;
    return Status::Ok();
  }
  Status Write(std::span<const std::byte> bytes) override {
    FW_RETURN_IF_ERROR(bytes_->Append(bytes));
    const uint64_t piece = entry_.piece_bytes;
    const uint64_t before = entry_.size_bytes;
    while (bytes_->size() - entry_.size_bytes >= piece) {
      entry_.piece_hashes.push_back(
          HashBytes64(std::span<const std::byte>(bytes_->data() + entry_.size_bytes, piece)));
      entry_.size_bytes += piece;
    }
    if (given_.on_stream && entry_.size_bytes != before) {
      const auto now = std::chrono::steady_clock::now();
      if (before == 0 || now - last_call_ >= std::chrono::milliseconds(10)) {
        last_call_ = now;
        given_.on_stream(entry_, bytes_);
      }
    }
    return Status::Ok();
  }
  std::span<const std::byte> bytes() const {
    return bytes_ ? bytes_->bytes() : std::span<const std::byte>();
  }
  // Every piece's hash, the last (shorter) piece's included: PieceHashes(bytes()) without
  // hashing the whole pieces a second time.
  std::vector<uint64_t> AllPieceHashes() const {
    std::vector<uint64_t> hashes = entry_.piece_hashes;
    const std::span<const std::byte> all = bytes();
    if (all.size() > entry_.size_bytes) hashes.push_back(HashBytes64(all.subspan(entry_.size_bytes)));
    return hashes;
  }

 private:
  ArtifactInfo entry_;
  const AppendOptions& given_;
  std::shared_ptr<GrowableBytes> bytes_;
  std::chrono::steady_clock::time_point last_call_;
};

}  // namespace

// One Append, in named steps: Check, ChooseArtifacts, HashUpFront, EncodeDelta, the
// artifacts' writes, CommitLog (log.json: the commit point), Install. Until CommitLog
// succeeds nothing changes, on disk (the artifacts written are removed again) or in memory.
// REQUIRES: append_mu held for the whole run.
class VersionLog::AppendRun {
 public:
  AppendRun(State& state, uint64_t version, const CheckpointView& checkpoint,
            const AppendOptions& given)
      : s_(state), options_(state.options), version_(version), checkpoint_(checkpoint),
        given_(given) {}

  Result<AppendResult> Run() {
    FW_RETURN_IF_ERROR(Check());
    ChooseArtifacts();
    FW_RETURN_IF_ERROR(HashUpFront());
    // Allocated before anything is written, so that running out of memory cannot strand a
    // committed log.json with a stale head.
    if (!same_layout_) {
      FW_ASSIGN_OR_RETURN(fresh_head_, CopyCheckpoint(checkpoint_));
    }
    encode_.base_version = s_.head_version;
    encode_.target_version = version_;
    encode_.compressor = options_.compressor;
    encode_.context_coding = options_.context_coding;
    encode_.threads = options_.threads;
    encode_.target_tensor_hashes = tensor_hashes_;
    // The delta first: whether a keyframe is due by cost depends on its size.
    if (write_delta_) FW_RETURN_IF_ERROR(EncodeDelta());
    if (!result_.keyframe_reason.empty()) FW_RETURN_IF_ERROR(WriteKeyframe());
    if (write_delta_) FW_RETURN_IF_ERROR(WriteDelta());
    FW_RETURN_IF_ERROR(CommitLog());
    Install();
    for (const TensorView& t : checkpoint_) result_.checkpoint_bytes += t.data.size();
    result_.artifacts = std::move(written_);
    return std::move(result_);
  }

 private:
  std::string Context(const std::string& what) const {
    return "version log " + s_.dir + ": " + what + " of version " + std::to_string(version_);
  }

  // Versions only move forward; the head is updated by copying into its buffers, so sizes
  // must be what dtype and shape say before anything else looks at the bytes.
  Status Check() const {
    const std::string log = "version log " + s_.dir;
    if (version_ == 0) return Status::InvalidArgument(log + ": version 0 cannot be published");
    if (version_ <= s_.last_version) {
      return Status::InvalidArgument(log + ": version " + std::to_string(version_) +
                                     " is not above the last published version " +
                                     std::to_string(s_.last_version) +
                                     " (versions only move forward)");
    }
    for (const TensorView& t : checkpoint_) {
      auto size = TensorByteSize(t.dtype, t.shape);
      if (!size.ok() || *size != t.data.size()) {
        return Status::InvalidArgument(
            log + ": version " + std::to_string(version_) + ": tensor '" + t.name + "' holds " +
            std::to_string(t.data.size()) + " bytes, its dtype and shape " +
            (size.ok() ? "need " + std::to_string(*size)
                       : "are invalid (" + size.status().message() + ")"));
      }
    }
    return Status::Ok();
  }

  // A delta when the layout is the head's and deltas are on; a keyframe when one is due by
  // count or layout (EncodeDelta may add "cost"). Who hashes the checkpoint: without given
  // hashes, the delta's encoder in its compare pass (one read of the checkpoint, not two).
  void ChooseArtifacts() {
    // Only Append writes these and append_mu is held: no need for mu to read them.
    const bool has_head = !s_.artifacts.empty();
    same_layout_ = has_head && SameLayout(s_.head.view(), checkpoint_);
    write_delta_ = same_layout_ && options_.deltas;
    if (!has_head) {
      result_.keyframe_reason = "first";
    } else if (!same_layout_) {
      result_.keyframe_reason = "layout";
    } else if (!options_.deltas) {
      result_.keyframe_reason = "no-deltas";
    } else if (VersionsSinceKeyframe(s_.artifacts) + 1 >= options_.keyframe_every) {
      result_.keyframe_reason = "every";
    }
    hash_in_encode_ = given_.tensor_hashes.empty() && write_delta_ && given_.encoded_delta.empty();
    streamed_ = given_.encoded_delta.empty() && options_.stream_deltas;
  }

  // The checkpoint hash of tensor_hashes_, checked against a given one.
  Status SettleHashes() {
    Result<Hash128> hash = CheckpointHashFromTensorHashes(checkpoint_, tensor_hashes_);
    if (!hash.ok()) {
      return hash.status().WithContext("version log " + s_.dir + ": version " +
                                       std::to_string(version_));
    }
    checkpoint_hash_ = *hash;
    if (given_.checkpoint_hash && *given_.checkpoint_hash != checkpoint_hash_) {
      return Status::InvalidArgument(
          "version log " + s_.dir + ": version " + std::to_string(version_) +
          ": the given checkpoint hash " + given_.checkpoint_hash->ToHex() +
          " is not the one of the given tensor hashes (" + checkpoint_hash_.ToHex() + ")");
    }
    return Status::Ok();
  }

  Status HashUpFront() {
    if (hash_in_encode_) return Status::Ok();
    FW_ASSIGN_OR_RETURN(tensor_hashes_,
                        GivenOrComputedHashes(checkpoint_, given_, options_.threads, &result_));
    return SettleHashes();
  }

  // Encodes the delta from the head in memory (format 1), streams it into the sink (whose
  // pieces AppendOptions::on_stream may serve meanwhile), or checks a given one. A failed
  // encode is kept in delta_bytes_ and reported by WriteDelta, unless its hashes are needed.
  Status EncodeDelta() {
    encode_.base_tensor_hashes = s_.head_tensor_hashes;
    ArtifactInfo entry;
    entry.kind = ArtifactKind::kDelta;
    entry.base_version = s_.head_version;
    entry.base_hash = s_.head_hash;
    entry.target_version = version_;
    entry.piece_bytes = options_.piece_bytes;
    sink_ = std::make_unique<PieceStreamSink>(std::move(entry), given_);
    if (!given_.encoded_delta.empty()) {
      Status checked = CheckGivenDelta(given_.encoded_delta, s_.head_version, version_);
      if (!checked.ok()) delta_bytes_ = checked;
      if (given_.encoded_delta_read) given_.encoded_delta_read(given_.encoded_delta);
    } else if (streamed_) {
      Status encoded = delta::EncodeStreamed(s_.head.view(), checkpoint_, encode_, *sink_);
      if (!encoded.ok()) delta_bytes_ = encoded;
    } else {
      delta_bytes_ = delta::Encode(s_.head.view(), checkpoint_, encode_);
    }
    if (delta_bytes_.ok()) {
      delta_span_ = !given_.encoded_delta.empty() ? given_.encoded_delta
                    : streamed_                  ? sink_->bytes()
                                                 : std::span<const std::byte>(*delta_bytes_);
    }
    result_.encoded_at =
        std::chrono::system_clock::time_point(std::chrono::microseconds(UnixMicrosNow()));
    if (hash_in_encode_) {
      if (!delta_bytes_.ok()) return delta_bytes_.status().WithContext(Context("delta"));
      Result<std::vector<Hash128>> hashes = TargetTensorHashes(delta_span_);
      if (!hashes.ok()) return hashes.status().WithContext(Context("delta"));
      tensor_hashes_ = std::move(*hashes);
      result_.tensors_hashed = checkpoint_.size();
      FW_RETURN_IF_ERROR(SettleHashes());
      encode_.target_tensor_hashes = tensor_hashes_;  // for a keyframe of the same version
    }
    const ArtifactInfo* keyframe = LatestKeyframe(s_.artifacts);
    if (result_.keyframe_reason.empty() && delta_bytes_.ok() && options_.keyframe_cost > 0 &&
        keyframe != nullptr &&
        static_cast<double>(DeltaBytesSinceKeyframe(s_.artifacts) + delta_span_.size()) >
            options_.keyframe_cost * static_cast<double>(keyframe->size_bytes)) {
      result_.keyframe_reason = "cost";
    }
    return Status::Ok();
  }

  // Writes one artifact atomically (synced) and adds it to written_. `piece_hashes`: the
  // bytes' PieceHashes when already known (a streamed delta's); `read`: told of the bytes
  // as they are written (a given delta's encoded_delta_read).
  Status WriteArtifact(ArtifactKind kind, const Status& encoded, std::span<const std::byte> bytes,
                       std::vector<uint64_t> piece_hashes = {}, const BytesReadFn& read = {}) {
    const std::string context = Context(ArtifactKindName(kind));
    if (!encoded.ok()) return encoded.WithContext(context);
    ArtifactInfo info;
    info.kind = kind;
    info.target_version = version_;
    info.target_hash = checkpoint_hash_;
    if (kind == ArtifactKind::kDelta) {
      info.base_version = s_.head_version;
      info.base_hash = s_.head_hash;
    }
    info.size_bytes = bytes.size();
    info.piece_bytes = options_.piece_bytes;
    info.path = s_.dir + "/" + RelativeArtifactPath(info);
    if (piece_hashes.empty()) {
      Result<std::vector<uint64_t>> hashed =
          WriteHashedPieces(s_.env, info.path, bytes, options_.piece_bytes, read);
      if (!hashed.ok()) return hashed.status().WithContext(context);
      info.piece_hashes = std::move(*hashed);
    } else {
      info.piece_hashes = std::move(piece_hashes);
      FW_RETURN_IF_ERROR(WriteFileAtomically(info.path, bytes, s_.env).WithContext(context));
    }
    written_.push_back(std::move(info));
    return Status::Ok();
  }

  // A keyframe is streamed like a delta (VersionLogOptions::stream_deltas, even when the
  // delta was given): a joining worker decodes its tensors while it is encoded.
  Status WriteKeyframe() {
    encode_.base_tensor_hashes = {};
    if (!options_.stream_deltas) {
      Result<std::vector<std::byte>> keyframe = delta::EncodeKeyframe(checkpoint_, encode_);
      result_.encoded_at =
          std::chrono::system_clock::time_point(std::chrono::microseconds(UnixMicrosNow()));
      return WriteArtifact(ArtifactKind::kKeyframe, keyframe.status(),
                           keyframe.ok() ? std::span<const std::byte>(*keyframe)
                                         : std::span<const std::byte>());
    }
    ArtifactInfo entry;
    entry.kind = ArtifactKind::kKeyframe;
    entry.target_version = version_;
    entry.piece_bytes = options_.piece_bytes;
    PieceStreamSink sink(std::move(entry), given_);
    const Status encoded = delta::EncodeKeyframeStreamed(checkpoint_, encode_, sink);
    result_.encoded_at =
        std::chrono::system_clock::time_point(std::chrono::microseconds(UnixMicrosNow()));
    return WriteArtifact(ArtifactKind::kKeyframe, encoded, sink.bytes(),
                         encoded.ok() ? sink.AllPieceHashes() : std::vector<uint64_t>{});
  }

  Status WriteDelta() {
    const bool given_delta = !given_.encoded_delta.empty();
    Status st = WriteArtifact(
        ArtifactKind::kDelta, delta_bytes_.status(), delta_span_,
        streamed_ && delta_bytes_.ok() ? sink_->AllPieceHashes() : std::vector<uint64_t>{},
        given_delta ? given_.encoded_delta_read : BytesReadFn{});
    if (st.ok()) {
      st = CountChangedWords(delta_span_, &result_).WithContext(Context("delta"));
      if (given_delta && given_.encoded_delta_read) given_.encoded_delta_read(delta_span_);
    }
    if (!st.ok()) RemoveWritten();
    return st;
  }

  // Not synced: a file left behind (a crash meanwhile) is removed by the next Open.
  void RemoveWritten() {
    for (const ArtifactInfo& info : written_) (void)s_.env->RemoveFile(info.path);
  }

  // Replaces log.json (atomically, synced): the version is published once this returns.
  Status CommitLog() {
    std::vector<ArtifactInfo> all = s_.artifacts;
    all.insert(all.end(), written_.begin(), written_.end());
    std::sort(all.begin(), all.end(), ArtifactOrder);
    kept_ = ApplyRetention(all, options_.retain);
    Status committed =
        WriteLog(s_.env, s_.log_path,
                 LogToJson(kept_, version_, version_, checkpoint_hash_, options_.keyframe_every));
    if (!committed.ok()) {
      RemoveWritten();
      return committed.WithContext("version log " + s_.dir + ": version " +
                                   std::to_string(version_));
    }
    return Status::Ok();
  }

  // Committed: from here on nothing may fail. A dropped artifact that cannot be deleted is
  // only logged (the next Open removes it).
  void Install() {
    if (same_layout_) {
      for (size_t i = 0; i < checkpoint_.size(); ++i) {
        // An in-place apply published the head's own bytes: nothing to copy.
        if (checkpoint_[i].data.data() == s_.head.tensors[i].data.data()) continue;
        std::copy(checkpoint_[i].data.begin(), checkpoint_[i].data.end(),
                  s_.head.tensors[i].data.begin());
      }
    } else {
      s_.head = std::move(fresh_head_);
    }
    std::vector<ArtifactInfo> dropped;
    {
      std::lock_guard lock(s_.mu);
      std::set<std::string> kept_paths;
      for (const ArtifactInfo& info : kept_) kept_paths.insert(info.path);
      for (const ArtifactInfo& info : s_.artifacts) {
        if (!kept_paths.count(info.path)) dropped.push_back(info);
      }
      s_.artifacts = std::move(kept_);
      s_.last_version = version_;
      s_.head_version = version_;
      s_.head_hash = checkpoint_hash_;
      s_.head_tensor_hashes = std::move(tensor_hashes_);
    }
    for (const ArtifactInfo& info : dropped) {
      Status removed = s_.env->RemoveFile(info.path);
      if (!removed.ok() && removed.code() != StatusCode::kNotFound) {
        spdlog::warn("version log: cannot remove an artifact dropped by retention: {}",
                     removed.message());
      }
    }
  }

  State& s_;
  const VersionLogOptions& options_;
  const uint64_t version_;
  const CheckpointView& checkpoint_;
  const AppendOptions& given_;
  AppendResult result_;
  bool same_layout_ = false;
  bool write_delta_ = false;
  bool hash_in_encode_ = false;
  bool streamed_ = false;
  std::vector<Hash128> tensor_hashes_;
  Hash128 checkpoint_hash_;
  OwnedCheckpoint fresh_head_;
  delta::EncodeOptions encode_;
  Result<std::vector<std::byte>> delta_bytes_ = std::vector<std::byte>{};
  std::unique_ptr<PieceStreamSink> sink_;
  std::span<const std::byte> delta_span_;
  std::vector<ArtifactInfo> written_;
  std::vector<ArtifactInfo> kept_;
};

Result<AppendResult> VersionLog::Append(uint64_t version, const CheckpointView& checkpoint,
                                        const AppendOptions& given) {
  std::lock_guard append_lock(state_->append_mu);
  if (!given.apply_in_place.empty()) return AppendInPlaceLocked(version, checkpoint, given);
  AppendRun run(*state_, version, checkpoint, given);
  return run.Run();
}

Result<AppendResult> VersionLog::AppendInPlaceLocked(uint64_t version,
                                                     const CheckpointView& checkpoint,
                                                     const AppendOptions& given) {
  State& s = *state_;
  const std::string log = "version log " + s.dir + ": in-place delta to version " +
                          std::to_string(version);
  if (!checkpoint.empty() || !given.encoded_delta.empty() || !given.tensor_hashes.empty() ||
      given.checkpoint_hash) {
    return Status::InvalidArgument(
        log + ": an in-place apply takes no checkpoint, hashes or encoded delta beside it");
  }
  const std::span<const std::byte> container = given.apply_in_place;
  Result<delta::DeltaView> view = delta::DeltaView::Parse(container);
  if (!view.ok()) return view.status().WithContext(log);
  if (given.encoded_delta_read) given.encoded_delta_read(container);
  const delta::Manifest& m = view->manifest();
  if (m.keyframe || m.target_version != version) {
    return Status::InvalidArgument(log + ": the container is " +
                                   (m.keyframe ? std::string("a keyframe")
                                               : "a delta to version " +
                                                     std::to_string(m.target_version)));
  }
  // append_mu is held: the head and the artifacts are this thread's to read.
  if (s.artifacts.empty() || m.base_version != s.head_version || m.base_hash != s.head_hash) {
    return Status::Mismatch(log + ": the delta's base is v" + std::to_string(m.base_version) +
                            " (" + m.base_hash.ToHex() + "), the head is v" +
                            std::to_string(s.head_version) + " (" + s.head_hash.ToHex() + ")");
  }
  std::optional<Result<AppendResult>> appended;
  Status refused;  // what the commit step answered, when it refused
  // Runs with the whole target in place and verified tensor by tensor, the undo records
  // still held: an error here restores the head.
  auto commit = [&](const delta::ApplyStats& stats) -> Status {
    Result<Hash128> hash = CheckpointHashFromTensorHashes(s.head.view(), stats.tensor_hashes);
    if (!hash.ok()) return refused = hash.status().WithContext(log);
    if (*hash != m.target_hash) {
      return refused = Status::Corruption(log + ": the delta produced hash " + hash->ToHex() +
                                          ", its manifest says " + m.target_hash.ToHex());
    }
    AppendOptions known;
    known.tensor_hashes = stats.tensor_hashes;
    known.checkpoint_hash = *hash;
    known.encoded_delta = container;
    known.encoded_delta_read = given.encoded_delta_read;
    known.on_stream = given.on_stream;  // a keyframe due now streams as usual
    const CheckpointView target = s.head.view();
    AppendRun run(s, version, target, known);
    appended = run.Run();
    return refused = appended->status();
  };
  delta::ApplyOptions apply;
  apply.threads = s.options.threads;
  apply.state_tensor_hashes = s.head_tensor_hashes;
  apply.restore_on_failure = true;
  apply.payload_read = given.encoded_delta_read;
  apply.before_commit = commit;
  MutableCheckpointView head = s.head.mutable_view();
  Result<delta::ApplyStats> applied = delta::ApplyInPlace(head, *view, apply);
  if (!applied.ok()) {
    // The commit step's refusal carries its context; an apply that failed gets the log's.
    if (!refused.ok()) return refused;
    return applied.status().WithContext(log);
  }
  return std::move(*appended);
}

std::vector<ArtifactInfo> VersionLog::Artifacts() const {
  std::lock_guard lock(state_->mu);
  return state_->artifacts;
}

bool VersionLog::empty() const {
  std::lock_guard lock(state_->mu);
  return state_->artifacts.empty();
}

uint64_t VersionLog::head_version() const {
  std::lock_guard lock(state_->mu);
  return state_->head_version;
}

Hash128 VersionLog::head_hash() const {
  std::lock_guard lock(state_->mu);
  return state_->head_hash;
}

uint64_t VersionLog::last_version() const {
  std::lock_guard lock(state_->mu);
  return state_->last_version;
}

std::vector<Hash128> VersionLog::head_tensor_hashes() const {
  std::lock_guard lock(state_->mu);
  return state_->head_tensor_hashes;
}

std::vector<uint64_t> VersionLog::RebuildableVersions() const {
  return Rebuildable(Artifacts());
}

Result<RebuiltCheckpoint> VersionLog::Rebuild(uint64_t version) const {
  std::lock_guard append_lock(state_->append_mu);
  return RebuildLocked(version);
}

Result<RebuiltCheckpoint> VersionLog::RebuildLocked(uint64_t version) const {
  const State& s = *state_;
  RebuiltCheckpoint out;
  out.version = version;
  if (!s.artifacts.empty() && version == s.head_version) {
    FW_ASSIGN_OR_RETURN(out.checkpoint, CopyCheckpoint(s.head.view()));
    out.tensor_hashes = s.head_tensor_hashes;
    out.hash = s.head_hash;
    return out;
  }
  // append_mu is held: no Append changes the artifacts while they are read.
  const std::vector<const ArtifactInfo*> chain = ChainTo(s.artifacts, version);
  if (chain.empty()) {
    return Status::NotFound("version log " + s.dir + ": the weights of version " +
                            std::to_string(version) +
                            " can no longer be rebuilt (it can rebuild: " +
                            VersionList(Rebuildable(s.artifacts)) + ")");
  }
  FW_ASSIGN_OR_RETURN(RebuiltHead rebuilt, DecodeChain(s.env, chain, s.options.threads));
  FW_ASSIGN_OR_RETURN(out.hash, CheckpointHashFromTensorHashes(rebuilt.checkpoint.view(),
                                                               rebuilt.tensor_hashes));
  if (out.hash != chain.back()->target_hash) {
    return Status::Corruption("version log " + s.dir + ": version " + std::to_string(version) +
                              " rebuilt with hash " + out.hash.ToHex() + ", recorded " +
                              chain.back()->target_hash.ToHex());
  }
  out.checkpoint = std::move(rebuilt.checkpoint);
  out.tensor_hashes = std::move(rebuilt.tensor_hashes);
  return out;
}

Result<RebuiltCheckpoint> VersionLog::ApplyDelta(std::span<const std::byte> container, int threads,
                                                 const BytesReadFn& read) const {
  FW_ASSIGN_OR_RETURN(delta::DeltaView view, delta::DeltaView::Parse(container));
  if (read) read(container);  // the parse walked it; the apply reads each payload again
  const delta::Manifest& manifest = view.manifest();
  if (manifest.keyframe) return Status::InvalidArgument("the container is a keyframe, not a delta");
  std::lock_guard append_lock(state_->append_mu);
  FW_ASSIGN_OR_RETURN(RebuiltCheckpoint base, RebuildLocked(manifest.base_version));
  if (base.hash != manifest.base_hash) {
    return Status::Mismatch("the delta's base hash " + manifest.base_hash.ToHex() +
                            " is not the hash of version " +
                            std::to_string(manifest.base_version) + " held here (" +
                            base.hash.ToHex() + ")");
  }
  MutableCheckpointView state = base.checkpoint.mutable_view();
  delta::ApplyOptions apply;
  apply.threads = threads;
  apply.state_tensor_hashes = base.tensor_hashes;
  apply.restore_on_failure = false;  // a scratch copy
  apply.payload_read = read;
  FW_ASSIGN_OR_RETURN(delta::ApplyStats stats, delta::ApplyInPlace(state, view, apply));
  RebuiltCheckpoint out;
  out.version = manifest.target_version;
  out.checkpoint = std::move(base.checkpoint);
  out.tensor_hashes = std::move(stats.tensor_hashes);
  FW_ASSIGN_OR_RETURN(out.hash,
                      CheckpointHashFromTensorHashes(out.checkpoint.view(), out.tensor_hashes));
  if (out.hash != manifest.target_hash) {
    return Status::Corruption("the delta produced hash " + out.hash.ToHex() +
                              ", its manifest says " + manifest.target_hash.ToHex());
  }
  return out;
}

}  // namespace flywheel::sync
