// `flywheel publish`, `flywheel relay`, `flywheel worker`: the weight-sync roles.
//
// Each runs until SIGINT or SIGTERM, logging at info level to stderr (-v: debug).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "push/push_api.h"
#ifdef FLYWHEEL_WITH_TORCH
#include "rollout/worker_engine.h"
#endif
#include "sync/publisher.h"
#include "sync/relay.h"
#include "sync/worker.h"
#include "transport/io_pool.h"
#include "tools/commands.h"

namespace flywheel::tools {
namespace {

namespace asio = transport::asio;

struct CommonArgs {
  std::string region;
  std::string node_id;
  std::string http;
  TokenFlags tokens;
  transport::TlsOptions tls;
  std::string ready_file;
  double wan_rate = 0;
  double wan_latency_ms = 0;
  int threads = 1;
  int heartbeat_ms = 1000;
  int peer_timeout_ms = 5000;
  std::vector<std::string> trust_keys;
};

struct SyncArgs {
  CommonArgs common;
  std::string listen;
  std::vector<std::string> upstreams;
  // publish
  std::string state_dir, watch_dir;
  uint64_t keyframe_every = 10, retain = 20, piece_kib = 1024, max_staleness = 0;
  double keyframe_cost = 1.0;
  int poll_ms = 50;
  bool no_deltas = false;
  bool buffered_deltas = false;
  bool context_coding = false;
  std::string compressor = "zstd";
  std::string push_token, push_token_file, staging_dir, signing_key;
  uint64_t max_upload_mib = 64 << 10, staging_quota_mib = 128 << 10, max_part_mib = 64;
  double upload_expiry_s = 3600;
  // relay / worker
  int streams = 4, window = 8;
  // publish / relay: threads serving downstream connections (TLS sealing, socket writes)
  int egress_threads = DefaultThreads();
  std::string export_dir;
  int export_keep = 2;
  // worker: the rollout engine
  std::string model;
  int64_t max_batch = 32, max_sequence = 1024;
  bool share_prefixes = true;
  int64_t prefix_slots = -1;
  int64_t prefill_chunk = 256;
  std::string reasoning_parser;
  std::string tokenizer = "auto";
  std::string served_model_name;
  std::vector<std::string> adapters;
  // worker: the pipeline-RL actor
  std::string trainer;
  int64_t actor_groups = 8;
};

void AddCommonOptions(CLI::App* app, CommonArgs& args, bool region_required) {
  auto* region =
      app->add_option("--region", args.region, "Region this node runs in")->type_name("R");
  if (region_required) region->required();
  app->add_option("--node-id", args.node_id,
                  "Name in status and fleet views (default: <role>-<region>-<host>-<pid>)")
      ->type_name("ID");
  app->add_option("--http", args.http,
                  "Where to serve GET /v1/status, /metrics and /healthz (port 0: any free port)")
      ->type_name("HOST:PORT")
      ->required();
  AddTokenFlags(app, args.tokens,
                "Bearer token required of peers and HTTP clients (all routes but /healthz)\n"
                "and presented upstream");
  AddScopedTokenFlag(app, args.tokens,
                     "A further HTTP token with its own scopes, SCOPES:FILE; scopes are read,\n"
                     "sample, submit, push, admin (e.g. read:dashboard.token gives a dashboard\n"
                     "status and metrics only). Repeatable. --token grants read, sample and\n"
                     "submit; the publisher's push token read, push and admin (admin only if no\n"
                     "scoped token has it). A token without a route's scope gets 403");
  AddTlsFlags(app, args.tls, "TLS certificate chain (PEM); turns TLS 1.3 on",
              "CA bundle that peers are verified against; a server with it requires\n"
              "client certificates (mutual authentication)");
  app->add_option("--ready-file", args.ready_file,
                  "Write {\"listen\":..., \"http\":...} here once the ports are bound")
      ->type_name("F");
  app->add_option("--wan-rate", args.wan_rate,
                  "Shape WAN links to this many bytes/s (token bucket; 0: unlimited)")
      ->type_name("BYTES_PER_S")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--wan-latency-ms", args.wan_latency_ms, "Add this one-way latency on WAN links")
      ->type_name("MS")
      ->check(CLI::Range(0.0, 60000.0));
  app->add_option("--threads", args.threads, "CPU threads for encoding, hashing and applying")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app->add_option("--heartbeat-ms", args.heartbeat_ms, "Heartbeat interval on idle links")
      ->type_name("MS")
      ->capture_default_str()
      ->check(CLI::Range(50, 60000));
  app->add_option("--peer-timeout-ms", args.peer_timeout_ms,
                  "Drop a peer silent (no data, no heartbeat) this long")
      ->type_name("MS")
      ->capture_default_str()
      ->check(CLI::Range(200, 600000));
}

Result<sync::CommonOptions> MakeCommon(const CommonArgs& args) {
  sync::CommonOptions common;
  common.region = args.region;
  common.node_id = args.node_id;
  FW_ASSIGN_OR_RETURN(common.http, transport::ParseEndpoint(args.http));
  FW_ASSIGN_OR_RETURN(common.token, ResolveToken(args.tokens, TokenFallback::kEnvironment));
  FW_ASSIGN_OR_RETURN(common.scoped_tokens, ReadScopedTokens(args.tokens.scoped));
  common.tls = args.tls;
  common.ready_file = args.ready_file;
  common.wan_rate = args.wan_rate;
  common.wan_latency_ms = args.wan_latency_ms;
  common.threads = args.threads;
  common.connection.heartbeat = std::chrono::milliseconds(args.heartbeat_ms);
  common.connection.idle_timeout = std::chrono::milliseconds(args.peer_timeout_ms);
  common.connection.io_timeout = std::chrono::milliseconds(2 * args.peer_timeout_ms);
  common.trust_keys = args.trust_keys;
  return common;
}

Result<std::vector<transport::Endpoint>> ParseUpstreams(const std::vector<std::string>& texts) {
  std::vector<transport::Endpoint> endpoints;
  for (const std::string& text : texts) {
    FW_ASSIGN_OR_RETURN(transport::Endpoint endpoint, transport::ParseEndpoint(text));
    endpoints.push_back(endpoint);
  }
  return endpoints;
}

constexpr std::chrono::milliseconds kWorkerLeaveLinger{200};

// Runs `io` until SIGINT/SIGTERM, then calls stop and lets the role wind down for `grace`.
void RunUntilSignalled(asio::io_context& io, const std::function<void()>& stop,
                       std::chrono::milliseconds grace = std::chrono::milliseconds(100)) {
  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](const transport::error_code& ec, int signal) {
    if (ec) return;
    spdlog::info("signal {}: stopping", signal);
    stop();
    auto timer = std::make_shared<asio::steady_timer>(io, grace);
    timer->async_wait([&io, timer](const transport::error_code&) { io.stop(); });
  });
  io.run();
}

// A publisher's or relay's downstream connections run on an egress pool (--egress-threads,
// transport/io_pool.h): each connection on a strand of it, so that TLS records are sealed
// and written on up to `threads` cores. Once the network loop stopped, the pool is shut
// down (its threads joined, its handlers destroyed) while the loop still exists: those
// handlers hold the loop's work and the role coroutines that await them; the loop goes
// next, the pool's context last (the loop's handlers may hold the pool's work).
Status CheckEgressThreads(const char* role, int threads) {
  if (threads >= 1) return Status::Ok();
  return Status::InvalidArgument(std::string(role) + ": --egress-threads must be 1 or more (got " +
                                 std::to_string(threads) + ")");
}

void AddEgressOption(CLI::App* app, SyncArgs& args) {
  app->add_option("--egress-threads", args.egress_threads,
                  "Threads that serve downstream connections (TLS sealing and socket\n"
                  "writes; each connection keeps its order on one of them at a time)")
      ->type_name("N")
      ->capture_default_str();
}

void UseInfoLogging() {
  if (spdlog::get_level() == spdlog::level::off) spdlog::set_level(spdlog::level::info);
}

Status RunPublish(const SyncArgs& args) {
  UseInfoLogging();
  sync::PublisherOptions options;
  FW_ASSIGN_OR_RETURN(options.common, MakeCommon(args.common));
  FW_ASSIGN_OR_RETURN(options.listen, transport::ParseEndpoint(args.listen));
  options.log.dir = args.state_dir;
  options.log.keyframe_every = args.keyframe_every;
  options.log.keyframe_cost = args.keyframe_cost;
  options.log.retain = args.retain;
  options.log.deltas = !args.no_deltas;
  options.log.stream_deltas = !args.buffered_deltas;
  options.log.piece_bytes = args.piece_kib << 10;
  options.log.threads = args.common.threads;
  FW_ASSIGN_OR_RETURN(options.log.compressor, delta::ParseCompressor(args.compressor));
  options.log.context_coding = args.context_coding;
  options.watch_dir = args.watch_dir;
  options.poll = std::chrono::milliseconds(args.poll_ms);
  options.max_staleness = args.max_staleness;
  sync::PushOptions push;  // the push API (push/push_api.h)
  push.token = args.push_token;
  if (!args.push_token_file.empty()) {
    FW_ASSIGN_OR_RETURN(push.token, ReadTokenFile(args.push_token_file, "--push-token-file"));
  }
  if (options.watch_dir.empty() && push.token.empty()) {
    return Status::InvalidArgument(
        "publish: nothing to publish from: give --watch DIR, --push-token-file F, or both");
  }
  if (!push.token.empty() && push.token == options.common.token) {
    return Status::InvalidArgument("publish: the push token must differ from the read token");
  }
  options.signing_key = args.signing_key;
  push.staging_dir = args.staging_dir;
  push.max_upload_bytes = args.max_upload_mib << 20;
  push.staging_quota_bytes = args.staging_quota_mib << 20;
  push.max_part_bytes = args.max_part_mib << 20;
  push.upload_expiry =
      std::chrono::milliseconds(static_cast<int64_t>(args.upload_expiry_s * 1000));
  sync::EnablePushApi(options, std::move(push));
  FW_RETURN_IF_ERROR(CheckEgressThreads("publish", args.egress_threads));
  transport::IoPool egress(args.egress_threads, "egress");
  options.common.egress = egress.executor();
  asio::io_context io(1);
  Result<std::unique_ptr<sync::Publisher>> publisher =
      sync::Publisher::Start(io.get_executor(), options);
  if (!publisher.ok()) {
    egress.Shutdown();
    return Failed("publish", publisher.status());
  }
  RunUntilSignalled(io, [&] { (*publisher)->Stop(); });
  egress.Shutdown();
  return Status::Ok();
}

Status RunRelay(const SyncArgs& args) {
  UseInfoLogging();
  sync::RelayOptions options;
  FW_ASSIGN_OR_RETURN(options.common, MakeCommon(args.common));
  FW_ASSIGN_OR_RETURN(options.listen, transport::ParseEndpoint(args.listen));
  FW_ASSIGN_OR_RETURN(options.upstreams, ParseUpstreams(args.upstreams));
  options.streams = args.streams;
  options.window = args.window;
  FW_RETURN_IF_ERROR(CheckEgressThreads("relay", args.egress_threads));
  transport::IoPool egress(args.egress_threads, "egress");
  options.common.egress = egress.executor();
  asio::io_context io(1);
  Result<std::unique_ptr<sync::Relay>> relay = sync::Relay::Start(io.get_executor(), options);
  if (!relay.ok()) {
    egress.Shutdown();
    return Failed("relay", relay.status());
  }
  RunUntilSignalled(io, [&] { (*relay)->Stop(); });
  egress.Shutdown();
  return Status::Ok();
}

Status RunWorker(const SyncArgs& args) {
  UseInfoLogging();
  sync::WorkerOptions options;
  FW_ASSIGN_OR_RETURN(options.common, MakeCommon(args.common));
  FW_ASSIGN_OR_RETURN(options.upstreams, ParseUpstreams(args.upstreams));
  options.export_dir = args.export_dir;
  options.export_keep = args.export_keep;
  options.streams = args.streams;
  options.window = args.window;
  // SIGTERM: the worker leaves (downloads closed, its upstream forgets it at once) and says
  // "leaving" in /v1/status for this long before the process exits.
  options.leave_linger = kWorkerLeaveLinger;
#ifdef FLYWHEEL_WITH_TORCH
  std::unique_ptr<rollout::WorkerEngine> engine;
  if (!args.model.empty()) {
    rollout::WorkerEngineOptions engine_options;
    engine_options.model_config = args.model;
    engine_options.max_batch = args.max_batch;
    engine_options.max_sequence = args.max_sequence;
    engine_options.share_prefixes = args.share_prefixes;
    engine_options.prefix_slots = args.prefix_slots;
    engine_options.prefill_chunk = args.prefill_chunk;
    engine_options.reasoning_parser = args.reasoning_parser;
    engine_options.tokenizer = args.tokenizer;
    engine_options.model_name = args.served_model_name;
    for (const std::string& adapter : args.adapters) {
      const size_t eq = adapter.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == adapter.size()) {
        return Failed("worker",
                      Status::InvalidArgument("--adapter '" + adapter + "' is not NAME=PATH"));
      }
      engine_options.adapters.emplace_back(adapter.substr(0, eq), adapter.substr(eq + 1));
    }
    if (!args.trainer.empty()) {
      engine_options.trainer = args.trainer;
      engine_options.trainer_token = options.common.token;
      engine_options.trainer_tls = options.common.tls;
      engine_options.worker_id = args.common.node_id.empty()
                                     ? "worker-" + args.common.region + "-" + std::to_string(::getpid())
                                     : args.common.node_id;
      engine_options.actor_groups = args.actor_groups;
    }
    Result<std::unique_ptr<rollout::WorkerEngine>> created =
        rollout::WorkerEngine::Create(engine_options);
    if (!created.ok()) return Failed("worker", created.status());
    engine = std::move(*created);
    rollout::WorkerEngine* raw = engine.get();
    options.on_swap = [raw](const sync::SwapEvent& event) { return raw->OnSwap(event); };
    options.configure_http = [raw](transport::HttpServer& server) { raw->Register(server); };
    options.extend_status = [raw](nlohmann::json& status) { raw->AddStatus(status); };
  }
#else
  if (!args.model.empty()) return TorchOnly("worker --model");
#endif
  asio::io_context io(1);
  Result<std::unique_ptr<sync::Worker>> worker = sync::Worker::Start(io.get_executor(), options);
  if (!worker.ok()) return Failed("worker", worker.status());
#ifdef FLYWHEEL_WITH_TORCH
  if (engine) engine->Attach(worker->get());
  RunUntilSignalled(io, [&] { (*worker)->Stop(); }, kWorkerLeaveLinger + std::chrono::milliseconds(50));
  engine.reset();  // its steps may hold the worker's weights lock: it goes first
#else
  RunUntilSignalled(io, [&] { (*worker)->Stop(); }, kWorkerLeaveLinger + std::chrono::milliseconds(50));
#endif
  return Status::Ok();
}

void AddTrustOptions(CLI::App* app, SyncArgs& args) {
  app->add_option("--trust-key", args.common.trust_keys,
                  "Only cache, forward or apply versions signed by this public key\n"
                  "(signing.pub from `flywheel keys generate`); repeat to trust several\n"
                  "(key rotation). Unsigned or wrongly signed versions are refused, logged\n"
                  "and counted (signature_failures_total in /v1/status and /metrics)")
      ->type_name("F");
}

void AddTransferOptions(CLI::App* app, SyncArgs& args) {
  app->add_option("--upstream", args.upstreams,
                  "Upstream HOST:PORT (publisher or relay); repeat for failover, most\n"
                  "preferred first")
      ->type_name("HOST:PORT")
      ->required();
  app->add_option("--streams", args.streams, "Parallel data streams per transfer")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app->add_option("--window", args.window, "Piece requests in flight per stream")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
}

void AddPushOptions(CLI::App* publish, SyncArgs& args) {
  publish->add_option("--push-token", args.push_token,
                      "Bearer token of the push API (uploads, pin, unpin; docs/PUSH_API.md);\n"
                      "without one the publisher takes no pushes")
      ->type_name("T");
  publish->add_option("--push-token-file", args.push_token_file, "Read the push token from this file")
      ->type_name("F")
      ->excludes("--push-token");
  publish->add_option("--staging-dir", args.staging_dir,
                      "Where uploads are staged (default: <state-dir>/uploads; emptied at start)")
      ->type_name("DIR");
  publish->add_option("--max-upload-mib", args.max_upload_mib, "Largest upload accepted")
      ->type_name("MIB")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30));
  publish->add_option("--staging-quota-mib", args.staging_quota_mib,
                      "Declared sizes of all staged uploads together at most this")
      ->type_name("MIB")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32));
  publish->add_option("--max-part-mib", args.max_part_mib,
                      "Largest part (one PUT) accepted; a part is held in memory while it is written")
      ->type_name("MIB")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{16384}));
  publish->add_option("--upload-expiry-s", args.upload_expiry_s,
                      "Remove an upload idle (no part, no state request) this long")
      ->type_name("S")
      ->capture_default_str()
      ->check(CLI::Range(0.05, 30.0 * 86400));
}

void AddPublish(CLI::App& app, std::shared_ptr<SyncArgs> args, Action& action) {
  CLI::App* publish = app.add_subcommand(
      "publish",
      "Serve policy versions to relays and workers (the trainer side).\n"
      "Keeps a version log under --state-dir (a keyframe every K versions, deltas between,\n"
      "the newest N retained; it survives restarts and a version is never reused) and\n"
      "publishes every committed drop <watch>/<version>/ (model.safetensors or shards plus\n"
      "model.safetensors.index.json, then an empty COMMIT file written last). A malformed\n"
      "drop is rejected with a logged reason; the last good version stays served.\n"
      "With --push-token-file, trainers anywhere push checkpoints or deltas over HTTP\n"
      "(`flywheel push`, the Python package), and pin/unpin roll the fleet back; every\n"
      "version is in the ledger (GET /v1/versions). See docs/PUSH_API.md.");
  AddCommonOptions(publish, args->common, /*region_required=*/false);
  publish->get_option("--region")
      ->description(
          "Region of the publisher (default: home); links to\nother regions are the WAN links that "
          "--wan-rate shapes");
  publish->add_option("--listen", args->listen, "Where relays and workers connect (port 0: any)")
      ->type_name("HOST:PORT")
      ->required();
  publish->add_option("--state-dir", args->state_dir, "Version log directory (created if missing)")
      ->type_name("DIR")
      ->required();
  publish->add_option("--watch", args->watch_dir, "Directory of trainer drops to publish")
      ->type_name("DIR");
  AddPushOptions(publish, *args);
  publish
      ->add_option("--signing-key", args->signing_key,
                   "Sign every version with this Ed25519 private key (mode 0600; from\n"
                   "`flywheel keys generate`), for relays and workers started with --trust-key")
      ->type_name("F");
  publish
      ->add_option("--keyframe-cost", args->keyframe_cost,
                   "Also a keyframe when the deltas since the last one add up to more than\n"
                   "this fraction of a keyframe (what a joining worker would fetch); 0: off")
      ->type_name("FRACTION")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1000.0));
  publish->add_option("--keyframe-every", args->keyframe_every, "A keyframe every K versions")
      ->type_name("K")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32));
  publish
      ->add_option("--retain", args->retain,
                   "Versions kept in the log (plus the latest keyframe's chain)")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32));
  publish->add_flag("--no-deltas", args->no_deltas,
                    "Keyframes only: every version is a full checkpoint (the baseline)");
  publish->add_flag("--buffered-deltas", args->buffered_deltas,
                    "Serve a delta only once it is wholly encoded (format-1 containers). By\n"
                    "default each piece is served as soon as it is encoded, so relays and\n"
                    "workers fetch and decode while the publisher still encodes");
  publish->add_option("--piece-kib", args->piece_kib, "Transfer unit (verified piece) in KiB")
      ->type_name("KIB")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{4}, uint64_t{65536}));
  publish->add_option("--compressor", args->compressor, "Chunk compressor: zstd, lz4 or none")
      ->capture_default_str();
  publish->add_flag("--context-coding", args->context_coding,
                    "Code deltas conditioned on the base words (chunk kind 3): ~30% smaller\n"
                    "bf16 deltas, 15-18% smaller FP8 ones, but encode and apply take 2-2.6x\n"
                    "the CPU; for fleets whose links, not cores, bound the sync");
  publish
      ->add_option("--max-staleness", args->max_staleness,
                   "Versions a node may lag before its status says stale (0: no bound)")
      ->type_name("N")
      ->capture_default_str();
  publish->add_option("--poll-ms", args->poll_ms, "How often the watched directory is scanned")
      ->type_name("MS")
      ->capture_default_str()
      ->check(CLI::Range(5, 60000));
  publish->footer(
      "\nExample:\n"
      "  flywheel publish --listen 0.0.0.0:7000 --http 0.0.0.0:7080 --state-dir /var/lib/fw \\\n"
      "      --watch /checkpoints/drops --token-file /etc/fw/token");
  publish->callback([args, &action] { action = [args] { return RunPublish(*args); }; });
}

void AddRelay(CLI::App& app, std::shared_ptr<SyncArgs> args, Action& action) {
  CLI::App* relay = app.add_subcommand(
      "relay",
      "Cache and fan out versions within one region.\n"
      "Subscribes upstream once (failing over between --upstream addresses in order) and\n"
      "serves the workers of its region from its cache, so WAN bytes are paid once per\n"
      "region. Deltas are fetched when announced, keyframes when first asked for.");
  AddCommonOptions(relay, args->common, /*region_required=*/true);
  relay->add_option("--listen", args->listen, "Where the region's workers connect")
      ->type_name("HOST:PORT")
      ->required();
  AddTransferOptions(relay, *args);
  AddTrustOptions(relay, *args);
  relay->footer(
      "\nExample:\n"
      "  flywheel relay --region eu --upstream trainer.example:7000 --listen 0.0.0.0:7100 \\\n"
      "      --http 0.0.0.0:7180 --wan-rate 125000000");
  relay->callback([args, &action] { action = [args] { return RunRelay(*args); }; });
}

// The engine's tuning flags of `flywheel worker --model`.
void AddEngineTuning(CLI::App* worker, SyncArgs& args) {
  worker
      ->add_option("--prefix-slots", args.prefix_slots,
                   "Engine: cache slots keeping finished requests' prefixes for later prompts\n"
                   "(an episode's next turn, a shared system prompt), least recently used\n"
                   "evicted; -1: max-batch / 4; 0: share only prefixes of requests in flight")
      ->capture_default_str()
      ->check(CLI::Range(-1, 4096));
  worker
      ->add_option("--prefill-chunk", args.prefill_chunk,
                   "Engine: a prompt arriving while others decode is prefilled this many tokens\n"
                   "per decode step, so running requests are not stalled by a long prompt; 0: whole")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  worker
      ->add_option("--reasoning-parser", args.reasoning_parser,
                   "Chat answers: move the model's reasoning into reasoning_content (streamed and\n"
                   "whole): qwen3 (answers that open with <think>) or deepseek_r1 (the template\n"
                   "opened it: reasoning until </think>)")
      ->check(CLI::IsMember({"", "none", "qwen3", "deepseek_r1", "deepseek-r1"}));
  worker->add_flag("!--no-prefix-sharing", args.share_prefixes,
                   "Engine: prefill every prompt whole (no shared prefixes; for comparisons)");
}

void AddWorker(CLI::App& app, std::shared_ptr<SyncArgs> args, Action& action) {
  CLI::App* worker = app.add_subcommand(
      "worker",
      "Hold the serving weights in memory and keep them at the newest version.\n"
      "Applies the delta chain from its version (or the newest keyframe and the deltas\n"
      "after it), verifying every piece and the target hash, and swaps atomically.");
  AddCommonOptions(worker, args->common, /*region_required=*/true);
  AddTransferOptions(worker, *args);
  AddTrustOptions(worker, *args);
  worker
      ->add_option("--export-dir", args->export_dir,
                   "After every swap write the weights to DIR/v<version>.safetensors\n"
                   "(temporary name, then rename), for an external inference engine")
      ->type_name("DIR");
  worker->add_option("--export-keep", args->export_keep, "Exports kept in --export-dir")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  worker
      ->add_option("--model", args->model,
                   "Run the rollout engine: the model's config.json (its weights are the served\n"
                   "versions); serves POST /v1/completions on --http, follows every swap in flight")
      ->type_name("CONFIG");
  worker->add_option("--max-batch", args->max_batch, "Engine: requests decoded together")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  worker
      ->add_option("--max-sequence", args->max_sequence,
                   "Engine: prompt + generated tokens per request")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  AddEngineTuning(worker, *args);
  worker
      ->add_option("--tokenizer", args->tokenizer,
                   "Engine: auto (the HF tokenizer.json beside --model's config.json, else\n"
                   "bytes), byte, chars:<alphabet>, or the path of a tokenizer.json (or its folder)")
      ->capture_default_str();
  worker
      ->add_option("--served-model-name", args->served_model_name,
                   "Engine: the model name /v1/models lists and answers carry (default: flywheel)")
      ->type_name("NAME");
  worker
      ->add_option("--adapter", args->adapters,
                   "Engine: a LoRA adapter NAME=PATH (adapters-only safetensors); repeatable")
      ->type_name("NAME=PATH");
  worker
      ->add_option("--trainer", args->trainer,
                   "Pipeline RL: claim prompts from this trainer (its --http), sample groups,\n"
                   "score them and stream them back (needs --model)")
      ->type_name("HOST:PORT")
      ->needs("--model");
  worker->add_option("--actor-groups", args->actor_groups, "Pipeline RL: groups claimed at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  worker->footer(
      "\nExample:\n"
      "  flywheel worker --region eu --upstream relay-eu:7100 --upstream trainer.example:7000 \\\n"
      "      --http 0.0.0.0:7280 --export-dir /dev/shm/policy");
  MarkTorchOnly(worker, "--model");
  worker->callback([args, &action] { action = [args] { return RunWorker(*args); }; });
}

}  // namespace

void AddSyncCommands(CLI::App& app, Action& action) {
  // One SyncArgs for the three roles: CLI11 runs only the chosen subcommand's callback.
  auto args = std::make_shared<SyncArgs>();
  AddPublish(app, args, action);
  AddRelay(app, args, action);
  AddWorker(app, args, action);
  AddEgressOption(app.get_subcommand("publish"), *args);
  AddEgressOption(app.get_subcommand("relay"), *args);
}

}  // namespace flywheel::tools
