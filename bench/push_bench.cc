#include "bench/push_bench.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "bench/checkpoint_gen.h"
#include "bench/util.h"
#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "testing/fault_proxy.h"
#include "ops/process.h"
#include "push/push_client.h"
#include "transport/http.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr char kPushToken[] = "bench-push-token";
constexpr char kReadToken[] = "bench-read-token";

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Fleet {
  std::unique_ptr<ops::ProcessGroup> processes;
  transport::Endpoint publisher_http;
  std::vector<transport::Endpoint> worker_http;
};

Result<transport::Endpoint> ReadyEndpoint(const json& ready, const char* key) {
  if (!ready.contains(key) || !ready[key].is_string()) {
    return Status::Internal(std::string("ready file has no '") + key + "': " + ready.dump());
  }
  return transport::ParseEndpoint(ready[key].get<std::string>());
}

// Starts `args` and waits for its ready file; the ready document.
Result<json> StartRole(ops::ProcessGroup& group, const std::string& binary,
                       const std::string& dir, const std::string& name,
                       std::vector<std::string> args) {
  const std::string ready = dir + "/" + name + ".ready";
  args.insert(args.end(), {"--ready-file", ready, "--token-file", dir + "/read.token"});
  FW_ASSIGN_OR_RETURN(size_t index, group.Start(name, binary, args));
  return ops::AwaitReadyFile(group, ready, name, 60s, index);
}

Result<Fleet> StartFleet(const PushBenchOptions& options, const std::string& binary,
                         const std::string& dir) {
  Fleet fleet;
  fleet.processes = std::make_unique<ops::ProcessGroup>(dir + "/logs");
  const std::string threads = std::to_string(options.threads);
  FW_ASSIGN_OR_RETURN(json publisher,
                      StartRole(*fleet.processes, binary, dir, "publisher",
                                {"publish", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                 "--state-dir", dir + "/state", "--push-token-file",
                                 dir + "/push.token", "--watch", dir + "/watch", "--threads",
                                 threads, "--keyframe-every",
                                 "1000", "--max-part-mib", "2048", "--max-upload-mib", "65536"}));
  FW_ASSIGN_OR_RETURN(fleet.publisher_http, ReadyEndpoint(publisher, "http"));
  FW_ASSIGN_OR_RETURN(transport::Endpoint publisher_listen, ReadyEndpoint(publisher, "listen"));
  FW_ASSIGN_OR_RETURN(json relay,
                      StartRole(*fleet.processes, binary, dir, "relay",
                                {"relay", "--region", "home", "--listen", "127.0.0.1:0", "--http",
                                 "127.0.0.1:0", "--upstream", publisher_listen.ToString()}));
  FW_ASSIGN_OR_RETURN(transport::Endpoint relay_listen, ReadyEndpoint(relay, "listen"));
  for (int i = 0; i < options.workers; ++i) {
    const std::string name = "worker-" + std::to_string(i);
    FW_ASSIGN_OR_RETURN(json worker,
                        StartRole(*fleet.processes, binary, dir, name,
                                  {"worker", "--region", "home", "--node-id", name, "--http",
                                   "127.0.0.1:0", "--upstream", relay_listen.ToString()}));
    FW_ASSIGN_OR_RETURN(transport::Endpoint http, ReadyEndpoint(worker, "http"));
    fleet.worker_http.push_back(http);
  }
  return fleet;
}

// Every worker's weights hash equals `hash`.
Status CheckWorkers(const Fleet& fleet, const std::string& hash, uint64_t version) {
  transport::HttpGetOptions get;
  get.token = kReadToken;
  for (const transport::Endpoint& worker : fleet.worker_http) {
    FW_ASSIGN_OR_RETURN(transport::HttpResponse response, transport::HttpGet(worker, "/v1/status", get));
    const json status = json::parse(response.body, nullptr, false);
    if (status.is_discarded() || status.value("weights_hash", std::string()) != hash) {
      return Status::Internal("worker " + worker.ToString() + " serves " +
                              (status.is_discarded() ? "?" : status.value("weights_hash", std::string("?"))) +
                              ", not v" + std::to_string(version) + "'s " + hash);
    }
  }
  return Status::Ok();
}

// A process's resident memory (/proc/<pid>/status), in bytes.
struct Rss {
  uint64_t total = 0;  // VmRSS
  uint64_t anon = 0;   // RssAnon: what the process holds itself (no mapped file pages)
};
Rss ReadRss(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  Rss rss;
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss.total = std::stoull(line.substr(6)) << 10;
    if (line.rfind("RssAnon:", 0) == 0) rss.anon = std::stoull(line.substr(8)) << 10;
  }
  return rss;
}

// Samples a process's RSS every 2 ms from construction to Stop(): the peak of each field.
class RssPeak {
 public:
  explicit RssPeak(pid_t pid) : pid_(pid), peak_(ReadRss(pid)) {
    thread_ = std::thread([this] {
      while (!done_) {
        const Rss now = ReadRss(pid_);
        peak_.total = std::max(peak_.total, now.total);
        peak_.anon = std::max(peak_.anon, now.anon);
        std::this_thread::sleep_for(2ms);
      }
    });
  }
  ~RssPeak() { Stop(); }
  Rss Stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
    return peak_;
  }

 private:
  const pid_t pid_;
  Rss peak_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

struct PushRow {
  uint64_t version = 0;
  std::string kind;
  uint64_t checkpoint_bytes = 0, uploaded_bytes = 0;
  double density = 0;  // changed words / words (deltas)
  double encode_s = 0, upload_s = 0, commit_s = 0, wire_s = 0, fleet_s = 0;
  double drop_s = 0;  // the next step published from a drop: the fleet's own sync time
  Rss publisher_idle, publisher_peak;  // the publisher's RSS before and during the push
  double total_s() const { return encode_s + upload_s + fleet_s; }
};

Result<PushRow> PushOne(const PushBenchOptions& options, const Fleet& fleet,
                        const sync::PushClientOptions& client, const std::string& file,
                        uint64_t version) {
  PushRow row;
  row.version = version;
  FW_ASSIGN_OR_RETURN(sync::PushOutcome pushed,
                      sync::Push(client, {file, version, json{{"bench", "push"}}}));
  row.kind = pushed.kind;
  row.checkpoint_bytes = pushed.checkpoint_bytes;
  row.uploaded_bytes = pushed.uploaded_bytes;
  row.encode_s = pushed.encode_seconds;
  row.upload_s = pushed.upload_seconds;
  row.commit_s = pushed.commit_seconds;
  row.wire_s = options.link_bits_per_s > 0
                   ? 8.0 * static_cast<double>(pushed.uploaded_bytes) / options.link_bits_per_s
                   : 0;
  const auto committed = Clock::now();
  sync::PushClientOptions direct = client;
  direct.url = "http://" + fleet.publisher_http.ToString();
  FW_RETURN_IF_ERROR(sync::WaitServing(direct, version, 1.0, 300s,
                                       static_cast<uint64_t>(options.workers))
                         .status());
  row.fleet_s = Seconds(Clock::now() - committed);
  FW_RETURN_IF_ERROR(
      CheckWorkers(fleet, pushed.row.value("weights_hash", std::string()), version));
  return row;
}

// Publishes `view` as `version` from a drop (<watch>/<v>/model.safetensors, then COMMIT)
// and waits until every worker serves it: seconds from the COMMIT.
Result<double> DropOne(const PushBenchOptions& options, const Fleet& fleet,
                       const std::string& dir, const CheckpointView& view, uint64_t version) {
  const std::string drop = dir + "/watch/" + std::to_string(version);
  std::error_code error;
  fs::create_directories(drop, error);
  if (error) return Status::IOError("cannot create " + drop + ": " + error.message());
  FW_RETURN_IF_ERROR(WriteSafetensors(drop + "/model.safetensors", view, {}));
  const auto start = Clock::now();
  FW_RETURN_IF_ERROR(WriteFileAtomically(drop + "/COMMIT", {}));
  sync::PushClientOptions direct;
  direct.url = "http://" + fleet.publisher_http.ToString();
  direct.token = kReadToken;
  FW_RETURN_IF_ERROR(sync::WaitServing(direct, version, 1.0, 300s,
                                       static_cast<uint64_t>(options.workers))
                         .status());
  const double seconds = Seconds(Clock::now() - start);
  fs::remove_all(drop, error);
  return seconds;
}

// `curl -T file` into a fresh upload through the proxy (then aborted): its seconds.
Result<double> CurlPeer(const std::string& dir, const Fleet& fleet, uint16_t proxy_port,
                        const std::string& file) {
  if (::access("/usr/bin/curl", X_OK) != 0) return Status::NotFound("curl is not installed");
  const uint64_t size = fs::file_size(file);
  transport::HttpGetOptions post;
  post.token = kPushToken;
  const std::string spec =
      json{{"size", size}, {"digest", {{"algorithm", "xxh3_64"}, {"value", std::string(16, '0')}}}}
          .dump();
  FW_ASSIGN_OR_RETURN(transport::HttpResponse created,
                      transport::HttpPost(fleet.publisher_http, "/v1/uploads", spec, post));
  const json upload = json::parse(created.body, nullptr, false);
  if (created.status != 201 || upload.is_discarded()) {
    return Status::Internal("cannot create the curl peer's upload: " + created.body);
  }
  const std::string id = upload["id"];
  const std::string header = dir + "/curl.header";
  const std::string authorization = std::string("Authorization: Bearer ") + kPushToken;
  FW_RETURN_IF_ERROR(WriteFileAtomically(header, std::as_bytes(std::span(authorization))));
  ops::RunOptions run;
  run.timeout = 600s;
  FW_ASSIGN_OR_RETURN(ops::Completion done,
                      ops::RunToCompletion(
                          "/usr/bin/curl",
                          {"-sS", "-f", "-T", file, "-X", "PUT", "-H", "@" + header, "-H",
                           "Content-Type: application/octet-stream", "-o", "/dev/null", "-w",
                           "%{time_total}",
                           "http://127.0.0.1:" + std::to_string(proxy_port) + "/v1/uploads/" +
                               id + "?offset=0"},
                          run));
  (void)transport::HttpCall(fleet.publisher_http, "DELETE", "/v1/uploads/" + id, {}, post);
  if (done.exit_code != 0) return Status::Internal("curl -T failed: " + done.err);
  return std::stod(done.out);
}

// The work dir's logs/, watch/ and the two token files (private: the roles refuse a token
// file that others can read).
Status PrepareWorkDir(const std::string& dir) {
  fs::create_directories(dir + "/logs");
  fs::create_directories(dir + "/watch");
  for (const auto& [name, token] : {std::pair{"push.token", kPushToken}, {"read.token", kReadToken}}) {
    const std::string text = token;
    FW_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + name, std::as_bytes(std::span(text))));
    fs::permissions(dir + "/" + name, fs::perms::owner_read | fs::perms::owner_write);
  }
  return Status::Ok();
}

// The fraction of the bf16 words that differ between two checkpoints' bytes.
double ChangedFraction(const std::vector<std::byte>& previous,
                       const std::vector<std::byte>& bytes) {
  uint64_t changed = 0;
  const auto* a = reinterpret_cast<const uint16_t*>(previous.data());
  const auto* b = reinterpret_cast<const uint16_t*>(bytes.data());
  for (size_t i = 0; i < bytes.size() / 2; ++i) changed += a[i] != b[i];
  return static_cast<double>(changed) / static_cast<double>(bytes.size() / 2);
}

// The pushes and drops of one run, step by step.
struct PushRun {
  const PushBenchOptions& options;
  const Fleet& fleet;
  const sync::PushClientOptions& client;
  const std::string& dir;
  uint16_t proxy_port;
  std::ostream& out;
  std::vector<PushRow> rows{};
  double curl_s = 0;
  std::vector<std::byte> previous{};  // the last pushed version's bytes, for the density

  // Odd steps after the first: the baseline, the same kind of step as a drop.
  Status Drop(uint64_t version, const CheckpointView& view) {
    FW_ASSIGN_OR_RETURN(rows.back().drop_s, DropOne(options, fleet, dir, view, version));
    out << "push bench: v" << version << " drop served by all workers after "
        << Fixed(rows.back().drop_s, 2) << " s\n"
        << std::flush;
    return Status::Ok();
  }

  Status Step(int step, const CheckpointView& view) {
    const uint64_t version = static_cast<uint64_t>(step);
    if (step > 1 && step % 2 == 1) return Drop(version, view);
    // Words changed since the last push: what the client's delta (from its cache) holds.
    std::vector<std::byte> bytes;
    for (const TensorView& t : view) bytes.insert(bytes.end(), t.data.begin(), t.data.end());
    const double density = previous.empty() ? 0 : ChangedFraction(previous, bytes);
    previous = std::move(bytes);
    const std::string file = dir + "/v" + std::to_string(version) + ".safetensors";
    FW_RETURN_IF_ERROR(WriteSafetensors(file, view, {}));
    const pid_t publisher = fleet.processes->pid(0);
    const Rss idle = ReadRss(publisher);
    RssPeak peak(publisher);
    Result<PushRow> pushed = PushOne(options, fleet, client, file, version);
    const Rss during = peak.Stop();
    FW_ASSIGN_OR_RETURN(PushRow row, std::move(pushed));
    row.publisher_idle = idle;
    row.publisher_peak = during;
    row.density = density;
    out << "push bench: v" << version << " " << row.kind << " " << Grouped(row.uploaded_bytes)
        << " bytes (" << Fixed(100 * density, 2) << "% of the words changed), served by all "
        << "workers after " << Fixed(row.total_s(), 2) << " s\n" << std::flush;
    rows.push_back(row);
    if (step == 1) {
      FW_ASSIGN_OR_RETURN(curl_s, CurlPeer(dir, fleet, proxy_port, file));
    }
    std::error_code ignored;
    fs::remove(file, ignored);
    return Status::Ok();
  }
};

// One row per push and the curl peer's; `missed` lists each delta push over its targets.
Table PushTable(const std::vector<PushRow>& rows, double curl_s, std::string& missed) {
  Table table{{"push", "kind", "words changed since the last push", "uploaded", "of checkpoint",
               "encode s", "transfer s", "wire floor s", "commit s", "then all serving s",
               "push→all serving s", "drop→all serving s", "target s"},
              {}};
  for (const PushRow& row : rows) {
    const bool delta = row.kind == "delta";
    const double target = 1.3 * row.wire_s + row.drop_s;
    table.rows.push_back({"v" + std::to_string(row.version), row.kind,
                          delta ? Fixed(100 * row.density, 2) + "%" : "-",
                          Grouped(row.uploaded_bytes),
                          "1/" + Fixed(static_cast<double>(row.checkpoint_bytes) / row.uploaded_bytes, 1),
                          Fixed(row.encode_s, 2), Fixed(row.upload_s - row.commit_s, 2),
                          Fixed(row.wire_s, 2), Fixed(row.commit_s, 2), Fixed(row.fleet_s, 2),
                          Fixed(row.total_s(), 2),
                          delta ? Fixed(row.drop_s, 2) : "-", delta ? Fixed(target, 2) : "-"});
    if (!delta) continue;
    if (row.uploaded_bytes * 40 > row.checkpoint_bytes) {
      missed += " v" + std::to_string(row.version) + " uploaded more than 1/40;";
    }
    if (row.total_s() > target) {
      missed += " v" + std::to_string(row.version) + " push→serving " + Fixed(row.total_s(), 2) +
                " s > target " + Fixed(target, 2) + " s;";
    }
  }
  for (const PushRow& row : rows) {
    // The push streams its body to disk: the publisher holds at most the head (the weights it
    // publishes) and 64 MiB more, whatever the upload's size.
    const uint64_t bound = row.publisher_idle.total + row.checkpoint_bytes + (64ull << 20);
    if (row.publisher_peak.total > bound) {
      missed += " v" + std::to_string(row.version) + " publisher RSS " +
                Fixed(row.publisher_peak.total / 1048576.0, 0) + " MiB > idle + head + 64 MiB = " +
                Fixed(bound / 1048576.0, 0) + " MiB;";
    }
  }
  table.rows.push_back({"curl -T (peer, full v1)", "full", "-", Grouped(rows[0].checkpoint_bytes),
                        "1/1.0", "-", Fixed(curl_s, 2), Fixed(rows[0].wire_s, 2), "-", "-", "-", "-",
                        "-"});
  return table;
}

Status ReportPushes(const PushBenchOptions& options, const PushRun& run, std::ostream& out) {
  std::string missed;
  const Table table = PushTable(run.rows, run.curl_s, missed);
  const PushRow& full = run.rows[0];
  out << "\n" << RenderText(table);
  const double mib = 1048576.0;
  out << "\nPublisher RSS per push (peak while the push and the fleet's sync ran, against its "
         "RSS just before; bound: idle + head + 64 MiB):\n";
  for (const PushRow& row : run.rows) {
    const double bound = (row.publisher_idle.total + row.checkpoint_bytes + (64ull << 20)) / mib;
    out << "  v" << row.version << " " << row.kind << ": idle " << Fixed(row.publisher_idle.total / mib, 0)
        << " MiB, peak " << Fixed(row.publisher_peak.total / mib, 0) << " MiB (+"
        << Fixed((row.publisher_peak.total - std::min(row.publisher_peak.total, row.publisher_idle.total)) / mib, 0)
        << "; anonymous +"
        << Fixed((row.publisher_peak.anon - std::min(row.publisher_peak.anon, row.publisher_idle.anon)) / mib, 0)
        << "), bound " << Fixed(bound, 0) << " MiB: "
        << (row.publisher_peak.total <= bound * mib ? "PASS" : "FAIL") << "\n";
  }
  out << "\nLink " << Fixed(options.link_bits_per_s / 1e9, 2) << " Gbit/s (client -> publisher), "
      << options.workers << " workers behind one relay; the full v1 transfer (parts, resumable) "
      << Fixed(full.upload_s - full.commit_s, 2) << " s vs curl -T of the file "
      << Fixed(run.curl_s, 2) << " s (" << Fixed((full.upload_s - full.commit_s) / run.curl_s, 2)
      << "x).\n";
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(
        options.markdown_out, "## Push benchmark",
        "## Push benchmark\n\n`flywheel bench push --size-mb " +
            std::to_string(options.checkpoint_bytes >> 20) + "`: a " +
            Grouped(options.checkpoint_bytes) + "-byte bf16 checkpoint pushed through a " +
            Fixed(options.link_bits_per_s / 1e9, 2) + " Gbit/s shaped upload link to a publisher, " +
            "one relay and " + std::to_string(options.workers) +
            " workers; `curl -T` of the full file over the same link is the peer.\n\n" +
            RenderMarkdown(table) + "\n"));
  }
  (void)run.fleet.processes->StopAll();
  if (options.check && !missed.empty())
    return Status::Internal("push bench: targets missed:" + missed);
  return Status::Ok();
}

}  // namespace

Status RunPushBench(const PushBenchOptions& options, std::ostream& out) {
  if (options.workers < 1 || options.steps < 1) {
    return Status::InvalidArgument("push bench: --workers and --steps must be >= 1");
  }
  std::string binary = options.flywheel_binary;
  if (binary.empty()) {
    FW_ASSIGN_OR_RETURN(binary, ops::ExecutablePath());
  }
  ScopedWorkDir work;
  FW_RETURN_IF_ERROR(work.Prepare(options.work_dir, "flywheel-push-bench", options.keep));
  const std::string dir = work.path();
  FW_RETURN_IF_ERROR(PrepareWorkDir(dir));
  out << "push bench: starting publisher, relay and " << options.workers << " workers\n";
  FW_ASSIGN_OR_RETURN(Fleet fleet, StartFleet(options, binary, dir));
  testing::FaultProxy proxy(fleet.publisher_http.port,
                            {.upstream_bytes_per_s = options.link_bits_per_s / 8});
  if (!proxy.ok()) return Status::IOError("push bench: the shaping proxy: " + proxy.error());
  sync::PushClientOptions client;
  client.url = "http://127.0.0.1:" + std::to_string(proxy.port());
  client.token = kPushToken;
  client.cache_dir = dir + "/cache";
  client.threads = options.threads;
  client.timeout = 600s;
  GeneratorOptions generate;
  generate.checkpoint_bytes = options.checkpoint_bytes;
  generate.threads = options.threads;
  out << "push bench: " << 1 + 2 * options.steps << " AdamW steps of a "
      << Grouped(options.checkpoint_bytes) << "-byte model: v1 pushed in full, then a delta push "
      << "and a drop (the fleet's own sync, the baseline) in turn\n"
      << std::flush;
  PushRun run{options, fleet, client, dir, proxy.port(), out};
  FW_RETURN_IF_ERROR(GenerateCheckpointSequence(
      generate, 1 + 2 * options.steps,
      [&](int step, const CheckpointView& view) { return run.Step(step, view); }));
  return ReportPushes(options, run, out);
}

}  // namespace flywheel::bench
