// The publisher's version ledger: one row per published version (where it came from, when,
// its size on the wire, the client's metadata, who pushed it) and the pin state, kept in
// <state-dir>/ledger.log so it survives restarts.
//
// ledger.log (format 2) is append-only: a change appends one record and fsyncs it before
// it is acknowledged, so a change costs the bytes of that change (a row's metadata, up to
// the 1 MiB a push may carry, is written once, never again). Records are lines:
//
//   <16 lowercase hex digits: XXH3-64 of the JSON text> ' ' <JSON text, one line> '\n'
//
// The first record is {"format": 2}; each later one is either
//   {"row": <row>}                              a version recorded (ToJson(LedgerRow)), or
//   {"pin": null | <pin>, "event": <event>}     the pin in force from here on, and the pin or
//                                               unpin event that set it (null: none).
// Rows are never dropped and the pin is one record, so the log needs no compaction: Open
// rewrites it (atomically: temporary file, fsync, rename) only to cut a torn tail or to
// take over a format 1 ledger.json.
//
// Recovery (Open): a missing log starts empty. A last record that is cut short or fails its
// checksum is an append interrupted by a crash, never acknowledged: it is dropped (and the
// log rewritten without it). A bad record with good ones after it, or one that does not
// parse, fails Open (Corruption, naming the file and the byte offset): the publisher does
// not start over a history it cannot read. A failed append leaves the change undone in
// memory, and the next change first rewrites the whole log from memory.
//
// Format 1, <state-dir>/ledger.json ({"format": 1, "rows": [...], "pin": ..., "events":
// [...]}, rewritten whole on every change), is read once when no ledger.log exists beside
// it, written out as a ledger.log, and removed.
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
  // `path`: the log, <state-dir>/ledger.log.
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
  // Reads the log's records; sets *torn when the last one was cut short.
  Status Load(bool* torn);
  // Takes over a format 1 ledger.json.
  Status LoadFormat1(const std::string& path);
  // Writes the whole state as a new log (atomically) and reopens it for appending.
  Status RewriteLocked();  // REQUIRES: mu_
  // Appends one record and fsyncs it; after a failure the next call rewrites the log.
  Status AppendLocked(const nlohmann::json& record);  // REQUIRES: mu_

  const std::string path_;
  Env* const env_;
  mutable std::mutex mu_;
  std::vector<LedgerRow> rows_;     // GUARDED_BY(mu_)
  std::optional<PinState> pin_;     // GUARDED_BY(mu_)
  nlohmann::json events_ = nlohmann::json::array();  // GUARDED_BY(mu_)
  std::unique_ptr<WritableFile> log_;  // GUARDED_BY(mu_); null: rewrite before appending
};

}  // namespace flywheel::sync
