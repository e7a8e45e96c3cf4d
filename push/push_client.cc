#include "push/push_client.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <thread>

#include "base/hex.h"
#include "delta/delta.h"
#include "checkpoint/safetensors.h"
#include "transport/http.h"
#include "transport/tls.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kReadBytes = 8 << 20;

struct Target {
  transport::Endpoint endpoint;
  transport::HttpGetOptions http;
};

Result<Target> TargetOf(const PushClientOptions& options) {
  std::string_view url = options.url;
  bool tls = false;
  if (url.starts_with("https://")) {
    tls = true;
    url.remove_prefix(8);
  } else if (url.starts_with("http://")) {
    url.remove_prefix(7);
  } else {
    return Status::InvalidArgument("publisher URL '" + options.url +
                                   "' must start with http:// or https://");
  }
  while (url.ends_with('/')) url.remove_suffix(1);
  Target target;
  FW_ASSIGN_OR_RETURN(target.endpoint, transport::ParseEndpoint(url));
  target.http.token = options.token;
  target.http.timeout = options.timeout;
  if (tls) {
    if (options.ca_file.empty()) {
      return Status::InvalidArgument("an https:// publisher needs the CA file to verify it (--ca)");
    }
    FW_ASSIGN_OR_RETURN(target.http.tls, transport::MakeClientTlsContext(
                                             {options.cert_file, options.key_file, options.ca_file}));
  }
  return target;
}

struct Answer {
  int status = 0;
  nlohmann::json body;
  std::string code() const {
    return body.is_object() && body.contains("error") && body["error"].is_object()
               ? body["error"].value("code", std::string())
               : std::string();
  }
};

Status AnswerError(const std::string& what, const Answer& answer) {
  std::string message = answer.body.is_object() && answer.body.contains("error")
                            ? answer.body["error"].value("message", std::string())
                            : answer.body.dump();
  const std::string text = what + ": the publisher answered " + std::to_string(answer.status) +
                           " " + answer.code() + ": " + message;
  switch (answer.status) {
    case 400:
      return Status::InvalidArgument(text);
    case 404:
    case 410:
      return Status::NotFound(text);
    case 409:
      return Status::Mismatch(text);
    case 413:
      return Status::ResourceExhausted(text);
    case 422:
      return Status::Corruption(text);
    default:
      return Status::Unavailable(text);
  }
}

// One request; a connection failure is Unavailable, any HTTP answer is an Answer.
Result<Answer> Call(const Target& target, const std::string& method, const std::string& path,
                    const std::string& body, const std::string& content_type) {
  FW_ASSIGN_OR_RETURN(transport::HttpResponse response,
                      transport::HttpCall(target.endpoint, method, path, body, target.http,
                                          content_type));
  Answer answer{response.status, nlohmann::json::parse(response.body, nullptr, false)};
  if (answer.body.is_discarded()) answer.body = response.body;
  return answer;
}

// Call, retried with backoff while the connection fails.
Result<Answer> CallRetrying(const Target& target, int retries, const std::string& method,
                            const std::string& path, const std::string& body = {},
                            const std::string& content_type = "application/json",
                            int* resumes = nullptr) {
  for (int attempt = 0;; ++attempt) {
    Result<Answer> answer = Call(target, method, path, body, content_type);
    if (answer.ok() || answer.status().code() != StatusCode::kUnavailable || attempt >= retries) {
      return answer;
    }
    if (resumes) ++*resumes;
    std::this_thread::sleep_for(std::chrono::milliseconds(100 << std::min(attempt, 5)));
  }
}

// The body of an upload: files on disk in order, or bytes in memory (a delta).
struct Body {
  struct File {
    std::string name, path;
    uint64_t size = 0;
  };
  std::vector<File> files;
  std::vector<std::byte> memory;
  uint64_t size = 0;

  Result<std::string> Read(uint64_t offset, uint64_t length) const {
    std::string out;
    out.reserve(length);
    if (files.empty()) {
      const auto* begin = reinterpret_cast<const char*>(memory.data()) + offset;
      return std::string(begin, begin + length);
    }
    uint64_t file_begin = 0;
    for (const File& file : files) {
      const uint64_t begin = std::max(offset, file_begin);
      const uint64_t end = std::min(offset + length, file_begin + file.size);
      if (begin < end) {
        const int fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return ErrnoStatus("cannot open", file.path, errno);
        const size_t at = out.size();
        out.resize(at + (end - begin));
        const ssize_t got = ::pread(fd, out.data() + at, end - begin,
                                    static_cast<off_t>(begin - file_begin));
        ::close(fd);
        if (got != static_cast<ssize_t>(end - begin)) {
          return Status::IOError(file.path + " changed while it was being pushed");
        }
      }
      file_begin += file.size;
    }
    return out;
  }

  Result<std::string> Xxh3() const {
    XXH3_state_t* state = XXH3_createState();
    XXH3_64bits_reset(state);
    Status status;
    for (uint64_t offset = 0; offset < size && status.ok(); offset += kReadBytes) {
      Result<std::string> chunk = Read(offset, std::min<uint64_t>(kReadBytes, size - offset));
      status = chunk.status();
      if (chunk.ok()) XXH3_64bits_update(state, chunk->data(), chunk->size());
    }
    const uint64_t value = XXH3_64bits_digest(state);
    XXH3_freeState(state);
    if (!status.ok()) return status;
    return Hex64(value);
  }
};

// The files of a checkpoint path, as a full upload sends them.
Result<Body> FullBody(const std::string& path) {
  Body body;
  std::error_code ec;
  auto add = [&](const std::string& name, const fs::path& file) -> Status {
    const uint64_t size = fs::file_size(file, ec);
    if (ec) return Status::NotFound("cannot read " + file.string() + ": " + ec.message());
    body.files.push_back({name, file.string(), size});
    body.size += size;
    return Status::Ok();
  };
  if (!fs::is_directory(path, ec)) {
    FW_RETURN_IF_ERROR(add("model.safetensors", path));
    return body;
  }
  const fs::path single = fs::path(path) / "model.safetensors";
  if (fs::exists(single, ec)) {
    FW_RETURN_IF_ERROR(add("model.safetensors", single));
    return body;
  }
  FW_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(path));
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : checkpoint.weight_map()) shards.insert(shard);
  for (const std::string& shard : shards) FW_RETURN_IF_ERROR(add(shard, fs::path(path) / shard));
  FW_RETURN_IF_ERROR(add("model.safetensors.index.json",
                         fs::path(path) / "model.safetensors.index.json"));
  return body;
}

std::string Sha256Hex(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr);
  return HexEncode(std::span<const uint8_t>(digest, length));
}

std::string DefaultClientName() {
  const char* user = std::getenv("USER");
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(user ? user : "unknown") + "@" + host;
}

struct Cached {
  std::string checkpoint;  // path to open, empty when there is none
  uint64_t version = 0;
};

Cached ReadCache(Env* env, const std::string& dir, const std::string& url) {
  Result<std::vector<std::byte>> text = env->ReadFile(dir + "/last.json");
  if (!text.ok()) return {};
  const nlohmann::json last = nlohmann::json::parse(
      reinterpret_cast<const char*>(text->data()),
      reinterpret_cast<const char*>(text->data()) + text->size(), nullptr, false);
  if (!last.is_object() || last.value("url", std::string()) != url ||
      !last.contains("version") || !last["version"].is_number_unsigned()) {
    return {};
  }
  for (const char* name : {"model.safetensors", "checkpoint"}) {
    if (env->FileExists(dir + "/" + name)) {
      return {dir + "/" + name, last["version"].get<uint64_t>()};
    }
  }
  return {};
}

// Copies the regular file `from` to `to` (created or emptied) and syncs it.
Status CopyFileSynced(Env* env, const std::string& from, const std::string& to) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<MappedRegion> source, env->MapReadOnly(from));
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                      env->NewWritableFile(to, Env::OpenMode::kTruncate));
  FW_RETURN_IF_ERROR(file->Append(source->bytes()));
  FW_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

// Copies the directory `from` to the new directory `to`, recursively, every file and
// directory synced.
Status CopyTreeSynced(Env* env, const std::string& from, const std::string& to) {
  FW_RETURN_IF_ERROR(env->CreateDirs(to));
  FW_ASSIGN_OR_RETURN(std::vector<std::string> names, env->ListDir(from));
  for (const std::string& name : names) {
    const std::string source = from + "/" + name, target = to + "/" + name;
    FW_RETURN_IF_ERROR(env->IsDirectory(source) ? CopyTreeSynced(env, source, target)
                                                : CopyFileSynced(env, source, target));
  }
  return env->SyncDir(to);
}

// Replaces the cache with `checkpoint` as `version`. last.json goes first, durably: a crash
// part-way then leaves no cache (the next push sends the full checkpoint) rather than a
// last.json naming weights the cache no longer holds. The checkpoint is copied beside the
// old one, every file synced, renamed into place; last.json is written last (atomically).
Status WriteCache(Env* env, const std::string& dir, const std::string& url,
                  const std::string& checkpoint, const nlohmann::json& row) {
  const std::string context = "push cache " + dir;
  FW_RETURN_IF_ERROR(env->CreateDirs(dir).WithContext(context));
  FW_RETURN_IF_ERROR(RemoveFileDurably(dir + "/last.json", env).WithContext(context));
  const bool directory = env->IsDirectory(checkpoint) &&
                         !env->FileExists(checkpoint + "/model.safetensors");
  const std::string source = directory || !env->IsDirectory(checkpoint)
                                 ? checkpoint
                                 : checkpoint + "/model.safetensors";
  const std::string name = directory ? "checkpoint" : "model.safetensors";
  const std::string temp = dir + "/.incoming-" + std::to_string(::getpid());
  FW_RETURN_IF_ERROR(env->RemoveAll(temp).WithContext(context));
  Status copied = directory ? CopyTreeSynced(env, source, temp) : CopyFileSynced(env, source, temp);
  if (!copied.ok()) {
    (void)env->RemoveAll(temp);
    return copied.WithContext("cannot copy " + source + " into the " + context);
  }
  FW_RETURN_IF_ERROR(env->RemoveAll(dir + "/checkpoint").WithContext(context));
  FW_RETURN_IF_ERROR(env->RemoveAll(dir + "/model.safetensors").WithContext(context));
  FW_RETURN_IF_ERROR(env->RenameFile(temp, dir + "/" + name).WithContext(context));
  FW_RETURN_IF_ERROR(env->SyncDir(dir).WithContext(context));
  const std::string last = nlohmann::json{{"url", url},
                                          {"version", row.value("version", uint64_t{0})},
                                          {"weights_hash", row.value("weights_hash", std::string())}}
                               .dump();
  return WriteFileAtomically(dir + "/last.json", std::as_bytes(std::span(last.data(), last.size())),
                             env)
      .WithContext(context);
}

// Encodes the delta from the cached checkpoint to `checkpoint`; nullopt when there is no
// usable cache (none, or another layout).
Result<std::optional<std::vector<std::byte>>> LocalDelta(const Cached& cached,
                                                         const std::string& checkpoint,
                                                         uint64_t target_version, int threads) {
  if (cached.checkpoint.empty() || target_version <= cached.version) {
    return std::optional<std::vector<std::byte>>();
  }
  FW_ASSIGN_OR_RETURN(Checkpoint base, Checkpoint::Open(cached.checkpoint));
  FW_ASSIGN_OR_RETURN(Checkpoint target, Checkpoint::Open(checkpoint));
  delta::EncodeOptions encode;
  encode.base_version = cached.version;
  encode.target_version = target_version;
  encode.threads = threads;
  Result<std::vector<std::byte>> bytes = delta::Encode(base.tensors(), target.tensors(), encode);
  if (!bytes.ok()) {
    if (bytes.status().code() == StatusCode::kMismatch) return std::optional<std::vector<std::byte>>();  // new layout
    return bytes.status();
  }
  return std::optional<std::vector<std::byte>>(std::move(*bytes));
}

class Uploader {
 public:
  Uploader(const PushClientOptions& options, const Target& target, const PushProgress& progress,
           PushOutcome* outcome)
      : options_(options), target_(target), progress_(progress), outcome_(outcome) {}

  // Creates, sends and commits one upload. A 409 from create or commit is returned as the
  // Answer (the caller decides on a fallback); other failures are errors.
  Result<Answer> Run(const Body& body, nlohmann::json spec) {
    sent_ = 0;
    FW_ASSIGN_OR_RETURN(spec["digest"]["value"], body.Xxh3());
    spec["digest"]["algorithm"] = "xxh3_64";
    spec["size"] = body.size;
    FW_ASSIGN_OR_RETURN(Answer created, CallRetrying(target_, options_.retries, "POST",
                                                     "/v1/uploads", spec.dump()));
    if (created.status == 409) return created;
    if (created.status != 201) return AnswerError("create upload", created);
    const std::string id = created.body.value("id", std::string());
    FW_RETURN_IF_ERROR(SendMissing(body, id, {{0, body.size}}));
    for (int attempt = 0;; ++attempt) {
      const auto commit_start = Clock::now();
      FW_ASSIGN_OR_RETURN(Answer committed,
                          CallRetrying(target_, options_.retries, "POST",
                                       "/v1/uploads/" + id + "/commit", {}, {}, &outcome_->resumes));
      outcome_->commit_seconds = std::chrono::duration<double>(Clock::now() - commit_start).count();
      if (committed.status == 200 || committed.status == 409) return committed;
      // A commit whose connection broke after the publisher started may find the upload
      // gone (published, or removed); the ledger says which, so ask for incomplete only.
      if (committed.status != 422 || committed.code() != "incomplete" || attempt > 2) {
        return AnswerError("commit upload " + id, committed);
      }
      FW_RETURN_IF_ERROR(SendMissing(body, id, RangesOf(committed.body["error"]["missing"])));
    }
  }

 private:
  static std::vector<std::pair<uint64_t, uint64_t>> RangesOf(const nlohmann::json& missing) {
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const nlohmann::json& range : missing) {
      ranges.emplace_back(range.at(0).get<uint64_t>(), range.at(1).get<uint64_t>());
    }
    return ranges;
  }

  // Sends `ranges` part by part. After a broken connection it asks the publisher what it
  // has and continues with what is missing.
  Status SendMissing(const Body& body, const std::string& id,
                     std::vector<std::pair<uint64_t, uint64_t>> ranges) {
    for (int resumes = 0;; ++resumes) {
      Status sent = SendRanges(body, id, ranges);
      if (sent.ok() || sent.code() != StatusCode::kUnavailable || resumes >= options_.retries) {
        return sent;
      }
      ++outcome_->resumes;
      std::this_thread::sleep_for(std::chrono::milliseconds(100 << std::min(resumes, 5)));
      FW_ASSIGN_OR_RETURN(Answer state,
                          CallRetrying(target_, options_.retries, "GET", "/v1/uploads/" + id));
      if (state.status != 200) return AnswerError("resume upload " + id, state);
      ranges = RangesOf(state.body["missing"]);
    }
  }

  Status SendRanges(const Body& body, const std::string& id,
                    const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
    for (const auto& [begin, end] : ranges) {
      for (uint64_t offset = begin; offset < end; offset += options_.part_bytes) {
        const uint64_t length = std::min(options_.part_bytes, end - offset);
        FW_ASSIGN_OR_RETURN(std::string part, body.Read(offset, length));
        outcome_->sent_bytes += length;
        // The part's own digest: the publisher checks it as the part ends and drops a
        // part whose bytes are not these (422 part_hash_mismatch).
        const std::string target = "/v1/uploads/" + id + "?offset=" + std::to_string(offset) +
                                   "&xxh3=" + Hex64(XXH3_64bits(part.data(), part.size()));
        FW_ASSIGN_OR_RETURN(Answer answer,
                            Call(target_, "PUT", target, part, "application/octet-stream"));
        if (answer.status != 200) return AnswerError("send part at " + std::to_string(offset), answer);
        sent_ = answer.body.value("received_bytes", sent_);
        if (progress_) progress_(sent_, body.size);
      }
    }
    return Status::Ok();
  }

  const PushClientOptions& options_;
  const Target& target_;
  const PushProgress& progress_;
  PushOutcome* outcome_;
  uint64_t sent_ = 0;
};

}  // namespace

std::string PushCacheDir(const std::string& root, const std::string& url) {
  std::string base = root;
  if (base.empty()) {
    if (const char* env = std::getenv("FLYWHEEL_CACHE_DIR"); env && *env) {
      base = env;
    } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
      base = std::string(xdg) + "/flywheel/push";
    } else {
      const char* home = std::getenv("HOME");
      base = std::string(home ? home : "/tmp") + "/.cache/flywheel/push";
    }
  }
  return base + "/" + Sha256Hex(url).substr(0, 16);
}

Result<nlohmann::json> CallPublisher(const PushClientOptions& options, const std::string& method,
                                     const std::string& path, const nlohmann::json& body) {
  FW_ASSIGN_OR_RETURN(Target target, TargetOf(options));
  FW_ASSIGN_OR_RETURN(Answer answer, CallRetrying(target, options.retries, method, path,
                                                  body.is_null() ? std::string() : body.dump()));
  if (answer.status < 200 || answer.status > 299) return AnswerError(method + " " + path, answer);
  return answer.body;
}

Result<nlohmann::json> WaitServing(const PushClientOptions& options, uint64_t version,
                                   double fraction, std::chrono::milliseconds timeout,
                                   uint64_t min_workers) {
  PushClientOptions wait = options;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const int64_t poll_ms = std::clamp<int64_t>(left.count(), 0, 60000);
    wait.timeout = std::chrono::milliseconds(poll_ms + 10000);
    char fraction_text[32];
    std::snprintf(fraction_text, sizeof(fraction_text), "%.6f", fraction);
    FW_ASSIGN_OR_RETURN(nlohmann::json readiness,
                        CallPublisher(wait, "GET",
                                      "/v1/wait?version=" + std::to_string(version) +
                                          "&fraction=" + fraction_text +
                                          "&timeout_ms=" + std::to_string(poll_ms) +
                                          "&min_workers=" + std::to_string(min_workers)));
    if (readiness.value("ready", false)) return readiness;
    if (Clock::now() >= deadline) {
      return Status::Unavailable(
          "v" + std::to_string(version) + " is served by " +
          std::to_string(readiness.value("serving", 0)) + " of " +
          std::to_string(readiness.value("workers", 0)) + " workers after " +
          std::to_string(timeout.count() / 1000.0) + " s (needed " +
          std::to_string(readiness.value("needed", 0)) + ")");
    }
  }
}

Result<PushOutcome> Push(const PushClientOptions& options, const PushRequest& request,
                         const PushProgress& progress) {
  FW_ASSIGN_OR_RETURN(Target target, TargetOf(options));
  PushOutcome outcome;
  // Validated here first, so that a wrong file fails in milliseconds, not after an upload.
  FW_RETURN_IF_ERROR(Checkpoint::Open(request.checkpoint).status());
  FW_ASSIGN_OR_RETURN(Body full, FullBody(request.checkpoint));
  outcome.checkpoint_bytes = full.size;
  nlohmann::json spec = {{"kind", "full"},
                         {"metadata", request.metadata},
                         {"client", options.client.empty() ? DefaultClientName() : options.client}};
  if (request.version) spec["version"] = *request.version;
  const std::string cache_dir = PushCacheDir(options.cache_dir, options.url);
  Uploader uploader(options, target, progress, &outcome);

  std::optional<Answer> answer;
  Env* const env = options.env != nullptr ? options.env : Env::Default();
  const Cached cached = options.use_delta ? ReadCache(env, cache_dir, options.url) : Cached{};
  if (!cached.checkpoint.empty()) {
    uint64_t version = request.version.value_or(0);
    if (!request.version) {
      FW_ASSIGN_OR_RETURN(nlohmann::json versions, CallPublisher(options, "GET", "/v1/versions"));
      version = versions.value("head_version", uint64_t{0}) + 1;
    }
    const auto start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::optional<std::vector<std::byte>> delta,
                        LocalDelta(cached, request.checkpoint, version, options.threads));
    outcome.encode_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (delta) {
      Body body;
      body.memory = std::move(*delta);
      body.size = body.memory.size();
      nlohmann::json delta_spec = spec;
      delta_spec["kind"] = "delta";
      delta_spec["base_version"] = cached.version;
      delta_spec["version"] = version;
      const auto upload_start = Clock::now();
      FW_ASSIGN_OR_RETURN(Answer delta_answer, uploader.Run(body, delta_spec));
      outcome.upload_seconds = std::chrono::duration<double>(Clock::now() - upload_start).count();
      if (delta_answer.status == 409 && delta_answer.code() == "unknown_base") {
        outcome.fell_back = true;
        outcome.fallback_reason = delta_answer.body["error"].value("message", std::string());
      } else {
        outcome.kind = "delta";
        outcome.uploaded_bytes = body.size;
        answer = delta_answer;
      }
    }
  }
  if (!answer) {
    const auto upload_start = Clock::now();
    FW_ASSIGN_OR_RETURN(answer, uploader.Run(full, spec));
    outcome.upload_seconds = std::chrono::duration<double>(Clock::now() - upload_start).count();
    outcome.kind = "full";
    outcome.uploaded_bytes = full.size;
  }
  if (answer->status != 200) return AnswerError("push " + request.checkpoint, *answer);
  outcome.row = answer->body;
  if (options.use_delta) {
    FW_RETURN_IF_ERROR(WriteCache(env, cache_dir, options.url, request.checkpoint, outcome.row));
  }
  return outcome;
}

}  // namespace flywheel::sync
