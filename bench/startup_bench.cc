#include "bench/startup_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "bench/stats.h"
#include "bench/util.h"
#include "checkpoint/safetensors.h"
#include "ops/process.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;
constexpr double kMaxStartMs = 50;       // issue 13: --help and a 1 MB hash, warm cache
constexpr double kMaxColdStartMs = 100;  // the same from a dropped page cache
constexpr double kMaxIdleRssMb = 40;   // issue 13: an idle relay or model-less worker

// Evicts clean pages from the page cache (root only), so that the next start reads its
// executable and libraries from disk.
Status DropPageCache() {
  ::sync();
  std::ofstream drop("/proc/sys/vm/drop_caches");
  drop << "3\n";
  drop.close();
  if (!drop) return Status::IOError("--cold needs root: cannot write /proc/sys/vm/drop_caches");
  return Status::Ok();
}

// Median wall time of `program args` over `reps` runs, in ms; every run must exit 0. With
// `cold` the page cache is dropped before each run.
Result<double> MedianMs(const std::string& program, const std::vector<std::string>& args, int reps,
                        bool cold) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    if (cold) FW_RETURN_IF_ERROR(DropPageCache());
    FW_ASSIGN_OR_RETURN(ops::Completion run, ops::RunToCompletion(program, args, {}));
    if (run.exit_code != 0) {
      return Status::Internal(program + " exited with " + std::to_string(run.exit_code) + ": " +
                              run.err.substr(0, 300));
    }
    ms.push_back(run.elapsed.count() * 1000);
  }
  return Median(std::move(ms));
}

// VmRSS of a process, in MB.
Result<double> RssMb(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return Status::NotFound("no VmRSS for pid " + std::to_string(pid));
}

// A 1 MB single-tensor safetensors file (arbitrary bytes).
Status WriteOneMbCheckpoint(const std::string& path) {
  std::vector<std::byte> bytes(1 << 20);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  const CheckpointView view = {TensorView{"t", DType::kU8, {static_cast<int64_t>(bytes.size())}, bytes}};
  return WriteSafetensors(path, view, {});
}

struct IdleRss {
  double publisher = 0, relay = 0, worker = 0;
};

// Starts a publisher, a relay and a model-less worker with `binary`, waits until each is
// ready and the worker connected, lets them settle and reads their VmRSS.
Result<IdleRss> MeasureIdle(const std::string& binary, const std::string& dir) {
  fs::create_directories(dir + "/drops");
  fs::create_directories(dir + "/logs");
  ops::ProcessGroup group(dir + "/logs");
  const auto ready = [&](const std::string& name) { return dir + "/" + name + ".ready"; };
  FW_ASSIGN_OR_RETURN(size_t publisher,
                      group.Start("publish", binary,
                                  {"publish", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                   "--state-dir", dir + "/state", "--watch", dir + "/drops",
                                   "--ready-file", ready("publish")}));
  FW_ASSIGN_OR_RETURN(nlohmann::json published,
                      ops::AwaitReadyFile(group, ready("publish"), "publish", std::chrono::seconds(30)));
  const std::string upstream = published.value("listen", "");
  FW_ASSIGN_OR_RETURN(size_t relay,
                      group.Start("relay", binary,
                                  {"relay", "--region", "eu", "--upstream", upstream, "--listen",
                                   "127.0.0.1:0", "--http", "127.0.0.1:0", "--ready-file", ready("relay")}));
  FW_ASSIGN_OR_RETURN(size_t worker,
                      group.Start("worker", binary,
                                  {"worker", "--region", "eu", "--upstream", upstream, "--http",
                                   "127.0.0.1:0", "--ready-file", ready("worker")}));
  FW_RETURN_IF_ERROR(
      ops::AwaitReadyFile(group, ready("relay"), "relay", std::chrono::seconds(30)).status());
  FW_RETURN_IF_ERROR(
      ops::AwaitReadyFile(group, ready("worker"), "worker", std::chrono::seconds(30)).status());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // connected and idle
  FW_RETURN_IF_ERROR(group.CheckAllRunning());
  IdleRss rss;
  FW_ASSIGN_OR_RETURN(rss.publisher, RssMb(group.pid(publisher)));
  FW_ASSIGN_OR_RETURN(rss.relay, RssMb(group.pid(relay)));
  FW_ASSIGN_OR_RETURN(rss.worker, RssMb(group.pid(worker)));
  return rss;
}

std::string Ratio(double a, double b) { return b > 0 ? Fixed(a / b, 1) + "x" : "-"; }

}  // namespace

Status RunStartupBench(const StartupBenchOptions& options, std::ostream& out) {
  if (options.reps < 1) return Status::InvalidArgument("reps must be >= 1");
  std::string flywheel = options.flywheel_binary;
  if (flywheel.empty()) {
    FW_ASSIGN_OR_RETURN(const std::string self, ops::ExecutablePath());
    flywheel = (fs::path(self).parent_path() / "flywheel").string();
  }
  const std::string torch = (fs::path(flywheel).parent_path() / "flywheel-torch").string();
  for (const std::string& binary : {flywheel, torch}) {
    if (::access(binary.c_str(), X_OK) != 0) return Status::NotFound(binary + " is not executable");
  }
  ScopedWorkDir work;
  FW_RETURN_IF_ERROR(work.Prepare("", "flywheel-startup-bench", /*keep=*/false));
  const std::string checkpoint = work.path() + "/one_mb.safetensors";
  FW_RETURN_IF_ERROR(WriteOneMbCheckpoint(checkpoint));

  const int reps = options.reps;
  FW_ASSIGN_OR_RETURN(double true_ms, MedianMs("/bin/true", {}, reps, options.cold));
  FW_ASSIGN_OR_RETURN(double python_ms, MedianMs("/usr/bin/python3", {"-c", "pass"}, reps, options.cold));
  FW_ASSIGN_OR_RETURN(double help_ms, MedianMs(flywheel, {"--help"}, reps, options.cold));
  FW_ASSIGN_OR_RETURN(double torch_help_ms, MedianMs(torch, {"--help"}, reps, options.cold));
  FW_ASSIGN_OR_RETURN(double hash_ms, MedianMs(flywheel, {"checkpoint", "hash", checkpoint}, reps, options.cold));
  FW_ASSIGN_OR_RETURN(double torch_hash_ms, MedianMs(torch, {"checkpoint", "hash", checkpoint}, reps, options.cold));
  FW_ASSIGN_OR_RETURN(IdleRss idle, MeasureIdle(flywheel, work.path() + "/flywheel"));
  FW_ASSIGN_OR_RETURN(IdleRss torch_idle, MeasureIdle(torch, work.path() + "/flywheel-torch"));

  const double max_ms = options.cold ? kMaxColdStartMs : kMaxStartMs;
  const std::string cache = options.cold ? ", page cache dropped" : "";
  const std::string target_ms = "<= " + Fixed(max_ms, 0);
  Table table;
  table.header = {"measure", "flywheel", "flywheel-torch (before the split)", "ratio", "target"};
  table.rows = {
      {"--help, ms (median of " + std::to_string(reps) + cache + ")", Fixed(help_ms, 1),
       Fixed(torch_help_ms, 1), Ratio(torch_help_ms, help_ms), target_ms},
      {"checkpoint hash 1 MB, ms", Fixed(hash_ms, 1), Fixed(torch_hash_ms, 1),
       Ratio(torch_hash_ms, hash_ms), target_ms},
      {"idle publisher RSS, MB", Fixed(idle.publisher, 1), Fixed(torch_idle.publisher, 1),
       Ratio(torch_idle.publisher, idle.publisher), "-"},
      {"idle relay RSS, MB", Fixed(idle.relay, 1), Fixed(torch_idle.relay, 1),
       Ratio(torch_idle.relay, idle.relay), "<= 40"},
      {"idle model-less worker RSS, MB", Fixed(idle.worker, 1), Fixed(torch_idle.worker, 1),
       Ratio(torch_idle.worker, idle.worker), "<= 40"},
  };
  std::ostringstream floor;
  floor << "Peers, same run: /bin/true " << Fixed(true_ms, 1) << " ms, python3 -c pass "
        << Fixed(python_ms, 1) << " ms (median of " << reps << cache << ").\n";
  out << RenderText(table) << floor.str();
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Startup benchmark",
                                            "## Startup benchmark\n\n" + RenderMarkdown(table) +
                                                "\n" + floor.str()));
  }
  if (!options.check) return Status::Ok();
  std::vector<std::string> missed;
  if (help_ms > max_ms) missed.push_back("--help took " + Fixed(help_ms, 1) + " ms");
  if (hash_ms > max_ms) missed.push_back("checkpoint hash took " + Fixed(hash_ms, 1) + " ms");
  if (idle.relay > kMaxIdleRssMb) missed.push_back("idle relay holds " + Fixed(idle.relay, 1) + " MB");
  if (idle.worker > kMaxIdleRssMb) missed.push_back("idle worker holds " + Fixed(idle.worker, 1) + " MB");
  if (torch_help_ms <= help_ms || torch_idle.relay <= idle.relay) {
    missed.push_back("flywheel-torch is not slower or larger than flywheel: is libtorch linked there?");
  }
  if (missed.empty()) return Status::Ok();
  std::string text;
  for (const std::string& m : missed) text += (text.empty() ? "" : "; ") + m;
  return Status::Internal("startup targets missed: " + text);
}

}  // namespace flywheel::bench
