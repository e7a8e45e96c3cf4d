#include "push/push_api.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "base/hex.h"
#include "base/json.h"
#include "checkpoint/safetensors.h"
#include "transport/api.h"

namespace flywheel::sync {

using transport::ApiError;
using transport::ApiResult;
using transport::Credential;
using transport::HttpRequest;
using transport::Query;

namespace {

constexpr std::chrono::milliseconds kWaitDefault{30000};
constexpr std::chrono::milliseconds kWaitTick{25};
constexpr uint64_t kControlBodyLimit = 1 << 20;

// A part's digest from the client (?xxh3=<16 hex>, optional).
Result<std::optional<uint64_t>> PartDigest(const Query& query) {
  const std::optional<std::string> hex = query.Get("xxh3");
  if (!hex) return std::optional<uint64_t>();
  Result<uint64_t> value = HexDecode64(*hex, HexCase::kLower);
  if (!value.ok() || hex->size() != 16) {
    return Status::InvalidArgument("?xxh3= must be the part's XXH3-64 as 16 lowercase hex digits, not '" +
                                   hex->substr(0, 32) + "'");
  }
  return std::optional<uint64_t>(*value);
}

std::string VersionList(const std::vector<uint64_t>& versions) {
  std::string text;
  for (uint64_t v : versions) text += (text.empty() ? "v" : ", v") + std::to_string(v);
  return text.empty() ? "none" : text;
}

}  // namespace

Readiness ReadinessOf(const std::vector<FleetNode>& fleet, uint64_t version) {
  Readiness readiness;
  readiness.version = version;
  for (const FleetNode& node : fleet) {
    if (node.state.role() != wire::WORKER) continue;
    const bool serving = node.state.version() >= version;
    auto& region = readiness.regions[node.state.region()];
    ++readiness.workers;
    ++region.first;
    if (serving) {
      ++readiness.serving;
      ++region.second;
    }
  }
  return readiness;
}

nlohmann::json ToJson(const Readiness& readiness) {
  nlohmann::json regions = nlohmann::json::object();
  for (const auto& [name, counts] : readiness.regions) {
    regions[name] = {{"workers", counts.first}, {"serving", counts.second}};
  }
  const double fraction = readiness.workers == 0 ? 0.0
                                                 : static_cast<double>(readiness.serving) /
                                                       static_cast<double>(readiness.workers);
  return {{"version", readiness.version},
          {"workers", readiness.workers},
          {"serving", readiness.serving},
          {"fraction", fraction},
          {"regions", regions}};
}

struct PushApi::Impl : std::enable_shared_from_this<PushApi::Impl> {
  Impl(asio::any_io_executor executor, PushOptions options, PublishTarget* target, Ledger* ledger,
       std::unique_ptr<UploadStore> uploads, asio::thread_pool* cpu, int threads,
       bool read_token_required)
      : executor(executor),
        options(std::move(options)),
        target(target),
        ledger(ledger),
        uploads(std::move(uploads)),
        cpu(cpu),
        io(2),
        threads(threads),
        read_token_required(read_token_required) {}

  asio::any_io_executor executor;
  PushOptions options;
  PublishTarget* target;
  Ledger* ledger;
  std::unique_ptr<UploadStore> uploads;
  asio::thread_pool* cpu;
  asio::thread_pool io;
  int threads;
  bool read_token_required;
  std::atomic<bool> stopped{false};
  // Commits and pins run one at a time on the CPU pool; this says a pin is in force.
  std::atomic<bool> pinned{false};
  // GET /v1/wait requests being held (at most options.max_waiters).
  std::atomic<size_t> waiters{0};

  std::optional<ApiError> DenyPush(const HttpRequest& request) const;
  std::optional<ApiError> DenyRead(const HttpRequest& request) const;
  std::optional<ApiError> DenyAdmin(const HttpRequest& request) const;
  ApiError UploadFailure(const Status& status, const std::string& id) const;
  // UploadFailure, and 422 part_hash_mismatch for a part whose bytes are not the client's.
  ApiError PartFailure(const Status& status, const std::string& id) const;
  nlohmann::json PinJson() const { return ToJson(ledger->pin()); }

  awaitable<ApiResult> Uploads(HttpRequest request);
  ApiResult CreateUpload(const HttpRequest& request);
  awaitable<ApiResult> WritePart(std::string id, HttpRequest request);
  ApiResult CommitNow(const std::string& id, const std::string& peer);
  ApiResult PublishStaged(const StagedUpload& staged, const std::string& peer);
  ApiResult PublishDelta(const StagedUpload& staged, LedgerRow row);
  ApiResult PublishInPlace(const StagedUpload& staged, uint64_t version,
                           std::span<const std::byte> bytes, const BytesReadFn& read,
                           LedgerRow row);
  ApiResult Published(uint64_t version, const CheckpointView& checkpoint,
                         const AppendOptions& known, LedgerRow row);
  ApiResult Versions(const HttpRequest& request) const;
  ApiResult ReadinessNow(const HttpRequest& request) const;
  awaitable<ApiResult> Wait(HttpRequest request);
  awaitable<ApiResult> Pin(HttpRequest request);
  ApiResult PinNow(uint64_t version, nlohmann::json metadata, std::string client,
                      std::string peer);
  ApiResult Unpin();
};

namespace {

// Null when the request's token has `scope`; else 403 `forbidden` (a known token without
// it: `refusal` says what it cannot do) or 401 (no token, or an unknown one).
std::optional<ApiError> DenyUnlessScope(const HttpRequest& request, uint32_t scope,
                                            const std::string& refusal) {
  if (request.scopes & scope) return std::nullopt;
  if (request.scopes != 0) return ApiError{403, "forbidden", refusal};
  return ApiError{401, "unauthorized", "missing or unknown bearer token"};
}

}  // namespace

std::optional<ApiError> PushApi::Impl::DenyPush(const HttpRequest& request) const {
  if (options.token.empty()) {
    return ApiError{403, "push_disabled",
                 "this publisher takes no pushes: start it with --push-token-file"};
  }
  return DenyUnlessScope(request, transport::kScopePush,
                         "this token cannot push (it lacks the 'push' scope); send the push token");
}

std::optional<ApiError> PushApi::Impl::DenyAdmin(const HttpRequest& request) const {
  if (options.token.empty()) {
    return ApiError{403, "push_disabled",
                 "this publisher takes no pushes or pins: start it with --push-token-file"};
  }
  return DenyUnlessScope(request, transport::kScopeAdmin,
                         "this token cannot pin or unpin (it lacks the 'admin' scope)");
}

std::optional<ApiError> PushApi::Impl::DenyRead(const HttpRequest& request) const {
  if (!read_token_required) return std::nullopt;
  return DenyUnlessScope(request, transport::kScopeRead,
                         "this token cannot read (it lacks the 'read' scope)");
}

ApiError PushApi::Impl::UploadFailure(const Status& status, const std::string& id) const {
  // The table's status (transport/api.h), with the codes docs/PUSH_API.md lists for uploads
  // (uploads.h says which Status each failure is).
  ApiError error = ApiError::From(status);
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kResourceExhausted:
      break;
    case StatusCode::kNotFound:
      if (uploads->WasExpired(id)) error = ApiError{410, "upload_expired", status.message()};
      break;
    case StatusCode::kUnavailable:  // the staging disk is full
      error = ApiError{507, "insufficient_storage", status.message() + "; the upload was removed"};
      break;
    case StatusCode::kMismatch:  // a commit of it is running
      error.code = "committing";
      break;
    case StatusCode::kCorruption:
      error.code = "body_hash_mismatch";
      error.message += "; the upload was removed";
      break;
    default:
      spdlog::error("push: upload {}: {}", id, status.message());
      break;
  }
  return error;
}

ApiResult PushApi::Impl::CreateUpload(const HttpRequest& request) {
  // The route takes part-sized bodies (PUT); a create is a control body, parsed here on the
  // network thread, so it gets the control limit.
  Result<nlohmann::json> body =
      ParseJson(request.body, "the request body", JsonLimits{.max_bytes = kControlBodyLimit});
  if (!body.ok()) return ApiError{400, "bad_request", body.status().message()};
  Result<UploadSpec> spec = ParseUploadSpec(*body);
  if (!spec.ok()) return ApiError{400, "bad_request", spec.status().message()};
  if (pinned) {
    return ApiError{409, "pinned", "the fleet is pinned; unpin before pushing",
                 {{"pin", PinJson()}}};
  }
  const uint64_t last = target->version_log().last_version();
  if (spec->version && *spec->version <= last) {
    return ApiError{409, "version_conflict",
                 "version " + std::to_string(*spec->version) + " is not above the head v" +
                     std::to_string(last),
                 {{"head_version", last}}};
  }
  if (spec->kind == UploadKind::kDelta) {
    const std::vector<uint64_t> held = target->version_log().RebuildableVersions();
    if (!std::binary_search(held.begin(), held.end(), spec->base_version)) {
      return ApiError{409, "unknown_base",
                   "the publisher cannot rebuild base version " +
                       std::to_string(spec->base_version) + " (it holds " + VersionList(held) +
                       "); push the full checkpoint",
                   {{"held_versions", held}}};
    }
  }
  // {"resume": id}: the client resumes an upload (after a restart of either side) and
  // declares its body again; an upload that is not held any more is created anew.
  const nlohmann::json resume = body->value("resume", nlohmann::json());
  if (!resume.is_null() && !resume.is_string()) {
    return ApiError{400, "bad_request", "field 'resume' must be an upload id"};
  }
  if (resume.is_string()) {
    Result<UploadState> resumed = uploads->Resume(resume.get<std::string>(), *spec);
    if (resumed.ok()) return ApiResult(ToJson(*resumed));
    if (resumed.status().code() == StatusCode::kMismatch) {
      return ApiError{409, "upload_mismatch", resumed.status().message()};
    }
    spdlog::info("push: upload {} to resume is not held ({}); creating a new one",
                 resume.get<std::string>(), resumed.status().message());
  }
  Result<UploadState> state = uploads->Create(std::move(*spec));
  if (!state.ok()) return UploadFailure(state.status(), "");
  spdlog::info("push: upload {} created ({} bytes, {})", state->id, state->spec.size,
               UploadKindName(state->spec.kind));
  return ApiResult(ToJson(*state), 201);
}

namespace {

// A part's body goes to the staging files in pieces of this size as it arrives: the most a
// part holds in memory, whatever its size.
constexpr size_t kPartPieceBytes = 4 << 20;

// A part being received: the store's writer and the piece buffer, shared with the writes
// that run on the I/O pool.
struct PartInFlight {
  std::unique_ptr<PartWriter> writer;
  std::vector<std::byte> piece = std::vector<std::byte>(kPartPieceBytes);
};

// Fills `part`'s piece from the body: how many bytes (fewer than the piece only at the
// body's end), or the body's failure.
awaitable<Result<size_t>> ReadPiece(transport::HttpBodyReader& body, PartInFlight& part) {
  size_t filled = 0;
  while (filled < part.piece.size()) {
    awaitable<Result<size_t>> read = body.Read(std::span(part.piece).subspan(filled));
    Result<size_t> got = co_await std::move(read);
    if (!got.ok()) co_return got.status();
    if (*got == 0) break;
    filled += *got;
  }
  co_return filled;
}

}  // namespace

ApiError PushApi::Impl::PartFailure(const Status& status, const std::string& id) const {
  if (status.code() == StatusCode::kCorruption) {
    return ApiError{422, "part_hash_mismatch", status.message()};
  }
  return UploadFailure(status, id);
}

awaitable<ApiResult> PushApi::Impl::WritePart(std::string id, HttpRequest request) {
  const Query query(request.target);
  const Result<uint64_t> offset = query.Unsigned("offset", UINT64_MAX);
  if (!offset.ok()) co_return offset.status();
  if (*offset == UINT64_MAX) {
    co_return ApiError{400, "bad_request", "PUT of a part needs ?offset=N"};
  }
  Result<std::optional<uint64_t>> expected = PartDigest(query);
  if (!expected.ok()) co_return ApiError{400, "bad_request", expected.status().message()};
  if (request.body_reader == nullptr) co_return ApiError{500, "internal", "a part's body was not streamed"};
  transport::HttpBodyReader& body = *request.body_reader;
  Result<std::unique_ptr<PartWriter>> begun = uploads->BeginPart(id, *offset, body.content_length());
  if (!begun.ok()) co_return UploadFailure(begun.status(), id);
  auto part = std::make_shared<PartInFlight>();
  part->writer = std::move(*begun);
  for (;;) {
    awaitable<Result<size_t>> read = ReadPiece(body, *part);
    Result<size_t> filled = co_await std::move(read);
    if (!filled.ok()) {
      part->writer->Abort();  // the client left mid-part: only whole parts count
      co_return filled.status();
    }
    if (*filled == 0) break;
    auto write = [part, size = *filled] {
      return part->writer->Write(std::span(part->piece).first(size));
    };
    std::optional<Status> wrote = co_await transport::RunOn(io, std::move(write));
    if (!wrote) co_return ApiError{500, "internal", "the part write did not run"};
    if (!wrote->ok()) co_return PartFailure(*wrote, id);
    if (*filled < part->piece.size()) break;
  }
  auto finish = [part, expected = *expected] { return part->writer->Finish(expected); };
  std::optional<Result<UploadState>> state = co_await transport::RunOn(io, std::move(finish));
  if (!state) co_return ApiError{500, "internal", "the part's end did not run"};
  if (!state->ok()) co_return PartFailure(state->status(), id);
  co_return ApiResult(ToJson(**state));
}

awaitable<ApiResult> PushApi::Impl::Uploads(HttpRequest request) {
  if (auto denied = DenyPush(request)) co_return *denied;
  // /v1/uploads, /v1/uploads/{id}, /v1/uploads/{id}/commit
  const std::string rest = request.path.substr(std::min<size_t>(request.path.size(), 12));
  const size_t slash = rest.find('/');
  const std::string id = rest.substr(0, slash);
  const std::string action = slash == std::string::npos ? "" : rest.substr(slash + 1);
  if (id.empty()) {
    if (request.method != "POST") co_return ApiError{405, "method_not_allowed", "use POST /v1/uploads"};
    co_return CreateUpload(request);
  }
  if (action == "commit") {
    if (request.method != "POST") co_return ApiError{405, "method_not_allowed", "use POST to commit"};
    auto self = shared_from_this();
    auto commit = [self, id, peer = request.peer] { return self->CommitNow(id, peer); };
    std::optional<ApiResult> response = co_await transport::RunOn(*cpu, std::move(commit));
    co_return response ? std::move(*response) : ApiError{500, "internal", "the commit did not run"};
  }
  if (!action.empty()) co_return ApiError{404, "not_found", "no route " + request.path};
  if (request.method == "PUT") co_return co_await WritePart(id, std::move(request));
  if (request.method == "GET") {
    Result<UploadState> state = uploads->State(id);
    co_return state.ok() ? ApiResult(ToJson(*state)) : UploadFailure(state.status(), id);
  }
  if (request.method == "DELETE") {
    Status removed = uploads->Remove(id);
    if (!removed.ok()) co_return UploadFailure(removed, id);
    co_return ApiResult(nlohmann::json{{"id", id}, {"aborted", true}});
  }
  co_return ApiError{405, "method_not_allowed", "use GET, PUT or DELETE on an upload"};
}

ApiResult PushApi::Impl::CommitNow(const std::string& id, const std::string& peer) {
  if (pinned) {
    (void)uploads->Remove(id);
    return ApiError{409, "pinned", "the fleet is pinned; unpin before pushing (upload removed)",
                 {{"pin", PinJson()}}};
  }
  Result<UploadState> state = uploads->State(id);
  if (!state.ok()) return UploadFailure(state.status(), id);
  if (!state->missing.empty()) {
    nlohmann::json missing = nlohmann::json::array();
    for (const auto& [begin, end] : state->missing) missing.push_back({begin, end});
    return ApiError{422, "incomplete",
                 "upload " + id + " is incomplete: " +
                     std::to_string(state->spec.size - state->received_bytes) +
                     " bytes are missing; send them and commit again",
                 {{"missing", missing}}};
  }
  Result<StagedUpload> staged = uploads->Take(id);
  if (!staged.ok()) return UploadFailure(staged.status(), id);
  ApiResult response = PublishStaged(*staged, peer);
  (void)uploads->Remove(id);
  return response;
}

ApiResult PushApi::Impl::PublishStaged(const StagedUpload& staged, const std::string& peer) {
  LedgerRow row;
  row.source = VersionSource::kPush;
  row.metadata = staged.spec.metadata;
  row.upload_kind = UploadKindName(staged.spec.kind);
  row.uploaded_bytes = staged.spec.size;
  row.pushed_by_client = staged.spec.client;
  row.pushed_by_peer = peer;
  if (staged.spec.kind == UploadKind::kDelta) return PublishDelta(staged, std::move(row));
  Result<Checkpoint> checkpoint = Checkpoint::Open(staged.CheckpointPath());
  if (!checkpoint.ok()) {
    return ApiError{422, "invalid_checkpoint",
                 "upload " + staged.id + ": " + checkpoint.status().message()};
  }
  const uint64_t version = staged.spec.version.value_or(target->version_log().last_version() + 1);
  return Published(version, checkpoint->tensors(), AppendOptions{}, std::move(row));
}

ApiResult PushApi::Impl::PublishDelta(const StagedUpload& staged, LedgerRow row) {
  // Mapped, never read whole: the apply and the log's copy read it where it lies on disk,
  // and drop its pages as they finish with them (MappedReleaser), so a commit holds the
  // rebuilt base (the head's size) and not the delta's gigabytes, in RSS as in its own memory.
  Result<std::unique_ptr<MappedRegion>> mapped = Env::Default()->MapReadOnly(staged.CheckpointPath());
  if (!mapped.ok()) return ApiError{500, "internal", mapped.status().message()};
  const std::span<const std::byte> bytes = (*mapped)->bytes();
  MappedReleaser releaser(**mapped);
  const BytesReadFn read = [&releaser](std::span<const std::byte> done) { releaser.Done(done); };
  Result<delta::DeltaView> view = delta::DeltaView::Parse(bytes);
  releaser.ReleaseAll();
  if (!view.ok()) return ApiError{422, "invalid_delta", "upload " + staged.id + ": " + view.status().message()};
  const delta::Manifest& manifest = view->manifest();
  if (manifest.keyframe || manifest.base_version != staged.spec.base_version ||
      (staged.spec.version && manifest.target_version != *staged.spec.version)) {
    return ApiError{422, "invalid_delta",
                 "upload " + staged.id + ": the container goes from v" +
                     std::to_string(manifest.base_version) + " to v" +
                     std::to_string(manifest.target_version) + (manifest.keyframe ? " (a keyframe)" : "") +
                     ", the upload declared base v" + std::to_string(staged.spec.base_version)};
  }
  // A delta from the head is applied to the log's head in place (no copy of it) and is the
  // log's own delta artifact for this version, byte for byte.
  if (manifest.base_version == target->version_log().head_version()) {
    return PublishInPlace(staged, manifest.target_version, bytes, read, std::move(row));
  }
  Result<RebuiltCheckpoint> rebuilt = target->version_log().ApplyDelta(bytes, threads, read);
  if (!rebuilt.ok()) {
    const StatusCode code = rebuilt.status().code();
    if (code == StatusCode::kNotFound || code == StatusCode::kMismatch) {
      const std::vector<uint64_t> held = target->version_log().RebuildableVersions();
      return ApiError{409, "unknown_base", rebuilt.status().message() + "; push the full checkpoint",
                   {{"held_versions", held}}};
    }
    return ApiError{422, "invalid_delta", "upload " + staged.id + ": " + rebuilt.status().message()};
  }
  AppendOptions known;
  known.tensor_hashes = rebuilt->tensor_hashes;
  known.checkpoint_hash = rebuilt->hash;
  return Published(manifest.target_version, rebuilt->checkpoint.view(), known, std::move(row));
}

ApiResult PushApi::Impl::PublishInPlace(const StagedUpload& staged, uint64_t version,
                                        std::span<const std::byte> bytes, const BytesReadFn& read,
                                        LedgerRow row) {
  const uint64_t last = target->version_log().last_version();
  if (version <= last) {
    return ApiError{409, "version_conflict",
                 "version " + std::to_string(version) + " is not above the head v" +
                     std::to_string(last) + " (another push committed first)",
                 {{"head_version", last}}};
  }
  AppendOptions known;
  known.apply_in_place = bytes;
  known.encoded_delta_read = read;
  Result<LedgerRow> published = target->Publish(version, CheckpointView{}, known, std::move(row));
  if (published.ok()) return ApiResult(ToJson(*published));
  const Status& status = published.status();
  if (status.code() == StatusCode::kMismatch) {  // another push moved the head meanwhile
    const std::vector<uint64_t> held = target->version_log().RebuildableVersions();
    return ApiError{409, "unknown_base", status.message() + "; push the full checkpoint",
                 {{"held_versions", held}}};
  }
  if (status.code() == StatusCode::kCorruption || status.code() == StatusCode::kInvalidArgument) {
    return ApiError{422, "invalid_delta", "upload " + staged.id + ": " + status.message()};
  }
  return ApiError{500, "internal", status.message()};
}

ApiResult PushApi::Impl::Published(uint64_t version, const CheckpointView& checkpoint,
                                      const AppendOptions& known, LedgerRow row) {
  const uint64_t last = target->version_log().last_version();
  if (version <= last) {
    return ApiError{409, "version_conflict",
                 "version " + std::to_string(version) + " is not above the head v" +
                     std::to_string(last) + " (another push committed first)",
                 {{"head_version", last}}};
  }
  Result<LedgerRow> published = target->Publish(version, checkpoint, known, std::move(row));
  if (!published.ok()) {
    if (published.status().code() == StatusCode::kInvalidArgument) {
      return ApiError{422, "invalid_checkpoint", published.status().message()};
    }
    return ApiError{500, "internal", published.status().message()};
  }
  return ApiResult(ToJson(*published));
}

ApiResult PushApi::Impl::Versions(const HttpRequest& request) const {
  if (auto denied = DenyRead(request)) return *denied;
  if (request.method != "GET" && request.method != "HEAD") {
    return ApiError{405, "method_not_allowed", "use GET"};
  }
  const std::vector<uint64_t> held = target->version_log().RebuildableVersions();
  auto row_json = [&](const LedgerRow& row) {
    nlohmann::json json = ToJson(row);
    json["rebuildable"] = std::binary_search(held.begin(), held.end(), row.version);
    return json;
  };
  if (request.path.size() > 12) {  // /v1/versions/{v}
    const std::string text = request.path.substr(13);
    uint64_t version = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), version);
    if (ec != std::errc() || end != text.data() + text.size()) {
      return ApiError{400, "bad_request", "'" + text + "' is not a version number"};
    }
    const std::optional<LedgerRow> row = ledger->Row(version);
    if (!row) return ApiError{404, "not_found", "the ledger has no version " + text};
    return ApiResult(row_json(*row));
  }
  nlohmann::json rows = nlohmann::json::array();
  for (const LedgerRow& row : ledger->Rows()) rows.push_back(row_json(row));
  return ApiResult(nlohmann::json{{"head_version", target->version_log().head_version()},
                            {"pin", PinJson()},
                            {"pin_events", ledger->EventsJson()},
                            {"versions", rows}});
}

ApiResult PushApi::Impl::ReadinessNow(const HttpRequest& request) const {
  if (auto denied = DenyRead(request)) return *denied;
  const uint64_t head = target->version_log().head_version();
  const Result<uint64_t> version = Query(request.target).Unsigned("version", head);
  if (!version.ok()) return version.status();
  nlohmann::json json = ToJson(ReadinessOf(target->Fleet(), *version));
  json["head_version"] = head;
  return ApiResult(json);
}

awaitable<ApiResult> PushApi::Impl::Wait(HttpRequest request) {
  if (auto denied = DenyRead(request)) co_return *denied;
  const uint64_t head = target->version_log().head_version();
  const Query query(request.target);
  const Result<uint64_t> version = query.Unsigned("version", head);
  const Result<double> fraction = query.Number("fraction", 1.0);
  const Result<uint64_t> timeout_ms = query.Unsigned("timeout_ms", kWaitDefault.count());
  const Result<uint64_t> min_workers = query.Unsigned("min_workers", 1);
  for (const Status* status : {&version.status(), &timeout_ms.status(), &min_workers.status(),
                               &fraction.status()}) {
    if (!status->ok()) co_return *status;
  }
  const double wanted = *fraction;
  if (!(wanted >= 0.0 && wanted <= 1.0)) {
    co_return ApiError{400, "bad_request", "fraction must be in [0, 1]"};
  }
  // Each waiter holds a connection slot: at most max_waiters, each for at most max_wait.
  if (waiters.fetch_add(1) >= options.max_waiters) {
    --waiters;
    co_return ApiError{503, "too_many_waiters",
                    std::to_string(options.max_waiters) +
                        " long-polls are waiting already; retry, or poll GET /v1/readiness"};
  }
  struct Leave {
    std::atomic<size_t>& count;
    ~Leave() { --count; }
  } leave{waiters};
  const std::chrono::milliseconds granted =
      std::min(options.max_wait, std::chrono::milliseconds(*timeout_ms));
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + granted;
  for (;;) {
    const Readiness readiness = ReadinessOf(target->Fleet(), *version);
    const uint64_t needed = std::max<uint64_t>(
        *min_workers,
        static_cast<uint64_t>(std::ceil(wanted * static_cast<double>(readiness.workers) - 1e-9)));
    const bool ready = readiness.serving >= needed;
    const auto now = std::chrono::steady_clock::now();
    if (ready || now >= deadline || stopped) {
      nlohmann::json json = ToJson(readiness);
      json["head_version"] = target->version_log().head_version();
      json["ready"] = ready;
      json["needed"] = needed;
      json["timeout_ms"] = granted.count();
      json["waited_ms"] = std::chrono::duration<double, std::milli>(now - start).count();
      co_return ApiResult(json);
    }
    co_await transport::SleepFor(kWaitTick);
  }
}

awaitable<ApiResult> PushApi::Impl::Pin(HttpRequest request) {
  if (auto denied = DenyAdmin(request)) co_return *denied;
  if (request.method != "POST") co_return ApiError{405, "method_not_allowed", "use POST"};
  if (request.path == "/v1/unpin") {
    auto self = shared_from_this();
    auto unpin = [self] { return self->Unpin(); };
    std::optional<ApiResult> response = co_await transport::RunOn(*cpu, std::move(unpin));
    co_return response ? std::move(*response) : ApiError{500, "internal", "the unpin did not run"};
  }
  Result<nlohmann::json> parsed =
      ParseJson(request.body, "the request body", JsonLimits{.max_bytes = kControlBodyLimit});
  if (!parsed.ok()) co_return ApiError{400, "bad_request", parsed.status().message()};
  const nlohmann::json& body = *parsed;
  if (!body.is_object() || !body.contains("version") || !body["version"].is_number_unsigned()) {
    co_return ApiError{400, "bad_request", "the body must be {\"version\": N, \"metadata\": {...}}"};
  }
  nlohmann::json metadata = body.value("metadata", nlohmann::json::object());
  if (!metadata.is_object()) co_return ApiError{400, "bad_request", "'metadata' must be an object"};
  const nlohmann::json client_json = body.value("client", nlohmann::json(""));
  if (!client_json.is_string() || client_json.get<std::string>().size() > 256) {
    co_return ApiError{400, "bad_request", "'client' must be a string of at most 256 bytes"};
  }
  const std::string client = client_json.get<std::string>();
  auto self = shared_from_this();
  auto pin = [self, version = body["version"].get<uint64_t>(), metadata, client,
              peer = request.peer] { return self->PinNow(version, metadata, client, peer); };
  std::optional<ApiResult> response = co_await transport::RunOn(*cpu, std::move(pin));
  co_return response ? std::move(*response) : ApiError{500, "internal", "the pin did not run"};
}

ApiResult PushApi::Impl::PinNow(uint64_t version, nlohmann::json metadata, std::string client,
                                   std::string peer) {
  Result<RebuiltCheckpoint> rebuilt = target->version_log().Rebuild(version);
  if (!rebuilt.ok()) {
    if (!ledger->Row(version) && version > target->version_log().last_version()) {
      return ApiError{404, "not_found", "no version " + std::to_string(version) + " was published"};
    }
    return ApiError{409, "unknown_base", rebuilt.status().message(),
                 {{"held_versions", target->version_log().RebuildableVersions()}}};
  }
  LedgerRow row;
  row.source = VersionSource::kPin;
  row.metadata = std::move(metadata);
  row.pushed_by_client = std::move(client);
  row.pushed_by_peer = std::move(peer);
  row.pinned_to = version;
  AppendOptions known;
  known.tensor_hashes = rebuilt->tensor_hashes;
  known.checkpoint_hash = rebuilt->hash;
  const uint64_t as = target->version_log().last_version() + 1;
  Result<LedgerRow> published = target->Publish(as, rebuilt->checkpoint.view(), known, std::move(row));
  if (!published.ok()) return ApiError{500, "internal", published.status().message()};
  Status saved = ledger->SetPin(PinState{version, as, Env::Default()->NowMicros() / 1000});
  if (!saved.ok()) return ApiError{500, "internal", saved.message()};
  pinned = true;
  spdlog::info("push: pinned the fleet to v{}'s weights, published as v{}", version, as);
  return ApiResult(ToJson(*published));
}

ApiResult PushApi::Impl::Unpin() {
  const std::optional<PinState> before = ledger->pin();
  Status saved = ledger->SetPin(std::nullopt);
  if (!saved.ok()) return ApiError{500, "internal", saved.message()};
  pinned = false;
  if (before) spdlog::info("push: unpinned (was pinned to v{})", before->pinned_to);
  return ApiResult(nlohmann::json{{"pin", nullptr},
                            {"was", ToJson(before)},
                            {"head_version", target->version_log().head_version()}});
}

PushApi::PushApi(asio::any_io_executor executor, PushOptions options, PublishTarget* target,
                 Ledger* ledger, std::unique_ptr<UploadStore> uploads, asio::thread_pool* cpu,
                 int threads, bool read_token_required)
    : impl_(std::make_shared<Impl>(executor, std::move(options), target, ledger,
                                   std::move(uploads), cpu, threads, read_token_required)) {
  impl_->pinned = ledger->pin().has_value();
}

PushApi::~PushApi() {
  impl_->stopped = true;
  impl_->io.join();
}

void PushApi::Register(transport::HttpServer& http) {
  using transport::JsonApiHandler;
  auto impl = impl_;
  const uint64_t part_limit = impl->options.max_part_bytes;
  http.RouteApi(
      "/v1/uploads",
      JsonApiHandler([impl](HttpRequest request) { return impl->Uploads(std::move(request)); }),
      std::max<uint64_t>(part_limit, kControlBodyLimit),
      // Only a part (PUT) is large; creating or committing an upload takes a small body.
      [part_limit](std::string_view method, std::string_view) -> uint64_t {
        return method == "PUT" ? std::max<uint64_t>(part_limit, kControlBodyLimit) : kControlBodyLimit;
      },
      // A part streams to its staging file as it arrives (WritePart), never held whole.
      [](std::string_view method, std::string_view path) {
        return method == "PUT" && path.size() > 12 && path.find('/', 12) == std::string_view::npos;
      });
  http.RouteApi("/v1/versions", JsonApiHandler([impl](HttpRequest request) -> awaitable<ApiResult> {
                  co_return impl->Versions(request);
                }));
  http.RouteApi("/v1/readiness", JsonApiHandler([impl](HttpRequest request) -> awaitable<ApiResult> {
                  co_return impl->ReadinessNow(request);
                }));
  http.RouteApi("/v1/wait",
                JsonApiHandler([impl](HttpRequest request) { return impl->Wait(std::move(request)); }));
  for (const char* path : {"/v1/pin", "/v1/unpin"}) {
    http.RouteApi(
        path, JsonApiHandler([impl](HttpRequest request) { return impl->Pin(std::move(request)); }),
        kControlBodyLimit);
  }
}

awaitable<void> PushApi::ExpiryLoop() {
  auto impl = impl_;
  while (!impl->stopped) {
    co_await transport::SleepFor(std::chrono::milliseconds(
        std::clamp<int64_t>(impl->options.upload_expiry.count() / 4, 10, 1000)));
    const size_t expired = impl->uploads->ExpireIdle();
    if (expired > 0) spdlog::info("push: removed {} abandoned upload(s)", expired);
  }
}

void PushApi::Stop() { impl_->stopped = true; }

void EnablePushApi(PublisherOptions& publisher, PushOptions push) {
  publisher.push_token = push.token;
  publisher.extension =
      [push = std::move(push)](const PublisherContext& context) -> Result<std::unique_ptr<PublisherExtension>> {
    UploadStoreOptions staging;
    staging.dir = push.staging_dir.empty() ? context.state_dir + "/uploads" : push.staging_dir;
    staging.quota_bytes = push.staging_quota_bytes;
    staging.max_upload_bytes = push.max_upload_bytes;
    staging.max_part_bytes = push.max_part_bytes;
    staging.expiry = push.upload_expiry;
    FW_ASSIGN_OR_RETURN(std::unique_ptr<UploadStore> uploads, UploadStore::Open(staging));
    auto api = std::make_unique<PushApi>(context.executor, push, context.target, context.ledger,
                                         std::move(uploads), context.cpu, context.threads,
                                         context.read_token_required);
    api->Register(*context.http);
    asio::co_spawn(context.executor, api->ExpiryLoop(), asio::detached);
    return std::unique_ptr<PublisherExtension>(std::move(api));
  };
}

bool PushApi::pinned() const { return impl_->pinned; }

}  // namespace flywheel::sync
