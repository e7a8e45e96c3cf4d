// The publisher's version ledger: one row per published version (where it came from, when,
// its size on the wire, the client's metadata, who pushed it) and the pin state, kept in
// <state-dir>/ledger.json so it survives restarts.
//
// ledger.json (format 1), replaced atomically (temporary file, fsync, rename) on every
// change: {"format": 1, "rows": [<row>, ...], "pin": null | <pin>, "events": [<event>, ...]}
// with rows as ToJson(LedgerRow) writes them, oldest first. A ledger that is missing starts
// empty; one that does not parse fails Open (Corruption, naming the file and the field):
// the publisher does not start over a history it cannot read.
//
// Thread-safe.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "base/env.h"
#include "base/status.h"

namespace flywheel::sync {

enum class VersionSource { kDrop, kPush, kTrainer, kPin };
const char* VersionSourceName(VersionSource source);  // "drop", "push", "trainer", "pin"

struct LedgerRow {
  uint64_t version = 0;
  std::string weights_hash;  // Hash128::ToHex of the checkpoint hash
  VersionSource source = VersionSource::kTrainer;
  int64_t created_unix_ms = 0;
  uint64_t checkpoint_bytes = 0;  // tensor bytes of the full checkpoint
  uint64_t keyframe_bytes = 0;    // artifacts the publish wrote
  uint64_t delta_bytes = 0;
  uint64_t uploaded_bytes = 0;  // push only: the body received
  std::string upload_kind;      // push only: "full" or "delta"
  nlohmann::json metadata = nlohmann::json::object();
  std::string pushed_by_client;  // push only: what the client called itself
  std::string pushed_by_peer;    // push only: address:port it came from
  std::optional<uint64_t> pinned_to;  // pin only
};
nlohmann::json ToJson(const LedgerRow& row);
Result<LedgerRow> LedgerRowFromJson(const nlohmann::json& row);

struct PinState {
  uint64_t pinned_to = 0;
  uint64_t published_as = 0;
  int64_t since_unix_ms = 0;
};
nlohmann::json ToJson(const std::optional<PinState>& pin);

class Ledger {
 public:
  static Result<std::unique_ptr<Ledger>> Open(const std::string& path, Env* env = Env::Default());

  // Adds a row (versions only move forward: a row at or below the last is InvalidArgument).
  Status Record(LedgerRow row);
  // Sets or clears the pin, and records it as an event.
  Status SetPin(std::optional<PinState> pin);

  std::vector<LedgerRow> Rows() const;
  std::optional<LedgerRow> Row(uint64_t version) const;
  std::optional<PinState> pin() const;
  nlohmann::json EventsJson() const;  // pins and unpins, oldest first

 private:
  Ledger(std::string path, Env* env) : path_(std::move(path)), env_(env) {}
  Status SaveLocked() const;  // REQUIRES: mu_

  const std::string path_;
  Env* const env_;
  mutable std::mutex mu_;
  std::vector<LedgerRow> rows_;     // GUARDED_BY(mu_)
  std::optional<PinState> pin_;     // GUARDED_BY(mu_)
  nlohmann::json events_ = nlohmann::json::array();  // GUARDED_BY(mu_)
};

}  // namespace flywheel::sync
