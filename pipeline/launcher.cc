#include "pipeline/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <sstream>

#include "base/env.h"
#include "base/json.h"
#include "pipeline/dashboard.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
constexpr std::chrono::seconds kReadyTimeout{60};

Result<json> GetJson(const std::string& endpoint_text, const std::string& token,
                     const transport::TlsOptions& tls) {
  FW_ASSIGN_OR_RETURN(transport::Endpoint endpoint, transport::ParseEndpoint(endpoint_text));
  transport::HttpGetOptions options;
  options.token = token;
  if (tls.enabled()) {
    FW_ASSIGN_OR_RETURN(options.tls, transport::MakeClientTlsContext(tls));
  }
  options.timeout = std::chrono::milliseconds(3000);
  FW_ASSIGN_OR_RETURN(transport::HttpResponse response,
                      transport::HttpGet(endpoint, "/v1/status", options));
  if (response.status != 200) {
    return Status::Unavailable("GET http://" + endpoint_text + "/v1/status: HTTP " +
                               std::to_string(response.status));
  }
  Result<json> body = ParseJson(response.body, "GET /v1/status");
  if (!body.ok() || !body->is_object()) return Status::Corruption("GET /v1/status: not a JSON object");
  return body;
}

}  // namespace

Fleet::Fleet(FleetOptions options)
    : options_(std::move(options)),
      state_dir_((fs::path(options_.run_dir) / "state").string()),
      report_dir_(options_.report_dir.empty() ? (fs::path(options_.run_dir) / "report").string()
                                              : options_.report_dir),
      log_dir_((fs::path(options_.run_dir) / "logs").string()),
      processes_(log_dir_) {}

Fleet::~Fleet() { (void)Stop(); }

Result<std::unique_ptr<Fleet>> Fleet::Start(FleetOptions options) {
  FW_RETURN_IF_ERROR(options.config.Validate());
  if (options.token.empty()) {
    std::random_device device;
    std::ostringstream token;
    token << std::hex << device() << device() << device() << device();
    options.token = token.str();
  }
  std::unique_ptr<Fleet> fleet(new Fleet(options));
  std::error_code ec;
  for (const std::string& dir : {fleet->state_dir_, fleet->report_dir_, fleet->log_dir_}) {
    fs::create_directories(dir, ec);
    if (ec) return Status::IOError("cannot create " + dir + ": " + ec.message());
  }
  FW_RETURN_IF_ERROR(fleet->WriteRunFiles());
  // The workers' engines run one thread each: the machine's cores are shared by all.
  ::setenv("OMP_NUM_THREADS", "1", 1);
  FW_ASSIGN_OR_RETURN(TrainerReady trainer, fleet->StartTrainer());
  for (const std::string& region : options.config.fleet.regions) {
    FW_RETURN_IF_ERROR(fleet->StartRegion(region, trainer));
  }
  for (const std::string& name : fleet->order_) {
    Role& role = fleet->roles_[name];
    FW_ASSIGN_OR_RETURN(json role_ready, ops::AwaitReadyFile(fleet->processes_, role.ready_file, name,
                                                        kReadyTimeout));
    role.http = role_ready.value("http", "");
  }
  return fleet;
}

std::string Fleet::RunFile(const std::string& name) const {
  return (fs::path(options_.run_dir) / name).string();
}

// run.toml (every key, so that `flywheel demo --config` takes it back) replaced atomically;
// the token readable by its owner only from the moment it exists.
Status Fleet::WriteRunFiles() const {
  const std::string toml =
      "# The run's configuration (every key; `flywheel demo --config` takes it back).\n" +
      options_.config.ToToml();
  FW_RETURN_IF_ERROR(WriteFileAtomically(RunFile("run.toml"), std::as_bytes(std::span(toml))));
  const std::string token_file = RunFile("token");
  const int fd = ::open(token_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return ErrnoStatus("cannot create", token_file, errno);
  const std::string line = options_.token + "\n";
  const bool written = ::fchmod(fd, 0600) == 0 &&
                       ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  const int error = errno;
  ::close(fd);
  if (!written) return ErrnoStatus("cannot write", token_file, error != 0 ? error : EIO);
  return Status::Ok();
}

// The trainer, on ports fixed up front (see FreePort): the relays and workers start before
// its ready file says where it listens, and a restarted trainer comes back at the same ports.
Result<Fleet::TrainerReady> Fleet::StartTrainer() {
  FW_ASSIGN_OR_RETURN(const uint16_t listen_port, ops::FreePort());
  FW_ASSIGN_OR_RETURN(const uint16_t http_port, ops::FreePort());
  TrainerReady ready;
  ready.publisher = "127.0.0.1:" + std::to_string(listen_port);
  trainer_http_ = "127.0.0.1:" + std::to_string(http_port);
  Role trainer;
  trainer.ready_file = RunFile("trainer.ready");
  trainer.args = {"train", "--config", RunFile("run.toml"), "--state", state_dir_, "--report",
                  report_dir_, "--listen", ready.publisher, "--http", trainer_http_,
                  "--token-file", RunFile("token"), "--ready-file", trainer.ready_file,
                  "--local-fleet"};
  roles_["trainer"] = trainer;
  order_.push_back("trainer");
  FW_RETURN_IF_ERROR(Launch("trainer", roles_["trainer"]));
  FW_ASSIGN_OR_RETURN(json document,
                      ops::AwaitReadyFile(processes_, trainer.ready_file, "trainer", kReadyTimeout));
  ready.model_config = document.value("model_config", "");
  FW_ASSIGN_OR_RETURN(const std::string dashboard_token,
                      DashboardToken((fs::path(state_dir_) / "dashboard.token").string()));
  dashboard_url_ = DashboardUrl(trainer_http_, dashboard_token, options_.tls.enabled());
  ready.tokenizer = document.value("tokenizer", "");
  ready.max_sequence = std::max<int64_t>(ready.max_sequence, document.value("max_sequence", int64_t{0}));
  return ready;
}

// A region's relay (upstream: the trainer's publisher) and its workers (upstreams: the
// relay, then the publisher).
Status Fleet::StartRegion(const std::string& region, const TrainerReady& trainer) {
  const RunConfig& config = options_.config;
  // Each worker claims its share of a batch at a time (at most what its engine batches), so
  // that a batch spreads over the fleet, in synchronous mode too.
  const int64_t workers = static_cast<int64_t>(config.fleet.regions.size()) * config.fleet.workers_per_region;
  const int64_t actor_groups = std::clamp<int64_t>(
      (config.algorithm.groups_per_step + workers - 1) / workers, 1,
      std::max<int64_t>(1, config.fleet.worker_max_batch / config.algorithm.group_size));
  FW_ASSIGN_OR_RETURN(const uint16_t relay_port, ops::FreePort());
  const std::string relay_listen = "127.0.0.1:" + std::to_string(relay_port);
  const std::string token_file = RunFile("token");
  const std::string name = "relay-" + region;
  Role relay;
  relay.ready_file = RunFile(name + ".ready");
  relay.args = {"relay", "--region", region, "--node-id", name, "--listen", relay_listen,
                "--http", "127.0.0.1:0", "--upstream", trainer.publisher, "--token-file", token_file,
                "--ready-file", relay.ready_file};
  roles_[name] = relay;
  order_.push_back(name);
  FW_RETURN_IF_ERROR(Launch(name, roles_[name]));
  for (int64_t i = 1; i <= config.fleet.workers_per_region; ++i) {
    const std::string worker_name = "worker-" + region + "-" + std::to_string(i);
    Role worker;
    worker.ready_file = RunFile(worker_name + ".ready");
    worker.args = {"worker", "--region", region, "--node-id", worker_name,
                   "--upstream", relay_listen, "--upstream", trainer.publisher,
                   "--http", "127.0.0.1:0", "--token-file", token_file,
                   "--ready-file", worker.ready_file, "--model", trainer.model_config,
                   "--tokenizer", trainer.tokenizer, "--trainer", trainer_http_,
                   "--max-batch", std::to_string(config.fleet.worker_max_batch),
                   "--max-sequence", std::to_string(trainer.max_sequence),
                   "--actor-groups", std::to_string(actor_groups)};
    roles_[worker_name] = worker;
    order_.push_back(worker_name);
    FW_RETURN_IF_ERROR(Launch(worker_name, roles_[worker_name]));
  }
  return Status::Ok();
}

Status Fleet::Launch(const std::string& name, Role& role) {
  std::error_code ec;
  fs::remove(role.ready_file, ec);
  // A restart logs to <name>.restart<n>.{out,err} (ProcessGroup's naming).
  std::vector<std::string> args = role.args;
  if (!options_.signing_keys_dir.empty()) {
    const fs::path keys(options_.signing_keys_dir);
    if (name == "trainer") {
      args.insert(args.end(), {"--signing-key", (keys / "signing.key").string()});
    } else {
      args.insert(args.end(), {"--trust-key", (keys / "signing.pub").string()});
    }
  }
  if (options_.tls.enabled()) {
    args.insert(args.end(), {"--tls-cert", options_.tls.cert_file, "--tls-key", options_.tls.key_file});
    if (!options_.tls.ca_file.empty()) args.insert(args.end(), {"--tls-ca", options_.tls.ca_file});
  }
  ops::StartOptions start;
  start.cpus = name == "trainer" ? options_.trainer_cpus : options_.rollout_cpus;
  FW_ASSIGN_OR_RETURN(role.index, processes_.Start(name, options_.program, args, start));
  if (name == "trainer") {
    echo_index_ = role.index;
    echoed_ = 0;
  }
  return Status::Ok();
}

std::vector<std::string> Fleet::names() const { return order_; }

Status Fleet::Kill(const std::string& name, int signal) {
  auto it = roles_.find(name);
  if (it == roles_.end()) return Status::NotFound("no process named " + name);
  const size_t index = it->second.index;
  if (!processes_.Signal(index, signal).ok()) return Status::Ok();  // already gone
  // Reap it, so that Running() is false at once; a signal it survives is the caller's choice.
  (void)ops::WaitUntil([&] { return !processes_.running(index); }, std::chrono::seconds(5),
                  name + " to end after signal " + std::to_string(signal));
  return Status::Ok();
}

Status Fleet::Restart(const std::string& name) {
  auto it = roles_.find(name);
  if (it == roles_.end()) return Status::NotFound("no process named " + name);
  if (processes_.running(it->second.index)) return Status::InvalidArgument(name + " still runs; kill it first");
  FW_RETURN_IF_ERROR(Launch(name, it->second));
  FW_ASSIGN_OR_RETURN(json ready, ops::AwaitReadyFile(processes_, it->second.ready_file, name,
                                                 kReadyTimeout, it->second.index));
  it->second.http = ready.value("http", "");
  return Status::Ok();
}

bool Fleet::Running(const std::string& name) {
  auto it = roles_.find(name);
  return it != roles_.end() && processes_.running(it->second.index);
}

Result<json> Fleet::TrainerStatus() {
  FW_ASSIGN_OR_RETURN(std::string token, ops::ReadWholeFile((fs::path(options_.run_dir) / "token").string()));
  while (!token.empty() && (token.back() == '\n')) token.pop_back();
  return GetJson(trainer_http_, token, options_.tls);
}

Result<json> Fleet::WorkerStatus(const std::string& name) {
  auto it = roles_.find(name);
  if (it == roles_.end()) return Status::NotFound("no process named " + name);
  return GetJson(it->second.http, options_.token, options_.tls);
}

void Fleet::Echo(std::ostream& out) {
  if (echo_index_ == SIZE_MAX) return;
  std::ifstream in(processes_.stdout_path(echo_index_), std::ios::binary);
  if (!in) return;
  in.seekg(static_cast<std::streamoff>(echoed_));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t end = text.rfind('\n');
  if (end == std::string::npos) return;
  out << text.substr(0, end + 1) << std::flush;
  echoed_ += end + 1;
}

Status Fleet::WaitTrainer(std::chrono::milliseconds timeout, std::ostream* out) {
  const size_t index = roles_["trainer"].index;
  const Status finished = ops::WaitUntil(
      [&] {
        if (out) Echo(*out);
        return !processes_.running(index);
      },
      timeout, "the trainer to finish", std::chrono::milliseconds(100));
  if (out) Echo(*out);
  FW_RETURN_IF_ERROR(finished);
  FW_ASSIGN_OR_RETURN(int wait_status, processes_.Wait(index, std::chrono::milliseconds(0)));
  if (WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) return Status::Ok();
  return processes_.CheckRunning(index);
}

std::vector<std::string> Fleet::Stop() { return processes_.StopAll(); }

}  // namespace flywheel::pipeline
