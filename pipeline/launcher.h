// Runs a pipeline-RL fleet on one machine as separate processes of the flywheel binary:
// the trainer (`flywheel train`: trainer + publisher + sample coordinator), one relay per
// region and the rollout workers (`flywheel worker --model ... --trainer ...`), on loopback
// ports chosen up front so that a restarted process comes back at the same address. The
// regions' WAN links are shaped by the publisher (fleet.wan_rate_mbit, wan_latency_ms);
// workers reach their region's relay and, should it die, the trainer's publisher directly.
//
// `flywheel demo` and `flywheel bench pipeline` drive it; the failure tests kill and
// restart its processes by name ("trainer", "relay-us", "worker-eu-1").
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"
#include "ops/process.h"
#include "pipeline/run_config.h"
#include "transport/tls.h"

namespace flywheel::pipeline {

struct FleetOptions {
  RunConfig config;
  std::string program;  // the flywheel binary
  std::string run_dir;  // run.toml, state/, report/, logs/
  std::string report_dir;  // default: <run_dir>/report
  std::string token;    // bearer token between the processes (generated when empty)
  // Set: every process serves and dials with TLS 1.3 from these files (--tls-cert,
  // --tls-key, --tls-ca: mutual authentication on every link, the trainer's coordinator
  // included), and status is read over https.
  transport::TlsOptions tls;
  // Set: a directory from `flywheel keys generate`: the trainer signs every version
  // (--signing-key), relays and workers verify (--trust-key).
  std::string signing_keys_dir;
  // Non-empty: the trainer runs on trainer_cpus, relays and workers on rollout_cpus
  // (disjoint roles, as on separate GPUs; ProcessGroup's StartOptions::cpus).
  std::vector<int> trainer_cpus, rollout_cpus;
};

class Fleet {
 public:
  // Starts every process and waits until each has bound its ports.
  static Result<std::unique_ptr<Fleet>> Start(FleetOptions options);
  ~Fleet();  // stops whatever still runs

  // Names: "trainer", "relay-<region>", "worker-<region>-<i>" (i from 1).
  std::vector<std::string> names() const;
  Status Kill(const std::string& name, int signal);
  // Starts `name` again with the same command line (the trainer resumes from its state).
  Status Restart(const std::string& name);
  bool Running(const std::string& name);

  // GET /v1/status of the trainer's coordinator, or of a worker.
  Result<nlohmann::json> TrainerStatus();
  Result<nlohmann::json> WorkerStatus(const std::string& name);
  // The trainer's coordinator endpoint (HOST:PORT).
  const std::string& trainer_http() const { return trainer_http_; }
  // The run's live dashboard, with its read-only token (pipeline/dashboard.h).
  const std::string& dashboard_url() const { return dashboard_url_; }

  // Copies the trainer's new stdout lines to `out`.
  void Echo(std::ostream& out);
  // Waits up to `timeout` for the trainer to exit by itself (Echoing meanwhile); OK when it
  // exited with status 0, else an error with its stderr's tail.
  Status WaitTrainer(std::chrono::milliseconds timeout, std::ostream* out);
  // Stops every process; returns the lines of those that did not stop cleanly.
  std::vector<std::string> Stop();

  const std::string& state_dir() const { return state_dir_; }
  const std::string& report_dir() const { return report_dir_; }
  const std::string& log_dir() const { return log_dir_; }

 private:
  struct Role {
    std::vector<std::string> args;
    size_t index = 0;  // in processes_
    std::string ready_file;
    std::string http;  // from the ready file
  };
  // What the trainer's ready file tells the other roles.
  struct TrainerReady {
    std::string publisher;  // host:port its publisher listens on
    std::string model_config;
    std::string tokenizer;
    int64_t max_sequence = 64;  // what a worker's engine must hold: prompt + completion
  };
  Fleet(FleetOptions options);
  std::string RunFile(const std::string& name) const;  // <run_dir>/name
  Status WriteRunFiles() const;
  Result<TrainerReady> StartTrainer();
  Status StartRegion(const std::string& region, const TrainerReady& trainer);
  Status Launch(const std::string& name, Role& role);

  FleetOptions options_;
  std::string state_dir_, report_dir_, log_dir_;
  ops::ProcessGroup processes_;
  std::map<std::string, Role> roles_;
  std::vector<std::string> order_;
  std::string trainer_http_;
  std::string dashboard_url_;
  size_t echoed_ = 0;  // bytes of the trainer's current stdout already echoed
  size_t echo_index_ = SIZE_MAX;
};

// The report of a finished run in `report_dir` (metrics.csv, summary.json): PNG plots via
// gnuplot (skipped with a note when it is missing) and the summary table, printed to `out`.
Status WriteReport(const std::string& report_dir, std::ostream& out);

}  // namespace flywheel::pipeline
