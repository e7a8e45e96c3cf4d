#include "sync/ledger.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <charconv>
#include <cstdio>
#include <ctime>

#include "base/hex.h"
#include "base/json.h"

namespace flywheel::sync {
namespace {

std::string Iso8601(int64_t unix_ms) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

nlohmann::json NullOr(const std::string& text) {
  return text.empty() ? nlohmann::json(nullptr) : nlohmann::json(text);
}

}  // namespace

const char* VersionSourceName(VersionSource source) {
  switch (source) {
    case VersionSource::kDrop:
      return "drop";
    case VersionSource::kPush:
      return "push";
    case VersionSource::kTrainer:
      return "trainer";
    case VersionSource::kPin:
      return "pin";
  }
  return "unknown";
}

nlohmann::json ToJson(const LedgerRow& row) {
  nlohmann::json pushed_by = nullptr;
  if (row.source == VersionSource::kPush || row.source == VersionSource::kPin) {
    pushed_by = {{"client", NullOr(row.pushed_by_client)}, {"peer", NullOr(row.pushed_by_peer)}};
  }
  return {{"version", row.version},
          {"weights_hash", row.weights_hash},
          {"source", VersionSourceName(row.source)},
          {"created_unix_ms", row.created_unix_ms},
          {"created_at", Iso8601(row.created_unix_ms)},
          {"checkpoint_bytes", row.checkpoint_bytes},
          {"keyframe_bytes", row.keyframe_bytes},
          {"delta_bytes", row.delta_bytes},
          {"uploaded_bytes", row.uploaded_bytes},
          {"upload_kind", NullOr(row.upload_kind)},
          {"metadata", row.metadata},
          {"pushed_by", pushed_by},
          {"pinned_to", row.pinned_to ? nlohmann::json(*row.pinned_to) : nlohmann::json(nullptr)}};
}

Result<LedgerRow> LedgerRowFromJson(const nlohmann::json& json) {
  try {
    LedgerRow row;
    row.version = json.at("version").get<uint64_t>();
    row.weights_hash = json.at("weights_hash").get<std::string>();
    const std::string source = json.at("source").get<std::string>();
    bool known = false;
    for (VersionSource s : {VersionSource::kDrop, VersionSource::kPush, VersionSource::kTrainer,
                            VersionSource::kPin}) {
      if (source == VersionSourceName(s)) row.source = s, known = true;
    }
    if (!known) return Status::Corruption("unknown source '" + source + "'");
    row.created_unix_ms = json.at("created_unix_ms").get<int64_t>();
    row.checkpoint_bytes = json.at("checkpoint_bytes").get<uint64_t>();
    row.keyframe_bytes = json.at("keyframe_bytes").get<uint64_t>();
    row.delta_bytes = json.at("delta_bytes").get<uint64_t>();
    row.uploaded_bytes = json.at("uploaded_bytes").get<uint64_t>();
    if (json.at("upload_kind").is_string()) row.upload_kind = json["upload_kind"].get<std::string>();
    row.metadata = json.at("metadata");
    const nlohmann::json& by = json.at("pushed_by");
    if (by.is_object()) {
      if (by.at("client").is_string()) row.pushed_by_client = by["client"].get<std::string>();
      if (by.at("peer").is_string()) row.pushed_by_peer = by["peer"].get<std::string>();
    }
    if (json.at("pinned_to").is_number_unsigned()) row.pinned_to = json["pinned_to"].get<uint64_t>();
    return row;
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("ledger row: ") + e.what());
  }
}

nlohmann::json ToJson(const std::optional<PinState>& pin) {
  if (!pin) return nullptr;
  return {{"pinned_to", pin->pinned_to},
          {"published_as", pin->published_as},
          {"since_unix_ms", pin->since_unix_ms}};
}

namespace {

constexpr int kLogFormat = 2;
// One record: a row carries at most the 1 MiB of metadata a push may send, and more.
constexpr size_t kMaxRecordBytes = size_t{16} << 20;

// A record as the log holds it: checksum, space, JSON, newline.
std::string RecordLine(const nlohmann::json& record) {
  const std::string text = record.dump();
  return Hex64(XXH3_64bits(text.data(), text.size())) + " " + text + "\n";
}

std::string_view AsText(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

nlohmann::json PinRecord(const std::optional<PinState>& pin, const nlohmann::json& event) {
  return {{"pin", ToJson(pin)}, {"event", event}};
}

Result<PinState> PinFromJson(const nlohmann::json& pin) {
  try {
    return PinState{pin.at("pinned_to").get<uint64_t>(), pin.at("published_as").get<uint64_t>(),
                    pin.at("since_unix_ms").get<int64_t>()};
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("field 'pin': ") + e.what());
  }
}

std::string SiblingPath(const std::string& path, const std::string& name) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? name : path.substr(0, slash + 1) + name;
}

}  // namespace

Status Ledger::Load(bool* torn) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<MappedRegion> mapped, env_->MapReadOnly(path_));
  const std::string_view text = AsText(mapped->bytes());
  const std::string where = "ledger " + path_;
  bool have_header = false;
  for (size_t at = 0; at < text.size();) {
    const size_t newline = text.find('\n', at);
    const std::string_view line =
        text.substr(at, newline == std::string_view::npos ? std::string_view::npos : newline - at);
    const bool last = newline == std::string_view::npos || newline + 1 == text.size();
    const std::string offset = std::to_string(at);
    bool intact = newline != std::string_view::npos && line.size() > 17 && line[16] == ' ';
    uint64_t checksum = 0;
    if (intact) {
      const auto [end, ec] = std::from_chars(line.data(), line.data() + 16, checksum, 16);
      const std::string_view json_text = line.substr(17);
      intact = ec == std::errc() && end == line.data() + 16 &&
               checksum == XXH3_64bits(json_text.data(), json_text.size());
    }
    if (!intact) {
      // Cut short or scrambled: a torn last append is dropped; anything earlier is damage.
      if (last) {
        *torn = true;
        break;
      }
      return Status::Corruption(where + ": the record at byte " + offset +
                                " is damaged (bad checksum or framing) and later records follow");
    }
    Result<nlohmann::json> record = ParseJson(line.substr(17), where + ": record at byte " + offset,
                                              JsonLimits{.max_bytes = kMaxRecordBytes});
    if (!record.ok()) return Status::Corruption(record.status().message());
    if (!record->is_object()) {
      return Status::Corruption(where + ": the record at byte " + offset + " is not an object");
    }
    if (!have_header) {
      if (!record->contains("format") || (*record)["format"] != kLogFormat) {
        return Status::Corruption(where + ": not a format 2 ledger log (first record " +
                                  record->dump().substr(0, 80) + ")");
      }
      have_header = true;
    } else if (record->contains("row")) {
      Result<LedgerRow> row = LedgerRowFromJson((*record)["row"]);
      if (!row.ok()) return row.status().WithContext(where + ": record at byte " + offset);
      if (!rows_.empty() && row->version <= rows_.back().version) {
        return Status::Corruption(where + ": record at byte " + offset + ": version " +
                                  std::to_string(row->version) + " is not above the last row's");
      }
      rows_.push_back(std::move(*row));
    } else if (record->contains("pin") && record->contains("event")) {
      const nlohmann::json& pin = (*record)["pin"];
      if (pin.is_null()) {
        pin_.reset();
      } else {
        Result<PinState> state = PinFromJson(pin);
        if (!state.ok()) return state.status().WithContext(where + ": record at byte " + offset);
        pin_ = *state;
      }
      if (!(*record)["event"].is_null()) events_.push_back((*record)["event"]);
    } else {
      return Status::Corruption(where + ": the record at byte " + offset +
                                " is neither a row nor a pin");
    }
    at = newline + 1;
  }
  if (!have_header && !*torn) {
    return Status::Corruption(where + ": empty, without its {\"format\": 2} record");
  }
  return Status::Ok();
}

Status Ledger::LoadFormat1(const std::string& path) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<MappedRegion> mapped, env_->MapReadOnly(path));
  const std::string where = "ledger " + path;
  Result<nlohmann::json> parsed =
      ParseJson(AsText(mapped->bytes()), where, JsonLimits{.max_bytes = mapped->bytes().size()});
  if (!parsed.ok()) return Status::Corruption(parsed.status().message());
  const nlohmann::json& json = *parsed;
  if (!json.is_object() || !json.contains("format") || json["format"] != 1 || !json.contains("rows") ||
      !json["rows"].is_array()) {
    return Status::Corruption(where + ": not a format 1 ledger (JSON object with 'rows')");
  }
  for (size_t i = 0; i < json["rows"].size(); ++i) {
    Result<LedgerRow> row = LedgerRowFromJson(json["rows"][i]);
    if (!row.ok()) return row.status().WithContext(where + ": row " + std::to_string(i));
    rows_.push_back(std::move(*row));
  }
  const nlohmann::json pin = json.value("pin", nlohmann::json(nullptr));
  if (pin.is_object()) {
    Result<PinState> state = PinFromJson(pin);
    if (!state.ok()) return state.status().WithContext(where);
    pin_ = *state;
  }
  events_ = json.value("events", nlohmann::json::array());
  if (!events_.is_array()) return Status::Corruption(where + ": field 'events' is not an array");
  return Status::Ok();
}

Result<std::unique_ptr<Ledger>> Ledger::Open(const std::string& path, Env* env) {
  std::unique_ptr<Ledger> ledger(new Ledger(path, env));
  const std::string format1 = SiblingPath(path, "ledger.json");
  std::lock_guard lock(ledger->mu_);
  if (env->FileExists(path)) {
    bool torn = false;
    FW_RETURN_IF_ERROR(ledger->Load(&torn));
    if (torn) {
      spdlog::warn("ledger {}: dropped a last record cut short by a crash (never acknowledged)",
                   path);
      FW_RETURN_IF_ERROR(ledger->RewriteLocked());
    }
  } else if (path != format1 && env->FileExists(format1)) {
    FW_RETURN_IF_ERROR(ledger->LoadFormat1(format1));
    FW_RETURN_IF_ERROR(ledger->RewriteLocked());
    spdlog::info("ledger: took over {} ({} rows) as {}", format1, ledger->rows_.size(), path);
  } else {
    FW_RETURN_IF_ERROR(ledger->RewriteLocked());
  }
  // The format 1 file is history once the log holds it (a crash before this line leaves
  // both: the log wins).
  if (path != format1 && env->FileExists(format1)) {
    FW_RETURN_IF_ERROR(env->RemoveFile(format1));
  }
  if (!ledger->log_) {
    FW_ASSIGN_OR_RETURN(ledger->log_, env->NewAppendableFile(path));
  }
  return ledger;
}

Status Ledger::RewriteLocked() {
  log_.reset();
  std::string text = RecordLine({{"format", kLogFormat}});
  for (const LedgerRow& row : rows_) text += RecordLine({{"row", ToJson(row)}});
  // Only the last record's pin counts on Load: every event record carries the pin now in
  // force, and a pin without events (never, after Load) gets an event-less record.
  for (const nlohmann::json& event : events_) text += RecordLine(PinRecord(pin_, event));
  if (events_.empty() && pin_) text += RecordLine(PinRecord(pin_, nullptr));
  FW_RETURN_IF_ERROR(WriteFileAtomically(path_, std::as_bytes(std::span(text.data(), text.size())), env_)
                         .WithContext("ledger " + path_));
  FW_ASSIGN_OR_RETURN(log_, env_->NewAppendableFile(path_));
  return Status::Ok();
}

Status Ledger::AppendLocked(const nlohmann::json& record) {
  if (!log_) FW_RETURN_IF_ERROR(RewriteLocked());
  const std::string line = RecordLine(record);
  Status status = log_->Append(std::as_bytes(std::span(line.data(), line.size())));
  if (status.ok()) status = log_->Sync();
  if (!status.ok()) log_.reset();  // part of the line may be there: rewrite before the next
  return status.WithContext("ledger " + path_);
}

Status Ledger::Record(LedgerRow row) {
  std::lock_guard lock(mu_);
  if (!rows_.empty() && row.version <= rows_.back().version) {
    return Status::InvalidArgument("ledger: version " + std::to_string(row.version) +
                                   " is not above the last row's " +
                                   std::to_string(rows_.back().version));
  }
  FW_RETURN_IF_ERROR(AppendLocked({{"row", ToJson(row)}}));
  rows_.push_back(std::move(row));
  return Status::Ok();
}

Status Ledger::SetPin(std::optional<PinState> pin) {
  std::lock_guard lock(mu_);
  nlohmann::json event = pin ? nlohmann::json{{"event", "pin"}, {"pin", ToJson(pin)}}
                             : nlohmann::json{{"event", "unpin"}, {"was", ToJson(pin_)}};
  event["at_unix_ms"] = env_->NowMicros() / 1000;
  FW_RETURN_IF_ERROR(AppendLocked(PinRecord(pin, event)));
  pin_ = pin;
  events_.push_back(std::move(event));
  return Status::Ok();
}

std::vector<LedgerRow> Ledger::Rows() const {
  std::lock_guard lock(mu_);
  return rows_;
}

std::optional<LedgerRow> Ledger::Row(uint64_t version) const {
  std::lock_guard lock(mu_);
  for (const LedgerRow& row : rows_) {
    if (row.version == version) return row;
  }
  return std::nullopt;
}

std::optional<PinState> Ledger::pin() const {
  std::lock_guard lock(mu_);
  return pin_;
}

nlohmann::json Ledger::EventsJson() const {
  std::lock_guard lock(mu_);
  return events_;
}

}  // namespace flywheel::sync
