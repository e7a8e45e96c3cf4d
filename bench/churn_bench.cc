#include "bench/churn_bench.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <thread>

#include "base/env.h"
#include "bench/checkpoint_gen.h"
#include "bench/util.h"
#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "ops/process.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using SteadyClock = std::chrono::steady_clock;
using ops::ProcessGroup;

constexpr const char* kLoopbackAny = "127.0.0.1:0";
constexpr std::chrono::milliseconds kReadyTimeout{60000};
// The poller: a worker with a publish or its restart pending is asked every kPollEvery,
// every other one every kCheckEvery (its hash is checked then). Swap times come from the
// workers' swap_unix_us, so the polling rate bounds the poller's CPU, not the precision.
constexpr std::chrono::milliseconds kPollEvery{250};
constexpr std::chrono::milliseconds kCheckEvery{2000};
constexpr std::chrono::milliseconds kForgetTimeout{5000};

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// Nearest-rank percentile (q in [0, 1]); 0 when empty.
double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, rank == 0 ? 0 : rank - 1)];
}

double Max(const std::vector<double>& values) {
  return values.empty() ? 0 : *std::max_element(values.begin(), values.end());
}

// ---- versions ------------------------------------------------------------------------

struct StagedVersion {
  uint64_t version = 0;
  std::string model_path;
  std::string weights_hash;  // CheckpointHash, hex: what a worker serving it reports
};

Result<std::vector<StagedVersion>> StageVersions(const ChurnBenchOptions& options,
                                                 const std::string& dir) {
  GeneratorOptions generator;
  generator.checkpoint_bytes = options.checkpoint_bytes;
  generator.adamw.learning_rate = options.learning_rate;
  generator.seed = options.seed;
  generator.threads = options.threads;
  std::vector<StagedVersion> staged;
  Status status = GenerateCheckpointSequence(
      generator, options.publishes + 1, [&](int step, const CheckpointView& view) -> Status {
        StagedVersion entry;
        entry.version = static_cast<uint64_t>(step);
        FW_ASSIGN_OR_RETURN(const Hash128 hash, CheckpointHash(view, options.threads));
        entry.weights_hash = hash.ToHex();
        const std::string version_dir = dir + "/" + std::to_string(step);
        FW_RETURN_IF_ERROR(Env::Default()->CreateDirs(version_dir));
        entry.model_path = version_dir + "/model.safetensors";
        FW_RETURN_IF_ERROR(WriteSafetensors(entry.model_path, view, {{"format", "pt"}}));
        staged.push_back(std::move(entry));
        return Status::Ok();
      });
  FW_RETURN_IF_ERROR(status);
  return staged;
}

// <watch>/<version>/model.safetensors (a hard link to the staged file), then COMMIT.
// Returns the commit time (Unix microseconds).
Result<int64_t> DropVersion(const StagedVersion& staged, const std::string& watch_dir) {
  const std::string version_dir = watch_dir + "/" + std::to_string(staged.version);
  FW_RETURN_IF_ERROR(Env::Default()->CreateDirs(version_dir));
  std::error_code error;
  fs::create_hard_link(staged.model_path, version_dir + "/model.safetensors", error);
  if (error) return Status::IOError("cannot link " + staged.model_path + ": " + error.message());
  FW_ASSIGN_OR_RETURN(auto commit,
                      Env::Default()->NewWritableFile(version_dir + "/COMMIT",
                                                      Env::OpenMode::kCreateNew));
  FW_RETURN_IF_ERROR(commit->Close());
  return UnixMicrosNow();
}

// ---- status requests -----------------------------------------------------------------

Result<Json> GetStatus(const transport::Endpoint& http, const std::string& name) {
  transport::HttpGetOptions get;
  get.timeout = std::chrono::milliseconds(3000);
  Result<transport::HttpResponse> response = transport::HttpGet(http, "/v1/status", get);
  const std::string where = name + " GET /v1/status";
  if (!response.ok()) return response.status().WithContext(where);
  if (response->status != 200) {
    return Status::Unavailable(where + ": HTTP " + std::to_string(response->status));
  }
  Json json = Json::parse(response->body, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) return Status::Corruption(where + ": not a JSON object");
  return json;
}

// What the benchmark reads of a worker's status.
struct WorkerPoll {
  uint64_t version = 0;
  std::string weights_hash;
  int64_t swap_unix_us = 0;
  std::string state;
  double last_apply_ms = 0;
  double last_swap_ms = 0;  // from the head's first announcement to the swap
  int64_t polled_unix_us = 0;
  Json join;  // the worker's join timeline (sync/worker.h), an object
};

std::optional<WorkerPoll> PollWorker(const transport::Endpoint& http, const std::string& name) {
  Result<Json> json = GetStatus(http, name);
  if (!json.ok()) return std::nullopt;
  WorkerPoll poll;
  try {
    poll.version = json->value("version", uint64_t{0});
    poll.weights_hash = json->value("weights_hash", std::string());
    poll.swap_unix_us = json->value("swap_unix_us", int64_t{0});
    poll.state = json->value("state", std::string());
    poll.last_apply_ms = json->value("last_apply_ms", 0.0);
    poll.last_swap_ms = json->value("last_swap_ms", 0.0);
    poll.join = json->value("join", Json::object());
  } catch (const Json::exception&) {
    return std::nullopt;
  }
  poll.polled_unix_us = UnixMicrosNow();
  return poll;
}

// Runs fn(i) for i in [0, count) on `threads` threads.
void RunParallel(size_t count, int threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  const size_t n = std::min<size_t>(count, static_cast<size_t>(std::max(1, threads)));
  for (size_t t = 0; t < n; ++t) {
    pool.emplace_back([&] {
      for (size_t i = next++; i < count; i = next++) fn(i);
    });
  }
  for (std::thread& thread : pool) thread.join();
}

// utime + stime (seconds), RSS and open descriptors of a process, from /proc.
struct ProcessUsage {
  double cpu_seconds = 0;
  uint64_t rss_bytes = 0;
  uint64_t fds = 0;
  uint64_t cache_bytes = 0;  // a relay's, from its status (SampleRelays)
};

ProcessUsage UsageOf(pid_t pid) {
  ProcessUsage usage;
  const std::string proc = "/proc/" + std::to_string(pid);
  if (Result<std::string> stat = ops::ReadWholeFile(proc + "/stat"); stat.ok()) {
    // Fields after the command (which may hold spaces) start after the last ')'.
    std::istringstream fields(stat->substr(stat->rfind(')') + 2));
    std::string field;
    uint64_t utime = 0, stime = 0;
    for (int i = 3; i <= 15 && fields >> field; ++i) {
      if (i == 14) utime = std::stoull(field);
      if (i == 15) stime = std::stoull(field);
    }
    usage.cpu_seconds = static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }
  if (Result<std::string> status = ops::ReadWholeFile(proc + "/status"); status.ok()) {
    const size_t at = status->find("VmRSS:");
    if (at != std::string::npos) usage.rss_bytes = std::stoull(status->substr(at + 6)) * 1024;
  }
  std::error_code error;
  for (auto it = fs::directory_iterator(proc + "/fd", error); !error && it != fs::directory_iterator();
       it.increment(error)) {
    ++usage.fds;
  }
  return usage;
}

// CPU seconds this machine spent busy (all CPUs; /proc/stat), and this process's own.
double MachineBusySeconds() {
  Result<std::string> stat = ops::ReadWholeFile("/proc/stat");
  if (!stat.ok()) return 0;
  std::istringstream fields(stat->substr(0, stat->find('\n')));
  std::string label;
  fields >> label;
  uint64_t total = 0, idle = 0, value = 0;
  for (int i = 0; fields >> value; ++i) {
    total += i < 8 ? value : 0;  // user nice system idle iowait irq softirq steal
    if (i == 3 || i == 4) idle += value;
  }
  return static_cast<double>(total - idle) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double SelfCpuSeconds() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// Where the CPU went during the churn phase (ChurnRun::SampleCpu).
struct CpuBudget {
  double machine = 0, self = 0, publisher = 0, relays = 0, workers = 0;
};

// ---- the fleet -----------------------------------------------------------------------

struct Role {
  std::string name;
  size_t process = 0;
  transport::Endpoint listen;
  transport::Endpoint http;
};

// A worker slot: one node id, started again after every kill.
struct Slot {
  std::string name;  // also its node id
  size_t relay = 0;
  size_t process = 0;
  int generation = 0;  // starts so far
  std::string ready_file;
  std::optional<transport::Endpoint> http;  // once its ready file is read
  bool running = false;
  int64_t start_unix_us = 0;
  SteadyClock::time_point started;
  // A restarted worker: the head when it started, and whether it served it yet.
  uint64_t head_at_start = 0;
  bool head_served = true;
  uint64_t version = 0;  // as last polled
  SteadyClock::time_point polled;
  double cpu_seconds = 0;  // of its earlier processes in the churn phase (see SampleCpu)
};

// One measured publish: who was serving when it was committed, and when each served it.
struct PublishRecord {
  uint64_t version = 0;
  int64_t commit_unix_us = 0;
  SteadyClock::time_point committed;
  std::set<size_t> pending;  // slots of the cohort yet to serve it
  size_t cohort = 0;
  size_t excluded = 0;  // killed before serving it
  std::vector<double> seconds;
  std::vector<double> apply_ms;
  std::vector<double> announce_to_swap_ms;
};

struct Victim {
  size_t slot = 0;
  bool sigterm = false;
  SteadyClock::time_point signalled;
  bool said_leaving = false;
  double forget_ms = -1;
};

// A restarted worker's way to the head, step by step (seconds; from its "join" status and
// the time this benchmark started its process).
struct JoinSample {
  double process_start = 0;  // exec -> status endpoint up
  double subscribe = 0;      // -> the first catalog (connect, subscribe)
  double to_keyframe = 0;    // -> the keyframe's fetch begins (plan, waits)
  double keyframe_fetch = 0;  // its bytes (decoded and verified while they arrive)
  double keyframe_apply = 0;  // last piece -> swapped in
  double chain = 0;           // the deltas after it, fetched and applied
  double total = 0;           // start -> serving the head the join reached
  double deltas = 0;
  double cpu_seconds = 0;  // the worker's CPU by then
};

// The sample of a join that reached the head, if its timeline is whole.
std::optional<JoinSample> SampleJoin(const Json& join, int64_t start_unix_us) {
  auto at = [&](const char* key) { return join.value(key, int64_t{0}); };
  const int64_t http = at("started_unix_us"), catalog = at("first_catalog_unix_us");
  const int64_t fetch = at("keyframe_fetch_unix_us"), fetched = at("keyframe_fetched_unix_us");
  const int64_t keyframe = at("keyframe_served_unix_us"), done = at("done_unix_us");
  if (http == 0 || catalog == 0 || fetch == 0 || keyframe == 0 || done == 0) return std::nullopt;
  auto seconds = [](int64_t from, int64_t to) { return static_cast<double>(to - from) / 1e6; };
  JoinSample sample;
  sample.process_start = seconds(start_unix_us, http);
  sample.subscribe = seconds(http, catalog);
  sample.to_keyframe = seconds(catalog, fetch);
  sample.keyframe_fetch = seconds(fetch, fetched);
  sample.keyframe_apply = seconds(fetched, keyframe);
  sample.chain = seconds(keyframe, done);
  sample.total = seconds(start_unix_us, done);
  sample.deltas = join.value("deltas", 0.0);
  sample.cpu_seconds = join.value("cpu_seconds", 0.0);
  return sample;
}

class ChurnRun {
 public:
  ChurnRun(const ChurnBenchOptions& options, std::string flywheel, std::string dir)
      : options_(options),
        flywheel_(std::move(flywheel)),
        dir_(std::move(dir)),
        processes_(dir_ + "/logs"),
        random_(options.seed) {}

  Status Start();
  Status Run();
  ChurnBenchResult Figures(uint64_t nofile_limit);
  void Print(const ChurnBenchResult& result, std::ostream& out) const;
  Json ToJson(const ChurnBenchResult& result) const;
  Json JoinsJson() const;

 private:
  Status Launch(const std::string& name, const std::string& role, std::vector<std::string> args,
                size_t* process);
  Result<Json> AwaitReady(const std::string& ready_file, const std::string& name, size_t process);
  Status StartRelays();
  Status StartWorker(size_t index);
  Status CheckReadyFiles();
  Status Sweep();
  void TakePoll(size_t index, const WorkerPoll& poll);
  Status Publish(size_t staged_index);
  Status Churn();
  void SignalVictims(std::vector<Victim>& victims);
  Status AwaitForgotten(std::vector<Victim>& victims);
  Status ReapAndRestart(std::vector<Victim>& victims);
  Status CheckGiveUp() const;
  Status CheckRoles();
  bool Settled() const;
  std::vector<size_t> LiveSlots() const;
  void SampleRelays(std::vector<ProcessUsage>& into);
  // At the start of the churn phase (sign -1) and at its end (+1): the CPU of every role,
  // the machine's and this process's. A killed worker's CPU is added before the kill.
  void SampleCpu(double sign);

  const ChurnBenchOptions& options_;
  std::string flywheel_;
  std::string dir_;
  ProcessGroup processes_;
  std::mt19937_64 random_;
  std::vector<StagedVersion> staged_;
  std::map<uint64_t, std::string> published_;  // version -> weights hash, once dropped
  uint64_t head_ = 0;
  Role publisher_;
  std::vector<Role> relays_;
  std::vector<Slot> slots_;
  std::vector<PublishRecord> publishes_;
  std::vector<Victim> victims_;         // every one of the run
  std::vector<double> restart_seconds_;  // start -> serving the head
  std::vector<JoinSample> joins_;        // of those, the ones with a whole timeline
  uint64_t foreign_ = 0;
  std::string first_foreign_;
  std::vector<ProcessUsage> relays_before_, relays_after_;
  SteadyClock::time_point churn_start_, churn_end_;
  uint64_t relay_fds_max_ = 0;
  uint64_t relay_cache_bytes_max_ = 0;
  uint64_t unclean_exits_ = 0;
  CpuBudget cpu_;
};

Status ChurnRun::Launch(const std::string& name, const std::string& role,
                        std::vector<std::string> args, size_t* process) {
  args.insert(args.begin(), role);
  FW_ASSIGN_OR_RETURN(*process, processes_.Start(name, flywheel_, args));
  return Status::Ok();
}

Result<Json> ChurnRun::AwaitReady(const std::string& ready_file, const std::string& name,
                                  size_t process) {
  return ops::AwaitReadyFile(processes_, ready_file, name, kReadyTimeout, process);
}

Result<transport::Endpoint> EndpointOf(const Json& ready, const char* key, const std::string& name) {
  if (!ready.contains(key) || !ready[key].is_string()) {
    return Status::Corruption(name + "'s ready file has no \"" + key + "\": " + ready.dump());
  }
  return transport::ParseEndpoint(ready[key].get<std::string>());
}

Status ChurnRun::Start() {
  FW_ASSIGN_OR_RETURN(staged_, StageVersions(options_, dir_ + "/staged"));
  FW_RETURN_IF_ERROR(Env::Default()->CreateDirs(dir_ + "/watch"));
  FW_RETURN_IF_ERROR(Env::Default()->CreateDirs(dir_ + "/ready"));
  publisher_.name = "publisher";
  const std::string ready = dir_ + "/ready/publisher.json";
  std::vector<std::string> args = {"--listen", kLoopbackAny, "--http", kLoopbackAny, "--state-dir",
                                   dir_ + "/publisher", "--watch", dir_ + "/watch", "--poll-ms", "20",
                                   "--region", "home", "--ready-file", ready};
  if (options_.keyframe_every != 0) {
    args.insert(args.end(), {"--keyframe-every", std::to_string(options_.keyframe_every)});
  }
  FW_RETURN_IF_ERROR(Launch("publisher", "publish", std::move(args), &publisher_.process));
  FW_ASSIGN_OR_RETURN(Json json, AwaitReady(ready, "publisher", publisher_.process));
  FW_ASSIGN_OR_RETURN(publisher_.listen, EndpointOf(json, "listen", "publisher"));
  FW_ASSIGN_OR_RETURN(publisher_.http, EndpointOf(json, "http", "publisher"));
  FW_RETURN_IF_ERROR(StartRelays());
  slots_.resize(static_cast<size_t>(options_.workers));
  for (size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].name = "churn-worker-" + std::to_string(i + 1);
    slots_[i].relay = i % relays_.size();
    FW_RETURN_IF_ERROR(StartWorker(i));
  }
  std::cerr << "[churn bench] started a publisher, " << relays_.size() << " relays and "
            << slots_.size() << " workers\n";
  return Status::Ok();
}

Status ChurnRun::StartRelays() {
  relays_.resize(static_cast<size_t>(options_.relays));
  for (size_t r = 0; r < relays_.size(); ++r) {
    Role& relay = relays_[r];
    relay.name = "relay-" + std::to_string(r + 1);
    FW_RETURN_IF_ERROR(Launch(relay.name, "relay",
                              {"--region", "r" + std::to_string(r + 1), "--upstream",
                               publisher_.listen.ToString(), "--listen", kLoopbackAny, "--http",
                               kLoopbackAny, "--ready-file", dir_ + "/ready/" + relay.name + ".json"},
                              &relay.process));
  }
  for (Role& relay : relays_) {
    FW_ASSIGN_OR_RETURN(Json json, AwaitReady(dir_ + "/ready/" + relay.name + ".json", relay.name,
                                              relay.process));
    FW_ASSIGN_OR_RETURN(relay.listen, EndpointOf(json, "listen", relay.name));
    FW_ASSIGN_OR_RETURN(relay.http, EndpointOf(json, "http", relay.name));
  }
  return Status::Ok();
}

// Starts (or starts again) a slot's worker; its ready file is read by CheckReadyFiles.
Status ChurnRun::StartWorker(size_t index) {
  Slot& slot = slots_[index];
  slot.ready_file = dir_ + "/ready/" + slot.name + "." + std::to_string(slot.generation) + ".json";
  ++slot.generation;
  slot.http.reset();
  slot.version = 0;
  const Role& relay = relays_[slot.relay];
  FW_RETURN_IF_ERROR(Launch(slot.name, "worker",
                            {"--region", "r" + std::to_string(slot.relay + 1), "--upstream",
                             relay.listen.ToString(), "--http", kLoopbackAny, "--node-id",
                             slot.name, "--ready-file", slot.ready_file},
                            &slot.process));
  slot.running = true;
  slot.start_unix_us = UnixMicrosNow();
  slot.started = SteadyClock::now();
  return Status::Ok();
}

Status ChurnRun::CheckReadyFiles() {
  for (Slot& slot : slots_) {
    if (!slot.running || slot.http) continue;
    if (!Env::Default()->FileExists(slot.ready_file)) {
      if (SecondsSince(slot.started) > kReadyTimeout.count() / 1000.0) {
        return Status::Unavailable(slot.name + " wrote no ready file within " +
                                   std::to_string(kReadyTimeout.count()) + " ms");
      }
      continue;
    }
    FW_ASSIGN_OR_RETURN(const std::string text, ops::ReadWholeFile(slot.ready_file));
    const Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    FW_ASSIGN_OR_RETURN(slot.http, EndpointOf(json, "http", slot.name));
  }
  return Status::Ok();
}

std::vector<size_t> ChurnRun::LiveSlots() const {
  std::vector<size_t> live;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].running && slots_[i].http) live.push_back(i);
  }
  return live;
}

// Polls every started worker once (concurrently) and takes what they say.
Status ChurnRun::Sweep() {
  FW_RETURN_IF_ERROR(CheckReadyFiles());
  std::vector<size_t> live;
  const auto now = SteadyClock::now();
  for (size_t i : LiveSlots()) {
    const bool pending = !slots_[i].head_served ||
                         std::any_of(publishes_.begin(), publishes_.end(),
                                     [&](const PublishRecord& r) { return r.pending.count(i) > 0; });
    if (pending || now - slots_[i].polled >= kCheckEvery) live.push_back(i);
  }
  std::vector<std::optional<WorkerPoll>> polls(live.size());
  RunParallel(live.size(), options_.poll_threads, [&](size_t i) {
    polls[i] = PollWorker(*slots_[live[i]].http, slots_[live[i]].name);
  });
  for (size_t i = 0; i < live.size(); ++i) {
    if (polls[i]) TakePoll(live[i], *polls[i]);
  }
  return Status::Ok();
}

void ChurnRun::TakePoll(size_t index, const WorkerPoll& poll) {
  Slot& slot = slots_[index];
  slot.version = poll.version;
  slot.polled = SteadyClock::now();
  if (!poll.weights_hash.empty()) {
    auto published = published_.find(poll.version);
    if (published == published_.end() || published->second != poll.weights_hash) {
      if (foreign_++ == 0) {
        first_foreign_ = slot.name + " reported v" + std::to_string(poll.version) + " with hash " +
                         poll.weights_hash;
      }
    }
  }
  for (PublishRecord& record : publishes_) {
    if (!record.pending.count(index) || poll.version < record.version) continue;
    // The exact swap time when this poll still shows that version, else the poll's.
    const int64_t served_us = poll.version == record.version ? poll.swap_unix_us : poll.polled_unix_us;
    record.seconds.push_back(static_cast<double>(served_us - record.commit_unix_us) / 1e6);
    if (poll.version == record.version) {
      record.apply_ms.push_back(poll.last_apply_ms);
      record.announce_to_swap_ms.push_back(poll.last_swap_ms);
    }
    record.pending.erase(index);
  }
  if (!slot.head_served && poll.version >= slot.head_at_start) {
    slot.head_served = true;
    restart_seconds_.push_back(static_cast<double>(poll.swap_unix_us - slot.start_unix_us) / 1e6);
    if (std::optional<JoinSample> join = SampleJoin(poll.join, slot.start_unix_us)) joins_.push_back(*join);
  }
}

Status ChurnRun::Publish(size_t staged_index) {
  const StagedVersion& staged = staged_[staged_index];
  published_[staged.version] = staged.weights_hash;
  PublishRecord record;
  record.version = staged.version;
  // The cohort: every worker up that served the head it started under (one still behind
  // an earlier publish is in it too: its time runs from this commit all the same).
  for (size_t i : LiveSlots()) {
    if (slots_[i].head_served) record.pending.insert(i);
  }
  record.cohort = record.pending.size();
  FW_ASSIGN_OR_RETURN(record.commit_unix_us, DropVersion(staged, dir_ + "/watch"));
  record.committed = SteadyClock::now();
  head_ = staged.version;
  publishes_.push_back(std::move(record));
  std::cerr << "[churn bench] published v" << staged.version << " to a cohort of "
            << publishes_.back().cohort << " workers\n";
  return Status::Ok();
}


// Signals every victim at once (SIGTERM ones also asked for their status right after) and
// drops them from the publishes they had not served yet.
void ChurnRun::SignalVictims(std::vector<Victim>& victims) {
  for (Victim& victim : victims) {
    for (PublishRecord& record : publishes_) {
      if (record.pending.erase(victim.slot)) ++record.excluded;
    }
  }
  RunParallel(victims.size(), options_.poll_threads, [&](size_t i) {
    Victim& victim = victims[i];
    const Slot& slot = slots_[victim.slot];
    victim.signalled = SteadyClock::now();
    ::kill(processes_.pid(slot.process), victim.sigterm ? SIGTERM : SIGKILL);
    if (!victim.sigterm) return;
    std::optional<WorkerPoll> poll = PollWorker(*slot.http, slot.name);
    victim.said_leaving = poll && poll->state == "leaving";
  });
}

// Polls the victims' relays until none lists them; each victim's time from its signal.
Status ChurnRun::AwaitForgotten(std::vector<Victim>& victims) {
  const SteadyClock::time_point deadline = SteadyClock::now() + kForgetTimeout;
  size_t left = victims.size();
  while (left > 0) {
    std::vector<std::set<std::string>> listed(relays_.size());
    std::vector<Status> errors(relays_.size());
    RunParallel(relays_.size(), static_cast<int>(relays_.size()), [&](size_t r) {
      Result<Json> json = GetStatus(relays_[r].http, relays_[r].name);
      if (!json.ok()) {
        errors[r] = json.status();
        return;
      }
      for (const Json& node : json->value("nodes", Json::array())) {
        listed[r].insert(node.value("node_id", std::string()));
      }
    });
    for (const Status& error : errors) FW_RETURN_IF_ERROR(error);
    const auto now = SteadyClock::now();
    for (Victim& victim : victims) {
      const Slot& slot = slots_[victim.slot];
      if (victim.forget_ms >= 0 || listed[slot.relay].count(slot.name)) continue;
      victim.forget_ms = std::chrono::duration<double, std::milli>(now - victim.signalled).count();
      --left;
    }
    if (left > 0 && now > deadline) {
      return Status::Unavailable(std::to_string(left) + " killed worker(s) still listed by their relay " +
                                 std::to_string(kForgetTimeout.count()) + " ms after the signal");
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return Status::Ok();
}

// Reaps the victims (a SIGTERMed one must exit cleanly) and starts each again.
Status ChurnRun::ReapAndRestart(std::vector<Victim>& victims) {
  for (Victim& victim : victims) {
    Slot& slot = slots_[victim.slot];
    Result<int> wait_status = processes_.Wait(slot.process, std::chrono::milliseconds(5000));
    if (!wait_status.ok()) {
      processes_.Kill(slot.process);
      wait_status = SIGKILL;  // as a wait status: killed by SIGKILL
    }
    const int status = *wait_status;
    const bool clean = (WIFEXITED(status) && WEXITSTATUS(status) == 0) ||
                       (WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
    if (victim.sigterm && !clean) {
      ++unclean_exits_;
      std::cerr << "[churn bench] " << slot.name << " after SIGTERM "
                << ops::DescribeWaitStatus(status) << "\n";
    }
    slot.running = false;
    FW_RETURN_IF_ERROR(StartWorker(victim.slot));
    slot.head_at_start = head_;
    slot.head_served = false;
  }
  return Status::Ok();
}

Status ChurnRun::Churn() {
  std::vector<size_t> live;
  for (size_t i : LiveSlots()) {
    if (slots_[i].head_served) live.push_back(i);
  }
  std::shuffle(live.begin(), live.end(), random_);
  const size_t count = std::min(
      live.size(), static_cast<size_t>(std::llround(options_.churn_percent / 100.0 * slots_.size())));
  std::vector<Victim> victims;
  for (size_t i = 0; i < count; ++i) {
    Victim victim;
    victim.slot = live[i];
    victim.sigterm = (victims_.size() + i) % 2 == 0;
    victims.push_back(victim);
  }
  for (const Victim& victim : victims) {
    cpu_.workers += UsageOf(processes_.pid(slots_[victim.slot].process)).cpu_seconds;
  }
  SignalVictims(victims);
  FW_RETURN_IF_ERROR(AwaitForgotten(victims));
  FW_RETURN_IF_ERROR(ReapAndRestart(victims));
  std::cerr << "[churn bench] killed and restarted " << victims.size() << " workers\n";
  victims_.insert(victims_.end(), victims.begin(), victims.end());
  return Status::Ok();
}

Status ChurnRun::CheckRoles() {
  FW_RETURN_IF_ERROR(processes_.CheckRunning(publisher_.process));
  for (const Role& relay : relays_) FW_RETURN_IF_ERROR(processes_.CheckRunning(relay.process));
  for (const Slot& slot : slots_) {
    if (slot.running) FW_RETURN_IF_ERROR(processes_.CheckRunning(slot.process));
  }
  return Status::Ok();
}

Status ChurnRun::CheckGiveUp() const {
  for (const PublishRecord& record : publishes_) {
    if (!record.pending.empty() && SecondsSince(record.committed) > options_.give_up_seconds) {
      return Status::Unavailable(std::to_string(record.pending.size()) + " worker(s), e.g. " +
                                 slots_[*record.pending.begin()].name + ", never served v" +
                                 std::to_string(record.version));
    }
  }
  for (const Slot& slot : slots_) {
    if (slot.running && !slot.head_served && SecondsSince(slot.started) > options_.give_up_seconds) {
      return Status::Unavailable("restarted " + slot.name + " never served v" +
                                 std::to_string(slot.head_at_start));
    }
  }
  return Status::Ok();
}

bool ChurnRun::Settled() const {
  for (const PublishRecord& record : publishes_) {
    if (!record.pending.empty()) return false;
  }
  for (const Slot& slot : slots_) {
    if (slot.running && (!slot.head_served || !slot.http || slot.version != head_)) return false;
  }
  return true;
}

void ChurnRun::SampleCpu(double sign) {
  cpu_.machine += sign * MachineBusySeconds();
  cpu_.self += sign * SelfCpuSeconds();
  cpu_.publisher += sign * UsageOf(processes_.pid(publisher_.process)).cpu_seconds;
  for (const Role& relay : relays_) cpu_.relays += sign * UsageOf(processes_.pid(relay.process)).cpu_seconds;
  for (const Slot& slot : slots_) {
    if (slot.running) cpu_.workers += sign * UsageOf(processes_.pid(slot.process)).cpu_seconds;
  }
}

void ChurnRun::SampleRelays(std::vector<ProcessUsage>& into) {
  into.clear();
  for (const Role& relay : relays_) {
    into.push_back(UsageOf(processes_.pid(relay.process)));
    relay_fds_max_ = std::max(relay_fds_max_, into.back().fds);
    if (Result<Json> status = GetStatus(relay.http, relay.name); status.ok()) {
      into.back().cache_bytes = status->value("cache_bytes", uint64_t{0});
      relay_cache_bytes_max_ = std::max(relay_cache_bytes_max_, into.back().cache_bytes);
    }
  }
}

Status ChurnRun::Run() {
  // The initial version: every worker joins with a keyframe; not measured.
  published_[staged_[0].version] = staged_[0].weights_hash;
  FW_RETURN_IF_ERROR(DropVersion(staged_[0], dir_ + "/watch").status());
  head_ = staged_[0].version;
  const SteadyClock::time_point join_start = SteadyClock::now();
  while (!Settled()) {
    FW_RETURN_IF_ERROR(CheckRoles());
    FW_RETURN_IF_ERROR(Sweep());
    if (SecondsSince(join_start) > options_.give_up_seconds) {
      return Status::Unavailable("the workers did not all serve v1 within " +
                                 Fixed(options_.give_up_seconds, 0) + " s");
    }
    std::this_thread::sleep_for(kPollEvery);
  }
  std::cerr << "[churn bench] every worker serves v1 after " << Fixed(SecondsSince(join_start), 1)
            << " s\n";
  SampleRelays(relays_before_);
  SampleCpu(-1);
  churn_start_ = SteadyClock::now();
  auto at = [&](double seconds) {
    return churn_start_ + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  };
  size_t next_publish = 1;
  double next_churn = options_.publish_interval_seconds + options_.churn_offset_seconds;
  while (next_publish < staged_.size() || !Settled()) {
    FW_RETURN_IF_ERROR(CheckRoles());
    FW_RETURN_IF_ERROR(Sweep());
    FW_RETURN_IF_ERROR(CheckGiveUp());
    const auto now = SteadyClock::now();
    if (next_publish < staged_.size() && now >= at(options_.publish_interval_seconds * next_publish)) {
      FW_RETURN_IF_ERROR(Publish(next_publish++));
    } else if (options_.churn_percent > 0 && next_publish < staged_.size() && now >= at(next_churn)) {
      FW_RETURN_IF_ERROR(Churn());
      next_churn += options_.churn_period_seconds;
      SampleRelays(relays_after_);
    } else {
      std::this_thread::sleep_for(kPollEvery);
    }
  }
  churn_end_ = SteadyClock::now();
  SampleRelays(relays_after_);
  SampleCpu(+1);
  return Status::Ok();
}

ChurnBenchResult ChurnRun::Figures(uint64_t nofile_limit) {
  ChurnBenchResult result;
  result.nofile_limit = nofile_limit;
  std::vector<double> serve;
  for (const PublishRecord& record : publishes_) serve.insert(serve.end(), record.seconds.begin(), record.seconds.end());
  result.serve_samples = serve.size();
  result.serve_p50_seconds = Percentile(serve, 0.5);
  result.serve_p99_seconds = Percentile(serve, 0.99);
  result.serve_max_seconds = Max(serve);
  result.serve_late = static_cast<uint64_t>(std::count_if(
      serve.begin(), serve.end(), [&](double s) { return s > options_.serve_deadline_seconds; }));
  result.foreign_hashes = foreign_;
  result.restarts = victims_.size();
  result.restart_p50_seconds = Percentile(restart_seconds_, 0.5);
  result.restart_max_seconds = Max(restart_seconds_);
  result.restart_late = static_cast<uint64_t>(std::count_if(
      restart_seconds_.begin(), restart_seconds_.end(),
      [&](double s) { return s > options_.serve_deadline_seconds; }));
  for (const Victim& victim : victims_) {
    double& max = victim.sigterm ? result.forget_sigterm_max_ms : result.forget_sigkill_max_ms;
    max = std::max(max, victim.forget_ms);
    (victim.sigterm ? result.sigterms : result.sigkills) += 1;
    result.leaving_seen += victim.said_leaving ? 1 : 0;
  }
  result.unclean_exits = unclean_exits_;
  const double elapsed = std::chrono::duration<double>(churn_end_ - churn_start_).count();
  for (size_t r = 0; r < relays_after_.size() && r < relays_before_.size(); ++r) {
    const double cpu = relays_after_[r].cpu_seconds - relays_before_[r].cpu_seconds;
    result.relay_cpu_percent_max = std::max(result.relay_cpu_percent_max, 100.0 * cpu / std::max(elapsed, 1e-9));
    result.relay_rss_max_bytes = std::max(result.relay_rss_max_bytes, relays_after_[r].rss_bytes);
  }
  result.relay_fds_max = relay_fds_max_;
  result.relay_cache_bytes_max = relay_cache_bytes_max_;
  std::vector<double> deltas;
  for (const JoinSample& join : joins_) deltas.push_back(join.deltas);
  result.joins_timed = joins_.size();
  result.join_deltas_p50 = Percentile(deltas, 0.5);
  result.join_deltas_max = Max(deltas);
  return result;
}

Table PublishTable(const std::vector<PublishRecord>& publishes, double deadline) {
  Table table{{"version", "cohort", "killed first", "served", "p50 s", "p99 s", "max s",
               "apply p50 ms", "announce->swap p50 ms", "<= " + Fixed(deadline, 1) + " s"}, {}};
  for (const PublishRecord& record : publishes) {
    const double max = Max(record.seconds);
    table.rows.push_back({"v" + std::to_string(record.version), std::to_string(record.cohort),
                          std::to_string(record.excluded), std::to_string(record.seconds.size()),
                          Fixed(Percentile(record.seconds, 0.5), 3),
                          Fixed(Percentile(record.seconds, 0.99), 3), Fixed(max, 3),
                          Fixed(Percentile(record.apply_ms, 0.5), 1),
                          Fixed(Percentile(record.announce_to_swap_ms, 0.5), 1),
                          PassFail(max <= deadline)});
  }
  return table;
}

Table RelayTable(const std::vector<Role>& relays, const std::vector<ProcessUsage>& before,
                 const std::vector<ProcessUsage>& after, double elapsed, size_t workers) {
  Table table{{"relay", "workers", "CPU s (churn phase)", "CPU % of a core", "RSS MB", "open fds", "cache MB"}, {}};
  for (size_t r = 0; r < relays.size() && r < after.size() && r < before.size(); ++r) {
    const double cpu = after[r].cpu_seconds - before[r].cpu_seconds;
    const size_t children = workers / relays.size() + (r < workers % relays.size() ? 1 : 0);
    table.rows.push_back({relays[r].name, std::to_string(children), Fixed(cpu, 2),
                          Fixed(100.0 * cpu / std::max(elapsed, 1e-9), 1),
                          Fixed(static_cast<double>(after[r].rss_bytes) / 1e6, 1),
                          std::to_string(after[r].fds),
                          Fixed(static_cast<double>(after[r].cache_bytes) / 1e6, 1)});
  }
  return table;
}

// Where a restarted worker's time to the head went: p50 and max of each step.
Table JoinTable(const std::vector<JoinSample>& joins) {
  Table table{{"restart -> head, step (" + std::to_string(joins.size()) + " restarts)", "p50", "max"}, {}};
  auto row = [&](const std::string& step, double JoinSample::*field, int digits, const std::string& unit) {
    std::vector<double> values;
    for (const JoinSample& join : joins) values.push_back(join.*field);
    table.rows.push_back({step, Fixed(Percentile(values, 0.5), digits) + unit, Fixed(Max(values), digits) + unit});
  };
  row("process start (exec -> Worker::Start)", &JoinSample::process_start, 3, " s");
  row("connect + subscribe (-> first catalog)", &JoinSample::subscribe, 3, " s");
  row("plan (-> keyframe fetch begins)", &JoinSample::to_keyframe, 3, " s");
  row("keyframe fetch (staged, verified as it arrives)", &JoinSample::keyframe_fetch, 3, " s");
  row("keyframe apply (last piece -> served)", &JoinSample::keyframe_apply, 3, " s");
  row("deltas after the keyframe (fetch + apply)", &JoinSample::chain, 3, " s");
  row("total (exec -> the join's head served)", &JoinSample::total, 3, " s");
  row("deltas applied", &JoinSample::deltas, 0, "");
  row("worker CPU by then", &JoinSample::cpu_seconds, 3, " s");
  return table;
}

Table CpuTable(const CpuBudget& cpu, double elapsed, int workers, int publishes) {
  const double capacity = elapsed * std::max(1u, std::thread::hardware_concurrency());
  Table table{{"where the CPU went (churn phase)", "CPU s", "% of the machine", "note"}, {}};
  auto row = [&](const std::string& what, double seconds, const std::string& note) {
    table.rows.push_back({what, Fixed(seconds, 2), Fixed(100.0 * seconds / capacity, 1), note});
  };
  row("publisher", cpu.publisher, "encode, serve the relays");
  row("relays", cpu.relays, "fan-out to the workers");
  row("workers", cpu.workers,
      Fixed(1000.0 * cpu.workers / std::max(1, workers) / std::max(1, publishes), 1) +
          " ms per worker per publish (restarts' joins included)");
  row("this benchmark", cpu.self, "status polling, checks");
  row("rest of the machine", std::max(0.0, cpu.machine - cpu.publisher - cpu.relays - cpu.workers - cpu.self),
      "other processes");
  row("capacity", capacity, Fixed(elapsed, 1) + " s x " + std::to_string(std::thread::hardware_concurrency()) + " CPUs");
  return table;
}

void ChurnRun::Print(const ChurnBenchResult& r, std::ostream& out) const {
  const double deadline = options_.serve_deadline_seconds;
  out << "## Churn benchmark\n\n"
      << options_.workers << " model-less workers behind " << options_.relays << " relays, "
      << options_.publishes << " publishes of a " << Fixed(options_.checkpoint_bytes / 1e6, 1)
      << " MB bf16 model (AdamW lr " << options_.learning_rate << ", a keyframe every "
      << (options_.keyframe_every == 0 ? std::string("10 (the default)") : std::to_string(options_.keyframe_every))
      << " version(s)) every "
      << Fixed(options_.publish_interval_seconds, 1) << " s; every "
      << Fixed(options_.churn_period_seconds, 1) << " s " << Fixed(options_.churn_percent, 0)
      << "% of the workers killed (alternately SIGKILL and SIGTERM) and restarted at once. "
      << "RLIMIT_NOFILE " << r.nofile_limit << ".\n\n"
      << "Per publish (commit of the drop -> each worker of the cohort serving it):\n"
      << RenderText(PublishTable(publishes_, deadline)) << "\n"
      << "A restarted worker's way to the head (its \"join\" status; exec time from this process):\n"
      << RenderText(JoinTable(joins_)) << "\n"
      << "Relays (CPU over the churn phase; RSS and descriptors at the end, every worker up):\n"
      << RenderText(RelayTable(relays_, relays_before_, relays_after_,
                               std::chrono::duration<double>(churn_end_ - churn_start_).count(),
                               slots_.size()))
      << "\n"
      << RenderText(CpuTable(cpu_, std::chrono::duration<double>(churn_end_ - churn_start_).count(),
                             options_.workers, options_.publishes))
      << "\n";
  Table summary{{"figure", "measured", "target", "verdict"}, {}};
  summary.rows.push_back({"commit -> serving, p50 / p99 / max (" + std::to_string(r.serve_samples) + " pairs)",
                          Fixed(r.serve_p50_seconds, 3) + " / " + Fixed(r.serve_p99_seconds, 3) + " / " +
                              Fixed(r.serve_max_seconds, 3) + " s",
                          "<= " + Fixed(deadline, 1) + " s", PassFail(r.serve_late == 0)});
  summary.rows.push_back({"foreign (version, hash) reported", std::to_string(r.foreign_hashes), "0",
                          PassFail(r.foreign_hashes == 0)});
  summary.rows.push_back({"restart -> serving the head, p50 / max (" + std::to_string(restart_seconds_.size()) + ")",
                          Fixed(r.restart_p50_seconds, 3) + " / " + Fixed(r.restart_max_seconds, 3) + " s",
                          "<= " + Fixed(deadline, 1) + " s", PassFail(r.restart_late == 0)});
  summary.rows.push_back({"restart: deltas applied after the keyframe, p50 / max (" + std::to_string(r.joins_timed) + ")",
                          Fixed(r.join_deltas_p50, 0) + " / " + Fixed(r.join_deltas_max, 0), "-", "-"});
  summary.rows.push_back({"SIGTERM: relay forgets it, max (" + std::to_string(r.sigterms) + ")",
                          Fixed(r.forget_sigterm_max_ms, 1) + " ms", "at once (< 1000 ms)",
                          PassFail(r.forget_sigterm_max_ms < 1000)});
  summary.rows.push_back({"SIGTERM: status said \"leaving\" / exited cleanly",
                          std::to_string(r.leaving_seen) + " / " + std::to_string(r.sigterms - r.unclean_exits) +
                              " of " + std::to_string(r.sigterms),
                          "all", PassFail(r.unclean_exits == 0 && r.leaving_seen == r.sigterms)});
  summary.rows.push_back({"SIGKILL (peer: no goodbye): relay forgets it, max (" + std::to_string(r.sigkills) + ")",
                          Fixed(r.forget_sigkill_max_ms, 1) + " ms", "-", "-"});
  out << RenderText(summary);
  if (foreign_ > 0) out << "  first foreign: " << first_foreign_ << "\n";
}

Json ChurnRun::JoinsJson() const {
  Json joins = Json::array();
  for (const JoinSample& j : joins_) {
    joins.push_back({{"process_start", j.process_start}, {"subscribe", j.subscribe},
                     {"to_keyframe", j.to_keyframe}, {"keyframe_fetch", j.keyframe_fetch},
                     {"keyframe_apply", j.keyframe_apply}, {"chain", j.chain}, {"total", j.total},
                     {"deltas", j.deltas}, {"cpu_seconds", j.cpu_seconds}});
  }
  return joins;
}

Json ChurnRun::ToJson(const ChurnBenchResult& r) const {
  Json publishes = Json::array();
  for (const PublishRecord& record : publishes_) {
    publishes.push_back({{"version", record.version}, {"cohort", record.cohort},
                         {"killed_first", record.excluded}, {"seconds", record.seconds},
                         {"apply_ms", record.apply_ms}, {"announce_to_swap_ms", record.announce_to_swap_ms}});
  }
  return {{"workers", options_.workers}, {"relays", options_.relays}, {"publishes", publishes},
          {"checkpoint_bytes", options_.checkpoint_bytes}, {"churn_percent", options_.churn_percent},
          {"nofile_limit", r.nofile_limit}, {"serve_p50_seconds", r.serve_p50_seconds},
          {"serve_p99_seconds", r.serve_p99_seconds}, {"serve_max_seconds", r.serve_max_seconds},
          {"serve_late", r.serve_late}, {"foreign_hashes", r.foreign_hashes},
          {"restarts", r.restarts}, {"restart_seconds", restart_seconds_}, {"joins", JoinsJson()},
          {"sigterms", r.sigterms}, {"sigkills", r.sigkills},
          {"forget_sigterm_max_ms", r.forget_sigterm_max_ms},
          {"forget_sigkill_max_ms", r.forget_sigkill_max_ms}, {"leaving_seen", r.leaving_seen},
          {"unclean_exits", r.unclean_exits}, {"relay_cpu_percent_max", r.relay_cpu_percent_max},
          {"relay_rss_max_bytes", r.relay_rss_max_bytes}, {"relay_fds_max", r.relay_fds_max},
          {"relay_cache_bytes_max", r.relay_cache_bytes_max},
          {"cpu_seconds", {{"publisher", cpu_.publisher}, {"relays", cpu_.relays},
                           {"workers", cpu_.workers}, {"benchmark", cpu_.self},
                           {"machine", cpu_.machine}}}};
}

// Raises RLIMIT_NOFILE's soft limit to the hard one (children inherit it); returns it.
uint64_t RaiseFileLimit() {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  limit.rlim_cur = limit.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &limit);
  (void)::getrlimit(RLIMIT_NOFILE, &limit);
  return static_cast<uint64_t>(limit.rlim_cur);
}

Status ValidateOptions(const ChurnBenchOptions& options) {
  if (options.workers < 1 || options.relays < 1 || options.workers < options.relays) {
    return Status::InvalidArgument("churn bench: --workers (" + std::to_string(options.workers) +
                                   ") must be at least --relays (" + std::to_string(options.relays) +
                                   ") and both at least 1");
  }
  if (options.publishes < 1) return Status::InvalidArgument("churn bench: --publishes must be at least 1");
  if (!(options.churn_percent >= 0 && options.churn_percent <= 100)) {
    return Status::InvalidArgument("churn bench: --churn-percent must be in [0, 100]");
  }
  if (!(options.churn_period_seconds > 0) || !(options.publish_interval_seconds > 0)) {
    return Status::InvalidArgument("churn bench: the churn period and publish interval must be positive");
  }
  return Status::Ok();
}

Result<std::string> ResolveFlywheel(const std::string& given) {
  std::string path = given;
  if (path.empty()) {
    FW_ASSIGN_OR_RETURN(path, ops::ExecutablePath());
  }
  if (::access(path.c_str(), X_OK) != 0) {
    return Status::NotFound("flywheel binary " + path + " is not executable: " + std::strerror(errno));
  }
  return path;
}

}  // namespace

Result<ChurnBenchResult> RunChurnBench(const ChurnBenchOptions& options, std::ostream& out) {
  FW_RETURN_IF_ERROR(ValidateOptions(options));
  FW_ASSIGN_OR_RETURN(const std::string flywheel, ResolveFlywheel(options.flywheel_binary));
  const uint64_t nofile = RaiseFileLimit();
  ScopedWorkDir work_dir;
  FW_RETURN_IF_ERROR(work_dir.Prepare(options.work_dir, "flywheel-churn-bench", options.keep));
  FW_RETURN_IF_ERROR(Env::Default()->CreateDirs(work_dir.path() + "/logs"));
  if (options.keep) std::cerr << "[churn bench] work dir (kept): " << work_dir.path() << "\n";
  ChurnBenchResult result;
  {
    ChurnRun run(options, flywheel, work_dir.path());
    Status status = run.Start();
    if (status.ok()) status = run.Run();
    if (!status.ok()) return status.WithContext("churn bench");
    result = run.Figures(nofile);
    run.Print(result, out);
    if (!options.json_out.empty()) {
      const std::string json = run.ToJson(result).dump(2);
      FW_RETURN_IF_ERROR(WriteFileAtomically(options.json_out, std::as_bytes(std::span(json))));
    }
  }  // every process stopped here
  if (result.foreign_hashes > 0) return Status::Corruption("churn bench: workers reported unpublished hashes");
  if (result.unclean_exits > 0) return Status::Corruption("churn bench: a SIGTERMed worker did not exit cleanly");
  return result;
}

}  // namespace flywheel::bench
