// Resumable uploads staged on disk for the publisher's push API (docs/PUSH_API.md).
//
// An upload declares its size, files and digest up front; its bytes arrive as parts at
// offsets, in any order, repeated or overlapping (idempotent); Take() hands a complete,
// digest-verified upload to the committer. Layout under the staging directory:
//   <dir>/<id>/<file name>   one file per declared file (a delta upload has one, "delta"),
//                            allocated at Create (fallocate), written in place by parts
//   <dir>/<id>/.upload.json  the upload's id and spec, written durably (AtomicFile) at Create
//   <dir>/<id>/.ranges       one line per part written: "<begin> <end> <XXH3-64 hex>", synced
// Uploads survive a restart: Open takes over every upload an earlier process staged, with
// the ranges whose bytes still match their recorded digest (a range that does not, after a
// power cut or a tampered file, is dropped and reported missing again; a torn last record
// is ignored). What is not such an upload (a foreign name, a directory without its record,
// a record that does not parse, a file missing or of another size, a stray file inside an
// upload) is removed, each named in a warning and in recovery(). Every file operation goes
// through the Env given to Open; staged bytes are not fsynced (the digests say what made it;
// the commit copies them into the version log, which syncs what it acknowledges).
//
// Quotas: the declared size of one upload is at most max_upload_bytes, the declared sizes
// of all staged uploads at most quota_bytes (ResourceExhausted, before anything is
// written); the space is allocated at Create, so a full disk fails there (Unavailable)
// rather than half-way. A part is at most max_part_bytes.
//
// Parts stream: BeginPart checks a part's place, its pieces are written as they arrive
// (PartWriter::Write, positioned writes through the Env, hashed as they go), and Finish
// checks its length and the client's digest of it, records the range and acknowledges it. A
// part that ends any other way (Abort, a failed check, the client gone) is not recorded, and
// the bytes it reached count as missing again (they may have overwritten received ones), so
// the received ranges are always whole acknowledged parts whose bytes are on the disk.
//
// Status codes, as the HTTP layer maps them: InvalidArgument (bad spec, part outside the
// upload), NotFound (unknown id; WasExpired() tells an expired one apart), ResourceExhausted
// (a quota), Unavailable (the staging disk is full: the upload is removed), Mismatch (Take
// while bytes are missing, or a part while the upload is being committed), Corruption (the
// body does not match its digest: the upload is removed), IOError (anything else the OS
// refused).
//
// Thread-safe: every call may come from any thread. One lock guards the bookkeeping (which
// uploads exist, their received ranges, the quota); no disk I/O runs under it: a part's
// bytes are written, and an upload's files allocated, outside it, so one slow 64 MiB part
// holds up no other upload. While a part of an upload is being written, Take refuses it
// (Mismatch) and ExpireIdle skips it; a Remove meanwhile wins (the write answers NotFound).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/env.h"
#include "base/status.h"

namespace flywheel::sync {

enum class UploadKind { kFull, kDelta };
const char* UploadKindName(UploadKind kind);  // "full", "delta"

struct UploadFile {
  std::string name;  // a plain file name: no '/', not "." or "..", not hidden
  uint64_t size = 0;
};

// The digest of the whole body. xxh3_64: 16 lowercase hex digits of XXH3-64 (seed 0);
// sha256: 64 lowercase hex digits.
struct UploadDigest {
  std::string algorithm;
  std::string value;
};

// What POST /v1/uploads declares.
struct UploadSpec {
  std::optional<uint64_t> version;  // nullopt: "next"
  UploadKind kind = UploadKind::kFull;
  uint64_t base_version = 0;  // delta only
  std::vector<UploadFile> files;
  uint64_t size = 0;  // == the sum of the files' sizes
  UploadDigest digest;
  nlohmann::json metadata = nlohmann::json::object();
  std::string client;  // who the client says it is ("" if it did not say)
};

// Parses and checks a create request; InvalidArgument names the field that is wrong.
Result<UploadSpec> ParseUploadSpec(const nlohmann::json& body);
// The create request that ParseUploadSpec reads back as `spec`.
nlohmann::json ToJson(const UploadSpec& spec);
// "" when `again` declares the same body as `first` (size, digest, kind, base, version,
// files); else the first field that differs, with both values.
std::string SpecDifference(const UploadSpec& first, const UploadSpec& again);

struct UploadState {
  std::string id;
  UploadSpec spec;
  uint64_t received_bytes = 0;
  std::vector<std::pair<uint64_t, uint64_t>> missing;  // half-open byte ranges, ascending
  double expires_in_s = 0;
};
nlohmann::json ToJson(const UploadState& state);

// A complete, verified upload taken out of the store; its files stay on disk until
// UploadStore::Remove.
struct StagedUpload {
  std::string id;
  UploadSpec spec;
  std::string dir;
  // What to open: the delta file, dir/model.safetensors for a single file, else dir (a
  // sharded checkpoint with its index).
  std::string CheckpointPath() const;
};

struct UploadStoreOptions {
  std::string dir;  // created if missing; emptied at Open
  uint64_t quota_bytes = 128ull << 30;
  uint64_t max_upload_bytes = 64ull << 30;
  uint64_t max_part_bytes = 64ull << 20;
  std::chrono::milliseconds expiry{3600 * 1000};  // idle time after which an upload is removed
};

class UploadStore;

// One part of an upload being written piece by piece (UploadStore::BeginPart). Use from one
// thread at a time. While it is open the upload counts as busy (Take refuses it, ExpireIdle
// skips it).
class PartWriter {
 public:
  // Abort() unless Finish() ran.
  ~PartWriter();
  PartWriter(const PartWriter&) = delete;
  PartWriter& operator=(const PartWriter&) = delete;

  // Writes the next piece at offset() + written(). InvalidArgument when it would end past
  // the part's declared length or the upload's end, ResourceExhausted past max_part_bytes,
  // Unavailable when the staging disk is full (the upload is then removed), IOError. After
  // a failure the part is aborted.
  Status Write(std::span<const std::byte> piece);
  // Ends the part: InvalidArgument when fewer bytes than its declared length arrived,
  // Corruption when `expected_xxh3` (the client's XXH3-64 of the part) is given and the
  // bytes hash to another value (the part is dropped: its bytes count as missing); else
  // records the range (synced) and answers the upload's state. NotFound when the upload
  // was removed meanwhile.
  Result<UploadState> Finish(std::optional<uint64_t> expected_xxh3 = std::nullopt);
  // Drops the part (idempotent): nothing recorded, the bytes it reached count as missing.
  void Abort();

  uint64_t offset() const { return offset_; }
  uint64_t written() const { return written_; }

 private:
  friend class UploadStore;
  struct Impl;
  PartWriter(UploadStore* store, std::string id, uint64_t offset, uint64_t limit,
             std::optional<uint64_t> length, std::unique_ptr<Impl> impl);
  UploadStore* const store_;
  const std::string id_;
  const uint64_t offset_;
  const uint64_t limit_;  // most bytes the part may hold
  const std::optional<uint64_t> length_;
  uint64_t written_ = 0;
  bool open_ = true;
  std::unique_ptr<Impl> impl_;
};

class UploadStore {
 public:
  static Result<std::unique_ptr<UploadStore>> Open(UploadStoreOptions options,
                                                   Env* env = Env::Default());
  ~UploadStore();

  Result<UploadState> Create(UploadSpec spec);
  // Writes `bytes` at `offset` of the body (one part, whole: BeginPart, Write, Finish).
  Result<UploadState> Write(const std::string& id, uint64_t offset,
                            std::span<const std::byte> bytes);
  // Starts a part at `offset` of the body, of `length` bytes when the client declared it
  // (nullopt: up to max_part_bytes, or the upload's end). Checked at once: the upload
  // (NotFound, Mismatch while committed), the part inside the body (InvalidArgument), its
  // length (ResourceExhausted over max_part_bytes).
  Result<std::unique_ptr<PartWriter>> BeginPart(const std::string& id, uint64_t offset,
                                                std::optional<uint64_t> length);
  Result<UploadState> State(const std::string& id);
  // A client resuming upload `id` (after a restart of either side) declares its body
  // again: its state when the declaration is the same, Mismatch naming the field that
  // differs (size, digest, ...) otherwise, NotFound when the upload is not held.
  Result<UploadState> Resume(const std::string& id, const UploadSpec& again);
  // Checks that every byte arrived and the digest, and takes the upload out of the store
  // (no more parts). On a digest mismatch the upload is removed.
  Result<StagedUpload> Take(const std::string& id);
  // Removes an upload (staged or taken) and its files. NotFound when unknown.
  Status Remove(const std::string& id);
  // Removes uploads idle for longer than the expiry; returns how many.
  size_t ExpireIdle();
  bool WasExpired(const std::string& id) const;

  const UploadStoreOptions& options() const { return options_; }
  // What Open found and did about an earlier process's staging directory (one line each:
  // removed entries and dropped ranges), as also logged.
  std::vector<std::string> recovery() const;
  uint64_t staged_bytes() const;  // declared sizes of the uploads held

 private:
  // spec and dir are set before the upload is in uploads_ and never change: they are read
  // without the lock. The rest is GUARDED_BY(mu_).
  struct Upload {
    UploadSpec spec;
    std::string dir;
    std::map<uint64_t, uint64_t> received;  // begin -> end, disjoint, merged
    int64_t last_activity_us = 0;
    bool taken = false;
    int busy = 0;  // part writes (or Create's allocation) running outside the lock
    std::mutex record_mu;  // serializes appends to the upload's .ranges (not under mu_)
    bool ranges_dir_synced = false;  // GUARDED_BY(record_mu)
  };
  UploadStore(UploadStoreOptions options, Env* env) : options_(std::move(options)), env_(env) {}
  UploadState StateOf(const std::string& id, const Upload& upload) const;  // REQUIRES: mu_
  Result<std::shared_ptr<Upload>> Find(const std::string& id);              // REQUIRES: mu_
  void RemoveLocked(const std::string& id);                                  // REQUIRES: mu_
  uint64_t StagedBytesLocked() const;                                        // REQUIRES: mu_
  Status Recover();
  Result<std::shared_ptr<Upload>> RecoverUpload(const std::string& id, const std::string& dir);
  void RecoverRanges(Upload& upload, const std::vector<std::unique_ptr<MappedRegion>>& files);
  static void MergeRange(Upload& upload, uint64_t begin, uint64_t end);
  static void SubtractRange(Upload& upload, uint64_t begin, uint64_t end);
  Status RecordRange(Upload& upload, uint64_t begin, uint64_t end, uint64_t xxh3);
  // PartWriter's ends: the part [offset, offset + written) recorded, or dropped.
  Result<UploadState> EndPart(const std::shared_ptr<Upload>& upload, const std::string& id,
                              uint64_t offset, uint64_t written, uint64_t xxh3);
  void DropPart(const std::shared_ptr<Upload>& upload, const std::string& id, uint64_t offset,
                uint64_t written, bool remove_upload);
  friend class PartWriter;
  void Note(std::string note);

  const UploadStoreOptions options_;
  Env* const env_;
  mutable std::mutex mu_;
  // Shared so that a part write outside the lock keeps its upload alive through a Remove.
  std::map<std::string, std::shared_ptr<Upload>> uploads_;  // GUARDED_BY(mu_)
  std::set<std::string> expired_;          // GUARDED_BY(mu_)
  std::vector<std::string> recovery_;      // GUARDED_BY(mu_)
};

}  // namespace flywheel::sync
