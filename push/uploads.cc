#include "push/uploads.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <tuple>

#include <spdlog/spdlog.h>

#include "base/hex.h"
#include "base/json.h"

namespace flywheel::sync {
namespace {

constexpr uint64_t kMaxFiles = 4096;
constexpr size_t kHashBufferBytes = 8 << 20;
// Open uploads at most: empty ones take no quota, but each holds a directory.
constexpr size_t kMaxOpenUploads = 1024;

bool PlainFileName(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name[0] != '.' &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

std::string NewUploadId() {
  std::random_device device;
  std::string id = "u-";
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = device();
    unsigned char bytes[4] = {static_cast<unsigned char>(word), static_cast<unsigned char>(word >> 8),
                              static_cast<unsigned char>(word >> 16),
                              static_cast<unsigned char>(word >> 24)};
    id += HexEncode(std::span<const uint8_t>(bytes, 4));
  }
  return id;
}

Result<uint64_t> U64(const nlohmann::json& body, const char* field) {
  auto it = body.find(field);
  if (it == body.end()) return Status::InvalidArgument(std::string("missing field '") + field + "'");
  if (!it->is_number_unsigned()) {
    return Status::InvalidArgument(std::string("field '") + field +
                                   "' must be a non-negative integer");
  }
  return it->get<uint64_t>();
}

Result<std::vector<UploadFile>> ParseFiles(const nlohmann::json& body, UploadKind kind,
                                           uint64_t size) {
  if (kind == UploadKind::kDelta) {
    if (body.contains("files")) {
      return Status::InvalidArgument("field 'files' is for full uploads; a delta is one file");
    }
    return std::vector<UploadFile>{{"delta", size}};
  }
  if (!body.contains("files")) return std::vector<UploadFile>{{"model.safetensors", size}};
  const nlohmann::json& files = body["files"];
  if (!files.is_array() || files.empty() || files.size() > kMaxFiles) {
    return Status::InvalidArgument("field 'files' must be a non-empty array (at most " +
                                   std::to_string(kMaxFiles) + " files)");
  }
  std::vector<UploadFile> out;
  std::set<std::string> names;
  uint64_t total = 0;
  for (const nlohmann::json& file : files) {
    if (!file.is_object() || !file.contains("name") || !file["name"].is_string()) {
      return Status::InvalidArgument("every entry of 'files' needs a string 'name'");
    }
    UploadFile entry{file["name"].get<std::string>(), 0};
    if (!PlainFileName(entry.name) || !names.insert(entry.name).second) {
      return Status::InvalidArgument("file name '" + entry.name +
                                     "' is not a plain, unique file name");
    }
    FW_ASSIGN_OR_RETURN(entry.size, U64(file, "size"));
    if (entry.size > size || total + entry.size > size) {
      return Status::InvalidArgument("the sizes of 'files' add up to more than 'size'");
    }
    total += entry.size;
    out.push_back(std::move(entry));
  }
  if (total != size) {
    return Status::InvalidArgument("the sizes of 'files' add up to " + std::to_string(total) +
                                   ", not 'size' " + std::to_string(size));
  }
  return out;
}

Result<UploadDigest> ParseDigest(const nlohmann::json& body) {
  auto it = body.find("digest");
  if (it == body.end() || !it->is_object() || !it->contains("algorithm") ||
      !it->contains("value") || !(*it)["algorithm"].is_string() || !(*it)["value"].is_string()) {
    return Status::InvalidArgument(
        "field 'digest' must be {\"algorithm\": \"xxh3_64\"|\"sha256\", \"value\": hex}");
  }
  UploadDigest digest{(*it)["algorithm"].get<std::string>(), (*it)["value"].get<std::string>()};
  const size_t length = digest.algorithm == "xxh3_64" ? 16 : digest.algorithm == "sha256" ? 64 : 0;
  if (length == 0) {
    return Status::InvalidArgument("digest algorithm '" + digest.algorithm +
                                   "' is not supported (xxh3_64 or sha256)");
  }
  if (digest.value.size() != length || !IsHex(digest.value, HexCase::kLower)) {
    return Status::InvalidArgument("digest value must be " + std::to_string(length) +
                                   " lowercase hex digits");
  }
  return digest;
}

// Hashes the body (the files in order) with the upload's digest algorithm.
Result<std::string> BodyDigest(const StagedUpload& staged) {
  const bool sha = staged.spec.digest.algorithm == "sha256";
  XXH3_state_t* xxh = sha ? nullptr : XXH3_createState();
  EVP_MD_CTX* md = sha ? EVP_MD_CTX_new() : nullptr;
  if (xxh) XXH3_64bits_reset(xxh);
  if (md) EVP_DigestInit_ex(md, EVP_sha256(), nullptr);
  std::vector<unsigned char> buffer(kHashBufferBytes);
  Status status;
  for (const UploadFile& file : staged.spec.files) {
    const std::string path = staged.dir + "/" + file.name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      status = ErrnoStatus("cannot open", path, errno);
      break;
    }
    for (uint64_t offset = 0; offset < file.size && status.ok();) {
      const ssize_t got = ::pread(fd, buffer.data(), std::min<uint64_t>(buffer.size(), file.size - offset),
                                  static_cast<off_t>(offset));
      if (got <= 0) {
        status = got == 0 ? Status::IOError(path + " is shorter than declared")
                          : ErrnoStatus("cannot read", path, errno);
        break;
      }
      if (xxh) XXH3_64bits_update(xxh, buffer.data(), static_cast<size_t>(got));
      if (md) EVP_DigestUpdate(md, buffer.data(), static_cast<size_t>(got));
      offset += static_cast<uint64_t>(got);
    }
    ::close(fd);
    if (!status.ok()) break;
  }
  std::string digest;
  if (xxh) {
    digest = Hex64(XXH3_64bits_digest(xxh));
    XXH3_freeState(xxh);
  }
  if (md) {
    unsigned char bytes[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    EVP_DigestFinal_ex(md, bytes, &length);
    digest = HexEncode(std::span<const uint8_t>(bytes, length));
    EVP_MD_CTX_free(md);
  }
  if (!status.ok()) return status;
  return digest;
}

// A full staging disk is Unavailable (the upload is removed); other errors stay as they are.
Status DiskFullIsUnavailable(Status status, const std::string& what) {
  if (status.code() != StatusCode::kResourceExhausted) return status;
  return Status::Unavailable("the staging disk is full: " + what + ": " + status.message());
}

// Creates `path` with `size` bytes allocated; Unavailable when the disk is full.
Status Allocate(Env* env, const std::string& path, uint64_t size) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                      env->NewWritableFile(path, Env::OpenMode::kCreateNew, 0600));
  Status status = file->Allocate(size);
  if (status.ok()) status = file->Close();
  return DiskFullIsUnavailable(std::move(status),
                               "cannot allocate " + std::to_string(size) + " bytes for " + path);
}

// Per upload, beside its files (names a client's files cannot take: they are never hidden).
constexpr const char* kRecordFile = ".upload.json";  // the spec, written durably at Create
constexpr const char* kRangesFile = ".ranges";       // "<begin> <end> <xxh3 hex>\n" per part

bool IsUploadId(const std::string& name) {
  return name.size() == 34 && name.compare(0, 2, "u-") == 0 &&
         IsHex(std::string_view(name).substr(2), HexCase::kLower);
}

// XXH3-64 of the body bytes [begin, end) of the mapped files (laid end to end).
uint64_t RangeDigest(const std::vector<std::unique_ptr<MappedRegion>>& files, uint64_t begin,
                     uint64_t end) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  uint64_t file_begin = 0;
  for (const std::unique_ptr<MappedRegion>& file : files) {
    const std::span<const std::byte> bytes = file->bytes();
    const uint64_t from = std::max(begin, file_begin);
    const uint64_t to = std::min<uint64_t>(end, file_begin + bytes.size());
    if (from < to) {
      const std::span<const std::byte> range = bytes.subspan(from - file_begin, to - from);
      XXH3_64bits_update(state, range.data(), range.size());
      file->Release(range);  // a recovery hashes gigabytes: keep none of them resident
    }
    file_begin += bytes.size();
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

// One record of kRangesFile; nullopt for a torn or malformed line.
std::optional<std::tuple<uint64_t, uint64_t, uint64_t>> ParseRange(std::string_view line) {
  unsigned long long begin = 0, end = 0;
  char hex[17] = {};
  const std::string text(line);
  if (std::sscanf(text.c_str(), "%llu %llu %16s", &begin, &end, hex) != 3 || begin >= end) {
    return std::nullopt;
  }
  Result<uint64_t> digest = HexDecode64(hex, HexCase::kLower);
  if (!digest.ok() || std::strlen(hex) != 16) return std::nullopt;
  return std::make_tuple(uint64_t{begin}, uint64_t{end}, *digest);
}

}  // namespace

nlohmann::json ToJson(const UploadSpec& spec) {
  nlohmann::json files = nlohmann::json::array();
  for (const UploadFile& file : spec.files) files.push_back({{"name", file.name}, {"size", file.size}});
  nlohmann::json out = {
      {"version", spec.version ? nlohmann::json(*spec.version) : nlohmann::json("next")},
      {"kind", UploadKindName(spec.kind)},
      {"size", spec.size},
      {"digest", {{"algorithm", spec.digest.algorithm}, {"value", spec.digest.value}}},
      {"metadata", spec.metadata},
      {"client", spec.client}};
  if (spec.kind == UploadKind::kDelta) {
    out["base_version"] = spec.base_version;
  } else {
    out["files"] = files;
  }
  return out;
}

std::string SpecDifference(const UploadSpec& first, const UploadSpec& again) {
  auto differs = [](const std::string& field, const auto& a, const auto& b) {
    return field + " " + nlohmann::json(b).dump() + " (the upload declared " +
           nlohmann::json(a).dump() + ")";
  };
  if (first.size != again.size) return differs("size", first.size, again.size);
  if (first.digest.algorithm != again.digest.algorithm || first.digest.value != again.digest.value) {
    return differs("digest", first.digest.algorithm + ":" + first.digest.value,
                   again.digest.algorithm + ":" + again.digest.value);
  }
  if (first.kind != again.kind) {
    return differs("kind", UploadKindName(first.kind), UploadKindName(again.kind));
  }
  if (first.kind == UploadKind::kDelta && first.base_version != again.base_version) {
    return differs("base_version", first.base_version, again.base_version);
  }
  if (first.version != again.version) {
    return differs("version", ToJson(first)["version"], ToJson(again)["version"]);
  }
  const nlohmann::json files_a = ToJson(first).value("files", nlohmann::json());
  const nlohmann::json files_b = ToJson(again).value("files", nlohmann::json());
  if (files_a != files_b) return differs("files", files_a, files_b);
  return "";
}

const char* UploadKindName(UploadKind kind) {
  return kind == UploadKind::kDelta ? "delta" : "full";
}

Result<UploadSpec> ParseUploadSpec(const nlohmann::json& body) {
  if (!body.is_object()) return Status::InvalidArgument("the request body must be a JSON object");
  UploadSpec spec;
  const nlohmann::json version = body.value("version", nlohmann::json("next"));
  if (version.is_number_unsigned() && version.get<uint64_t>() > 0) {
    spec.version = version.get<uint64_t>();
  } else if (version != "next") {
    return Status::InvalidArgument("field 'version' must be a positive integer or \"next\"");
  }
  const nlohmann::json kind = body.value("kind", nlohmann::json("full"));
  if (kind != "full" && kind != "delta") {
    return Status::InvalidArgument("field 'kind' must be \"full\" or \"delta\"");
  }
  spec.kind = kind == "delta" ? UploadKind::kDelta : UploadKind::kFull;
  if (spec.kind == UploadKind::kDelta) {
    FW_ASSIGN_OR_RETURN(spec.base_version, U64(body, "base_version"));
  } else if (body.contains("base_version")) {
    return Status::InvalidArgument("field 'base_version' is for delta uploads");
  }
  FW_ASSIGN_OR_RETURN(spec.size, U64(body, "size"));
  FW_ASSIGN_OR_RETURN(spec.files, ParseFiles(body, spec.kind, spec.size));
  FW_ASSIGN_OR_RETURN(spec.digest, ParseDigest(body));
  spec.metadata = body.value("metadata", nlohmann::json::object());
  if (!spec.metadata.is_object()) {
    return Status::InvalidArgument("field 'metadata' must be a JSON object");
  }
  const nlohmann::json client = body.value("client", nlohmann::json(""));
  if (!client.is_string() || client.get<std::string>().size() > 256) {
    return Status::InvalidArgument("field 'client' must be a string of at most 256 bytes");
  }
  spec.client = client.get<std::string>();
  return spec;
}

nlohmann::json ToJson(const UploadState& state) {
  nlohmann::json missing = nlohmann::json::array();
  for (const auto& [begin, end] : state.missing) missing.push_back({begin, end});
  nlohmann::json files = nlohmann::json::array();
  for (const UploadFile& file : state.spec.files) {
    files.push_back({{"name", file.name}, {"size", file.size}});
  }
  nlohmann::json out = {{"id", state.id},
                        {"kind", UploadKindName(state.spec.kind)},
                        {"version", state.spec.version ? nlohmann::json(*state.spec.version)
                                                       : nlohmann::json("next")},
                        {"size", state.spec.size},
                        {"files", files},
                        {"received_bytes", state.received_bytes},
                        {"missing", missing},
                        {"expires_in_s", state.expires_in_s}};
  if (state.spec.kind == UploadKind::kDelta) out["base_version"] = state.spec.base_version;
  return out;
}

std::string StagedUpload::CheckpointPath() const {
  if (spec.kind == UploadKind::kDelta) return dir + "/delta";
  if (spec.files.size() == 1) return dir + "/" + spec.files[0].name;
  return dir;
}

Result<std::unique_ptr<UploadStore>> UploadStore::Open(UploadStoreOptions options, Env* env) {
  if (options.dir.empty()) return Status::InvalidArgument("uploads: no staging directory given");
  if (options.max_part_bytes == 0 || options.max_upload_bytes == 0) {
    return Status::InvalidArgument("uploads: size limits must be positive");
  }
  FW_RETURN_IF_ERROR(env->CreateDirs(options.dir).WithContext("uploads: staging directory"));
  std::unique_ptr<UploadStore> store(new UploadStore(std::move(options), env));
  FW_RETURN_IF_ERROR(store->Recover());
  return store;
}

// Staged uploads stay on disk for the next process (Recover); Remove and expiry delete them.
UploadStore::~UploadStore() = default;

// Takes over what an earlier process staged. Anything that is not an upload this store
// wrote (a foreign name, a directory without its record, a record that does not parse, a
// file missing or of another size) is removed, and so is an upload past the limits; the
// staging directory itself is never removed (it may be a mount point).
Status UploadStore::Recover() {
  FW_ASSIGN_OR_RETURN(std::vector<std::string> names, env_->ListDir(options_.dir));
  for (const std::string& name : names) {
    const std::string path = options_.dir + "/" + name;
    std::string refused;
    if (!IsUploadId(name) || !env_->IsDirectory(path)) {
      refused = "not an upload of this publisher";
    } else {
      Result<std::shared_ptr<Upload>> upload = RecoverUpload(name, path);
      if (upload.ok()) {
        std::lock_guard lock(mu_);
        if (uploads_.size() < kMaxOpenUploads &&
            StagedBytesLocked() + (*upload)->spec.size <= options_.quota_bytes) {
          uploads_.emplace(name, std::move(*upload));
          continue;
        }
        refused = "over the staging quota or the number of open uploads";
      } else {
        refused = upload.status().message();
      }
    }
    Note("uploads: removed " + path + " left in the staging directory: " + refused);
    FW_RETURN_IF_ERROR(env_->RemoveAll(path));
  }
  return Status::Ok();
}

void UploadStore::Note(std::string note) {
  spdlog::warn("{}", note);
  std::lock_guard lock(mu_);
  recovery_.push_back(std::move(note));
}

std::vector<std::string> UploadStore::recovery() const {
  std::lock_guard lock(mu_);
  return recovery_;
}

// One upload directory: its record, its files, and the ranges whose bytes match their
// recorded digest (the others are dropped: reported missing, to be sent again).
Result<std::shared_ptr<UploadStore::Upload>> UploadStore::RecoverUpload(const std::string& id,
                                                                        const std::string& dir) {
  Result<std::vector<std::byte>> record = env_->ReadFile(dir + "/" + kRecordFile);
  if (!record.ok()) return Status::Corruption("no readable " + std::string(kRecordFile) +
                                              " (a crash while it was created?): " +
                                              record.status().message());
  const std::string_view text(reinterpret_cast<const char*>(record->data()), record->size());
  Result<nlohmann::json> json = ParseJson(text, dir + "/" + kRecordFile);
  if (!json.ok()) return json.status();
  if (!json->is_object() || json->value("id", "") != id || !json->contains("spec")) {
    return Status::Corruption(std::string(kRecordFile) + " does not describe upload " + id);
  }
  Result<UploadSpec> spec = ParseUploadSpec((*json)["spec"]);
  if (!spec.ok()) return spec.status().WithContext(kRecordFile);
  if (spec->size > options_.max_upload_bytes) return Status::ResourceExhausted("above the size limit");
  auto upload = std::make_shared<Upload>();
  upload->spec = std::move(*spec);
  upload->dir = dir;
  upload->last_activity_us = env_->NowMicros();
  std::set<std::string> expected = {kRecordFile, kRangesFile};
  std::vector<std::unique_ptr<MappedRegion>> files;
  for (const UploadFile& file : upload->spec.files) {
    expected.insert(file.name);
    Result<std::unique_ptr<MappedRegion>> mapped = env_->MapReadOnly(dir + "/" + file.name);
    if (!mapped.ok()) return mapped.status();
    if ((*mapped)->bytes().size() != file.size) {
      return Status::Corruption(file.name + " holds " + std::to_string((*mapped)->bytes().size()) +
                                " bytes, not the declared " + std::to_string(file.size));
    }
    files.push_back(std::move(*mapped));
  }
  FW_ASSIGN_OR_RETURN(std::vector<std::string> present, env_->ListDir(dir));
  for (const std::string& name : present) {
    if (expected.count(name)) continue;
    Note("uploads: removed " + dir + "/" + name + ": not a file of upload " + id);
    FW_RETURN_IF_ERROR(env_->RemoveAll(dir + "/" + name));
  }
  RecoverRanges(*upload, files);
  return upload;
}

void UploadStore::RecoverRanges(Upload& upload, const std::vector<std::unique_ptr<MappedRegion>>& files) {
  const std::string path = upload.dir + "/" + kRangesFile;
  Result<std::vector<std::byte>> ranges = env_->ReadFile(path);
  if (!ranges.ok()) return;  // no part was recorded
  std::string_view text(reinterpret_cast<const char*>(ranges->data()), ranges->size());
  uint64_t dropped = 0;
  while (!text.empty()) {
    const size_t newline = text.find('\n');
    const auto range = ParseRange(text.substr(0, newline));
    if (newline == std::string_view::npos || !range) {
      Note("uploads: " + path + ": a torn or malformed record at its end is ignored");
      break;
    }
    text.remove_prefix(newline + 1);
    const auto [begin, end, digest] = *range;
    if (end > upload.spec.size) {
      ++dropped;
      continue;
    }
    if (RangeDigest(files, begin, end) != digest) {
      Note("uploads: " + upload.dir + ": bytes [" + std::to_string(begin) + ", " +
           std::to_string(end) + ") do not match their recorded digest: dropped, missing again");
      ++dropped;
      continue;
    }
    MergeRange(upload, begin, end);
  }
  UploadState state = StateOf(upload.dir.substr(upload.dir.rfind('/') + 1), upload);
  spdlog::info("uploads: resumed {} ({} of {} bytes staged, {} range(s) dropped)", upload.dir,
               state.received_bytes, upload.spec.size, dropped);
}

void UploadStore::MergeRange(Upload& upload, uint64_t begin, uint64_t end) {
  auto it = upload.received.upper_bound(begin);
  if (it != upload.received.begin() && std::prev(it)->second >= begin) --it;
  while (it != upload.received.end() && it->first <= end) {
    begin = std::min(begin, it->first);
    end = std::max(end, it->second);
    it = upload.received.erase(it);
  }
  if (end > begin) upload.received[begin] = end;
}

uint64_t UploadStore::staged_bytes() const {
  std::lock_guard lock(mu_);
  return StagedBytesLocked();
}

uint64_t UploadStore::StagedBytesLocked() const {
  uint64_t total = 0;
  for (const auto& [id, upload] : uploads_) total += upload->spec.size;
  return total;
}

UploadState UploadStore::StateOf(const std::string& id, const Upload& upload) const {
  UploadState state{id, upload.spec, 0, {}, 0};
  uint64_t at = 0;
  for (const auto& [begin, end] : upload.received) {
    if (begin > at) state.missing.emplace_back(at, begin);
    state.received_bytes += end - begin;
    at = end;
  }
  if (at < upload.spec.size) state.missing.emplace_back(at, upload.spec.size);
  const double idle_s = static_cast<double>(env_->NowMicros() - upload.last_activity_us) / 1e6;
  state.expires_in_s = std::max(0.0, static_cast<double>(options_.expiry.count()) / 1e3 - idle_s);
  return state;
}

Result<std::shared_ptr<UploadStore::Upload>> UploadStore::Find(const std::string& id) {
  auto it = uploads_.find(id);
  if (it == uploads_.end()) {
    return Status::NotFound(expired_.count(id) ? "upload " + id + " expired and was removed"
                                               : "no upload " + id);
  }
  return it->second;
}

void UploadStore::RemoveLocked(const std::string& id) {
  auto it = uploads_.find(id);
  if (it == uploads_.end()) return;
  (void)env_->RemoveAll(it->second->dir);
  uploads_.erase(it);
}

Result<UploadState> UploadStore::Create(UploadSpec spec) {
  if (spec.size > options_.max_upload_bytes) {
    return Status::ResourceExhausted("upload of " + std::to_string(spec.size) +
                                     " bytes is above the limit of " +
                                     std::to_string(options_.max_upload_bytes));
  }
  const std::string id = NewUploadId();
  auto upload = std::make_shared<Upload>();
  upload->spec = std::move(spec);
  upload->dir = options_.dir + "/" + id;
  upload->last_activity_us = env_->NowMicros();
  upload->busy = 1;  // the allocation below; nobody knows the id yet
  {
    // The quota is reserved here, under the lock; the (possibly slow) allocation is not.
    std::lock_guard lock(mu_);
    if (uploads_.size() >= kMaxOpenUploads) {
      return Status::ResourceExhausted(std::to_string(uploads_.size()) +
                                       " uploads are open already; commit or abort some first");
    }
    const uint64_t staged = StagedBytesLocked();
    if (staged + upload->spec.size > options_.quota_bytes) {
      return Status::ResourceExhausted(
          "upload of " + std::to_string(upload->spec.size) +
          " bytes does not fit the staging quota (" +
          std::to_string(options_.quota_bytes - std::min(staged, options_.quota_bytes)) + " of " +
          std::to_string(options_.quota_bytes) + " bytes left)");
    }
    uploads_.emplace(id, upload);
  }
  Status allocated = env_->CreateDirs(upload->dir);
  for (const UploadFile& file : upload->spec.files) {
    if (!allocated.ok()) break;
    allocated = Allocate(env_, upload->dir + "/" + file.name, file.size);
  }
  if (allocated.ok()) {
    // Durable before the id is answered: a restart finds the upload (Recover).
    const std::string record =
        nlohmann::json{{"format", 1}, {"id", id}, {"spec", ToJson(upload->spec)}}.dump() + "\n";
    allocated = DiskFullIsUnavailable(
        WriteFileAtomically(upload->dir + "/" + kRecordFile,
                            std::as_bytes(std::span(record.data(), record.size())), env_),
        "cannot write the record of upload " + id);
  }
  std::lock_guard lock(mu_);
  --upload->busy;
  if (!allocated.ok()) {
    RemoveLocked(id);
    return allocated;
  }
  return StateOf(id, *upload);
}

void UploadStore::SubtractRange(Upload& upload, uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  auto it = upload.received.upper_bound(begin);
  if (it != upload.received.begin() && std::prev(it)->second > begin) --it;
  std::vector<std::pair<uint64_t, uint64_t>> kept;
  while (it != upload.received.end() && it->first < end) {
    if (it->first < begin) kept.emplace_back(it->first, begin);
    if (it->second > end) kept.emplace_back(end, it->second);
    it = upload.received.erase(it);
  }
  for (const auto& [keep_begin, keep_end] : kept) upload.received[keep_begin] = keep_end;
}

// The open part's files and digest: the staged files it reaches, opened once each, and
// the XXH3-64 of its bytes so far.
struct PartWriter::Impl {
  explicit Impl(std::shared_ptr<UploadStore::Upload> upload_in) : upload(std::move(upload_in)) {
    XXH3_64bits_reset(xxh3.get());
  }
  ~Impl() { (void)CloseFile(); }

  Status CloseFile() {
    if (!file) return Status::Ok();
    Status status = file->Close();
    file.reset();
    return status;
  }

  // Writes `bytes` at body offset `offset` into the upload's files.
  Status WriteBody(Env* env, uint64_t offset, std::span<const std::byte> bytes) {
    uint64_t file_begin = 0;
    for (size_t index = 0; index < upload->spec.files.size(); ++index) {
      const UploadFile& entry = upload->spec.files[index];
      const uint64_t begin = std::max(offset, file_begin);
      const uint64_t end = std::min<uint64_t>(offset + bytes.size(), file_begin + entry.size);
      if (begin < end) {
        const std::string path = upload->dir + "/" + entry.name;
        if (!file || file_index != index) {
          FW_RETURN_IF_ERROR(CloseFile());
          FW_ASSIGN_OR_RETURN(file, env->NewWritableFile(path, Env::OpenMode::kExisting));
          file_index = index;
        }
        FW_RETURN_IF_ERROR(DiskFullIsUnavailable(
            file->WriteAt(begin - file_begin, bytes.subspan(begin - offset, end - begin)),
            "cannot write " + path));
      }
      file_begin += entry.size;
    }
    return Status::Ok();
  }

  std::shared_ptr<UploadStore::Upload> upload;
  std::unique_ptr<WritableFile> file;
  size_t file_index = 0;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> xxh3{XXH3_createState(),
                                                                  &XXH3_freeState};
};

PartWriter::PartWriter(UploadStore* store, std::string id, uint64_t offset, uint64_t limit,
                       std::optional<uint64_t> length, std::unique_ptr<Impl> impl)
    : store_(store),
      id_(std::move(id)),
      offset_(offset),
      limit_(limit),
      length_(length),
      impl_(std::move(impl)) {}

PartWriter::~PartWriter() { Abort(); }

static std::string PartName(const std::string& id, uint64_t offset) {
  return "the part at offset " + std::to_string(offset) + " of upload " + id;
}

Status PartWriter::Write(std::span<const std::byte> piece) {
  if (!open_) return Status::Internal(PartName(id_, offset_) + " was ended already");
  Status status;
  if (piece.size() > limit_ - written_) {
    const uint64_t size = impl_->upload->spec.size;
    const uint64_t max_part = store_->options().max_part_bytes;
    const std::string sent = std::to_string(written_ + piece.size()) + " bytes or more";
    if (length_) {
      status = Status::InvalidArgument(PartName(id_, offset_) + " sent " + sent + ", more than its " +
                                       std::to_string(*length_) + " declared");
    } else if (limit_ == max_part && max_part < size - offset_) {
      status = Status::ResourceExhausted(PartName(id_, offset_) + " of " + sent +
                                         " is above the limit of " + std::to_string(max_part));
    } else {
      status = Status::InvalidArgument(PartName(id_, offset_) + " of " + sent +
                                       " lies outside the upload's " + std::to_string(size) +
                                       " bytes");
    }
  } else {
    status = impl_->WriteBody(store_->env_, offset_ + written_, piece);
  }
  if (!status.ok()) {
    // A full staging disk removes the upload.
    store_->DropPart(impl_->upload, id_, offset_, written_ + piece.size(),
                     status.code() == StatusCode::kUnavailable);
    open_ = false;
    return status;
  }
  XXH3_64bits_update(impl_->xxh3.get(), piece.data(), piece.size());
  written_ += piece.size();
  return Status::Ok();
}

Result<UploadState> PartWriter::Finish(std::optional<uint64_t> expected_xxh3) {
  if (!open_) return Status::Internal(PartName(id_, offset_) + " was ended already");
  const uint64_t xxh3 = XXH3_64bits_digest(impl_->xxh3.get());
  Status status = impl_->CloseFile();
  if (status.ok() && length_ && written_ != *length_) {
    status = Status::InvalidArgument(PartName(id_, offset_) + " ended after " +
                                     std::to_string(written_) + " of its " +
                                     std::to_string(*length_) + " declared bytes; it was dropped");
  }
  if (status.ok() && expected_xxh3 && *expected_xxh3 != xxh3) {
    status = Status::Corruption(PartName(id_, offset_) + " (" + std::to_string(written_) +
                                " bytes) hashes to xxh3_64 " + Hex64(xxh3) +
                                ", the client declared " + Hex64(*expected_xxh3) +
                                "; the part was dropped: send it again");
  }
  open_ = false;
  if (!status.ok()) {
    store_->DropPart(impl_->upload, id_, offset_, written_, false);
    return status;
  }
  return store_->EndPart(impl_->upload, id_, offset_, written_, xxh3);
}

void PartWriter::Abort() {
  if (!open_) return;
  open_ = false;
  (void)impl_->CloseFile();
  store_->DropPart(impl_->upload, id_, offset_, written_, false);
}

Result<std::unique_ptr<PartWriter>> UploadStore::BeginPart(const std::string& id, uint64_t offset,
                                                           std::optional<uint64_t> length) {
  if (length && *length > options_.max_part_bytes) {
    return Status::ResourceExhausted("part of " + std::to_string(*length) +
                                     " bytes is above the limit of " +
                                     std::to_string(options_.max_part_bytes));
  }
  std::lock_guard lock(mu_);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<Upload> upload, Find(id));
  if (upload->taken) return Status::Mismatch("upload " + id + " is being committed");
  const uint64_t size = upload->spec.size;
  if (offset > size || (length && *length > size - offset)) {
    return Status::InvalidArgument("part [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + length.value_or(0)) +
                                   ") lies outside the upload's " + std::to_string(size) +
                                   " bytes");
  }
  ++upload->busy;  // Take and ExpireIdle leave it alone until the part ends
  upload->last_activity_us = env_->NowMicros();
  const uint64_t limit = length ? *length : std::min(options_.max_part_bytes, size - offset);
  auto impl = std::make_unique<PartWriter::Impl>(upload);
  return std::unique_ptr<PartWriter>(new PartWriter(this, id, offset, limit, length, std::move(impl)));
}

Result<UploadState> UploadStore::Write(const std::string& id, uint64_t offset,
                                       std::span<const std::byte> bytes) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<PartWriter> part, BeginPart(id, offset, bytes.size()));
  FW_RETURN_IF_ERROR(part->Write(bytes));
  return part->Finish();
}

Result<UploadState> UploadStore::EndPart(const std::shared_ptr<Upload>& upload,
                                         const std::string& id, uint64_t offset, uint64_t written,
                                         uint64_t xxh3) {
  // The bytes are down (not synced: the recorded digest says after a power cut whether
  // they made it); the range's record is synced before the part is acknowledged.
  Status recorded = written == 0 ? Status::Ok() : RecordRange(*upload, offset, offset + written, xxh3);
  std::lock_guard lock(mu_);
  --upload->busy;
  auto current = uploads_.find(id);
  const bool still_held = current != uploads_.end() && current->second == upload;
  if (!recorded.ok()) {
    SubtractRange(*upload, offset, offset + written);
    if (recorded.code() == StatusCode::kUnavailable && still_held) RemoveLocked(id);
    return recorded;
  }
  if (!still_held) return Status::NotFound("upload " + id + " was removed while a part was written");
  MergeRange(*upload, offset, offset + written);
  upload->last_activity_us = env_->NowMicros();
  return StateOf(id, *upload);
}

void UploadStore::DropPart(const std::shared_ptr<Upload>& upload, const std::string& id,
                           uint64_t offset, uint64_t written, bool remove_upload) {
  std::lock_guard lock(mu_);
  --upload->busy;
  // What the part reached may have overwritten received bytes with others.
  SubtractRange(*upload, offset, std::min(offset + written, upload->spec.size));
  upload->last_activity_us = env_->NowMicros();
  auto current = uploads_.find(id);
  const bool still_held = current != uploads_.end() && current->second == upload;
  if (remove_upload && still_held) RemoveLocked(id);
}

// Appends the part's range and digest to the upload's kRangesFile and syncs it. The part's
// bytes are not synced: after a power cut the digest tells whether they made it.
Status UploadStore::RecordRange(Upload& upload, uint64_t begin, uint64_t end, uint64_t xxh3) {
  const std::string line =
      std::to_string(begin) + " " + std::to_string(end) + " " + Hex64(xxh3) + "\n";
  const std::string path = upload.dir + "/" + kRangesFile;
  std::lock_guard lock(upload.record_mu);
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, env_->NewAppendableFile(path));
  Status status = file->Append(std::as_bytes(std::span(line.data(), line.size())));
  if (status.ok()) status = file->Sync();
  if (status.ok()) status = file->Close();
  if (status.ok() && !upload.ranges_dir_synced) {
    status = env_->SyncDir(upload.dir);  // the file's name, once
    upload.ranges_dir_synced = status.ok();
  }
  return DiskFullIsUnavailable(std::move(status), "cannot record a part in " + path);
}

Result<UploadState> UploadStore::Resume(const std::string& id, const UploadSpec& again) {
  std::lock_guard lock(mu_);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<Upload> upload, Find(id));
  if (upload->taken) return Status::Mismatch("upload " + id + " is being committed");
  const std::string difference = SpecDifference(upload->spec, again);
  if (!difference.empty()) {
    return Status::Mismatch("upload " + id + " cannot be resumed with another " + difference +
                            "; create a new upload (without 'resume') for other bytes");
  }
  upload->last_activity_us = env_->NowMicros();
  return StateOf(id, *upload);
}

Result<UploadState> UploadStore::State(const std::string& id) {
  std::lock_guard lock(mu_);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<Upload> upload, Find(id));
  upload->last_activity_us = env_->NowMicros();
  return StateOf(id, *upload);
}

Result<StagedUpload> UploadStore::Take(const std::string& id) {
  StagedUpload staged;
  {
    std::lock_guard lock(mu_);
    FW_ASSIGN_OR_RETURN(std::shared_ptr<Upload> upload, Find(id));
    if (upload->taken) return Status::Mismatch("upload " + id + " is being committed already");
    if (upload->busy > 0) {
      return Status::Mismatch("upload " + id +
                              " has a part still being written; commit once it is acknowledged");
    }
    const UploadState state = StateOf(id, *upload);
    if (!state.missing.empty()) {
      return Status::Mismatch("upload " + id + " is incomplete: " +
                              std::to_string(upload->spec.size - state.received_bytes) +
                              " of " + std::to_string(upload->spec.size) +
                              " bytes are missing, from byte " +
                              std::to_string(state.missing.front().first));
    }
    upload->taken = true;
    upload->last_activity_us = env_->NowMicros();
    staged = StagedUpload{id, upload->spec, upload->dir};
  }
  // Hashed outside the lock: the upload is taken, no part writes it any more.
  Result<std::string> digest = BodyDigest(staged);
  Status status = digest.status();
  if (digest.ok() && *digest != staged.spec.digest.value) {
    status = Status::Corruption("the body's " + staged.spec.digest.algorithm + " is " + *digest +
                                ", the upload declared " + staged.spec.digest.value);
  }
  if (!status.ok()) {
    std::lock_guard lock(mu_);
    RemoveLocked(id);
    return status;
  }
  return staged;
}

Status UploadStore::Remove(const std::string& id) {
  std::lock_guard lock(mu_);
  if (!uploads_.count(id)) return Status::NotFound("no upload " + id);
  RemoveLocked(id);
  return Status::Ok();
}

size_t UploadStore::ExpireIdle() {
  std::lock_guard lock(mu_);
  const int64_t now = env_->NowMicros();
  const int64_t expiry_us = static_cast<int64_t>(options_.expiry.count()) * 1000;
  std::vector<std::string> idle;
  for (const auto& [id, upload] : uploads_) {
    if (!upload->taken && upload->busy == 0 && now - upload->last_activity_us > expiry_us) {
      idle.push_back(id);
    }
  }
  for (const std::string& id : idle) {
    RemoveLocked(id);
    expired_.insert(id);
  }
  return idle.size();
}

bool UploadStore::WasExpired(const std::string& id) const {
  std::lock_guard lock(mu_);
  return expired_.count(id) > 0;
}

}  // namespace flywheel::sync
