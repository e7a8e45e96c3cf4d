#include "sync/ledger.h"

#include <ctime>

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

Result<std::unique_ptr<Ledger>> Ledger::Open(const std::string& path, Env* env) {
  std::unique_ptr<Ledger> ledger(new Ledger(path, env));
  if (!env->FileExists(path)) return ledger;
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, env->ReadFile(path));
  const std::string where = "ledger " + path;
  const nlohmann::json json = nlohmann::json::parse(
      reinterpret_cast<const char*>(bytes.data()),
      reinterpret_cast<const char*>(bytes.data()) + bytes.size(), nullptr, false);
  if (json.is_discarded() || !json.is_object() || json.value("format", 0) != 1 ||
      !json.contains("rows") || !json["rows"].is_array()) {
    return Status::Corruption(where + ": not a format 1 ledger (JSON object with 'rows')");
  }
  for (size_t i = 0; i < json["rows"].size(); ++i) {
    Result<LedgerRow> row = LedgerRowFromJson(json["rows"][i]);
    if (!row.ok()) return row.status().WithContext(where + ": row " + std::to_string(i));
    ledger->rows_.push_back(std::move(*row));
  }
  const nlohmann::json pin = json.value("pin", nlohmann::json(nullptr));
  if (pin.is_object()) {
    try {
      ledger->pin_ = PinState{pin.at("pinned_to").get<uint64_t>(),
                              pin.at("published_as").get<uint64_t>(),
                              pin.at("since_unix_ms").get<int64_t>()};
    } catch (const nlohmann::json::exception& e) {
      return Status::Corruption(where + ": field 'pin': " + e.what());
    }
  }
  ledger->events_ = json.value("events", nlohmann::json::array());
  return ledger;
}

Status Ledger::SaveLocked() const {
  nlohmann::json rows = nlohmann::json::array();
  for (const LedgerRow& row : rows_) rows.push_back(ToJson(row));
  const std::string text =
      nlohmann::json{{"format", 1}, {"rows", rows}, {"pin", ToJson(pin_)}, {"events", events_}}
          .dump() +
      "\n";
  return WriteFileAtomically(path_, std::as_bytes(std::span(text.data(), text.size())), env_)
      .WithContext("ledger " + path_);
}

Status Ledger::Record(LedgerRow row) {
  std::lock_guard lock(mu_);
  if (!rows_.empty() && row.version <= rows_.back().version) {
    return Status::InvalidArgument("ledger: version " + std::to_string(row.version) +
                                   " is not above the last row's " +
                                   std::to_string(rows_.back().version));
  }
  rows_.push_back(std::move(row));
  Status saved = SaveLocked();
  if (!saved.ok()) rows_.pop_back();
  return saved;
}

Status Ledger::SetPin(std::optional<PinState> pin) {
  std::lock_guard lock(mu_);
  const std::optional<PinState> before = pin_;
  pin_ = pin;
  nlohmann::json event = pin ? nlohmann::json{{"event", "pin"}, {"pin", ToJson(pin)}}
                             : nlohmann::json{{"event", "unpin"},
                                              {"was", ToJson(before)}};
  event["at_unix_ms"] = env_->NowMicros() / 1000;
  events_.push_back(event);
  Status saved = SaveLocked();
  if (!saved.ok()) {
    pin_ = before;
    events_.erase(events_.end() - 1);
  }
  return saved;
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
