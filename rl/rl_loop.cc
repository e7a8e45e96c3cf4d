#include "rl/rl_loop.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <set>
#include <thread>

#include "delta/delta_file.h"
#include "delta/tensor.h"
#include "pipeline/coordinator.h"
#include "pipeline/task.h"
#include "rollout/engine.h"
#include "model/tokenizer.h"
#include "sync/publisher.h"
#include "sync/role.h"
#include "trainer/training_client.h"
#include "transport/http.h"

namespace flywheel::rl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;
using pipeline::RunConfig;
using trainer::AdamWParams;
using trainer::Aggregation;
using trainer::ComputeGroupAdvantages;
using trainer::ForwardOutput;
using trainer::GroupAdvantageOptions;
using trainer::GroupAdvantages;
using trainer::SamplerSnapshot;
using trainer::TrainerOptions;
using trainer::Datum;
using trainer::LossConfig;
using trainer::Metrics;
using trainer::TrainingClient;

std::atomic<bool> g_stop{false};
extern "C" void OnStopSignal(int) { g_stop = true; }

Result<model::ModelConfig> MakeModelConfig(const RunConfig& config, int64_t vocab) {
  if (!config.model.config.empty()) {
    FW_ASSIGN_OR_RETURN(model::ModelConfig loaded, model::ModelConfig::Load(config.model.config));
    if (loaded.vocab_size < vocab) {
      return Status::InvalidArgument("model.config " + config.model.config + " has vocab_size " +
                                     std::to_string(loaded.vocab_size) + ", the task needs " +
                                     std::to_string(vocab));
    }
    return loaded;
  }
  model::ModelConfig c = model::PipelineTinyConfig(vocab, config.model.preset == "tiny-moe");
  FW_RETURN_IF_ERROR(c.Validate());
  return c;
}

Status WriteFileAtomically(const fs::path& path, const std::string& text) {
  return delta::WriteFileAtomically(path.string(), std::as_bytes(std::span(text)));
}

// ---- datasets -----------------------------------------------------------------------------

// A rendered sequence: BOS, then every message's content (assistant turns end in EOS);
// weights[i] is the loss weight of predicting tokens[i].
Datum MakeDatum(const std::vector<int32_t>& sequence, const std::vector<float>& weights) {
  Datum d;
  d.tokens.assign(sequence.begin(), sequence.end() - 1);
  d.target_tokens.assign(sequence.begin() + 1, sequence.end());
  d.weights.assign(weights.begin() + 1, weights.end());
  return d;
}

Result<std::vector<json>> ReadJsonl(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read " + what + " " + path);
  std::vector<json> lines;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!value.is_object()) {
      return Status::InvalidArgument(what + " " + path + ":" + std::to_string(number) +
                                     ": not a JSON object");
    }
    value["__line"] = number;
    lines.push_back(std::move(value));
  }
  if (lines.empty()) return Status::InvalidArgument(what + " " + path + " has no examples");
  return lines;
}

// SFT examples in the OpenAI chat format: {"messages": [{"role", "content", "weight"}]};
// assistant messages weigh 1 unless given, the others 0.
Result<std::vector<Datum>> LoadSft(const std::string& path, const model::Tokenizer& tokenizer) {
  FW_ASSIGN_OR_RETURN(std::vector<json> lines, ReadJsonl(path, "sft.dataset"));
  std::vector<Datum> datums;
  for (const json& line : lines) {
    const std::string where = "sft.dataset " + path + ":" + std::to_string(line["__line"].get<int>());
    const json messages = line.value("messages", json());
    if (!messages.is_array() || messages.empty()) {
      return Status::InvalidArgument(where + ": needs a non-empty \"messages\" array");
    }
    std::vector<int32_t> sequence = {tokenizer.bos()};
    std::vector<float> weights = {0};
    double total = 0;
    for (const json& message : messages) {
      if (!message.is_object() || !message.contains("role") || !message["role"].is_string() ||
          !message.contains("content") || !message["content"].is_string()) {
        return Status::InvalidArgument(where + ": every message needs string role and content");
      }
      const std::string role = message["role"];
      if (role != "system" && role != "user" && role != "assistant") {
        return Status::InvalidArgument(where + ": unknown role '" + role + "'");
      }
      double weight = role == "assistant" ? 1.0 : 0.0;
      if (message.contains("weight")) {
        if (!message["weight"].is_number() || message["weight"].get<double>() < 0) {
          return Status::InvalidArgument(where + ": weight must be a number >= 0");
        }
        weight = message["weight"].get<double>();
      }
      Result<std::vector<int32_t>> ids = tokenizer.Encode(message["content"].get<std::string>());
      if (!ids.ok()) return Status::InvalidArgument(where + ": " + ids.status().message());
      if (role == "assistant") ids->push_back(tokenizer.eos());
      for (int32_t id : *ids) {
        sequence.push_back(id);
        weights.push_back(static_cast<float>(weight));
        total += weight;
      }
    }
    if (sequence.size() < 2 || total <= 0) {
      return Status::InvalidArgument(where + ": no token carries weight (no assistant message?)");
    }
    datums.push_back(MakeDatum(sequence, weights));
  }
  return datums;
}

// DPO pairs: {"prompt": text, "chosen": text, "rejected": text}; datums chosen, rejected.
Result<std::vector<Datum>> LoadDpo(const std::string& path, const model::Tokenizer& tokenizer) {
  FW_ASSIGN_OR_RETURN(std::vector<json> lines, ReadJsonl(path, "dpo.dataset"));
  std::vector<Datum> datums;
  for (const json& line : lines) {
    const std::string where = "dpo.dataset " + path + ":" + std::to_string(line["__line"].get<int>());
    for (const char* key : {"prompt", "chosen", "rejected"}) {
      if (!line.contains(key) || !line[key].is_string()) {
        return Status::InvalidArgument(where + ": needs string \"prompt\", \"chosen\" and \"rejected\"");
      }
    }
    Result<std::vector<int32_t>> prompt = tokenizer.Encode(line["prompt"].get<std::string>());
    if (!prompt.ok()) return Status::InvalidArgument(where + ": " + prompt.status().message());
    for (const char* key : {"chosen", "rejected"}) {
      Result<std::vector<int32_t>> answer = tokenizer.Encode(line[key].get<std::string>());
      if (!answer.ok()) return Status::InvalidArgument(where + ": " + answer.status().message());
      std::vector<int32_t> sequence = {tokenizer.bos()};
      sequence.insert(sequence.end(), prompt->begin(), prompt->end());
      std::vector<float> weights(sequence.size(), 0.0f);
      answer->push_back(tokenizer.eos());
      for (int32_t id : *answer) {
        sequence.push_back(id);
        weights.push_back(1.0f);
      }
      datums.push_back(MakeDatum(sequence, weights));
    }
  }
  return datums;
}

// ---- evaluation ---------------------------------------------------------------------------

// Greedy exact-match accuracy of the served policy (the trainer's weights rounded to bf16,
// as the workers hold them) on the held-out problems.
class Evaluator {
 public:
  Evaluator(const model::ModelConfig& config, std::vector<pipeline::Problem> problems,
            std::shared_ptr<const model::Tokenizer> tokenizer, int64_t max_tokens)
      : problems_(std::move(problems)), tokenizer_(std::move(tokenizer)), max_tokens_(max_tokens) {
    model_ = std::make_shared<model::TransformerImpl>(config);
    for (auto& p : model_->parameters()) p.set_requires_grad(false);
  }

  Result<double> Accuracy(model::TransformerImpl& policy) {
    {
      torch::NoGradGuard no_grad;
      auto source = policy.named_parameters();
      for (auto& item : model_->named_parameters()) {
        item.value().copy_(source[item.key()].to(torch::kBFloat16).to(torch::kFloat32));
      }
    }
    if (!engine_) {
      int64_t longest = 0;
      for (const auto& p : problems_) longest = std::max<int64_t>(longest, p.prompt.size());
      FW_ASSIGN_OR_RETURN(engine_, rollout::Engine::Create(model_, {64, longest + max_tokens_ + 2}, 1));
    }
    std::vector<rollout::GenerationRequest> requests;
    for (const auto& problem : problems_) {
      FW_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, tokenizer_->Encode(problem.prompt));
      prompt.insert(prompt.begin(), tokenizer_->bos());
      rollout::SamplingParams params;
      params.temperature = 0;
      params.max_tokens = max_tokens_;
      params.stop_tokens = {tokenizer_->eos()};
      requests.push_back({std::move(prompt), params, ""});
    }
    FW_ASSIGN_OR_RETURN(std::vector<rollout::GenerationResult> results,
                        engine_->Generate(std::move(requests)));
    size_t correct = 0;
    for (size_t i = 0; i < results.size(); ++i) {
      std::vector<int32_t> ids = results[i].tokens;
      if (!ids.empty() && ids.back() == tokenizer_->eos()) ids.pop_back();
      Result<std::string> text = tokenizer_->Decode(ids);
      if (text.ok() && *text == problems_[i].answer) ++correct;
    }
    return problems_.empty() ? 0.0 : static_cast<double>(correct) / problems_.size();
  }

 private:
  std::vector<pipeline::Problem> problems_;
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  int64_t max_tokens_;
  std::shared_ptr<model::TransformerImpl> model_;
  std::unique_ptr<rollout::Engine> engine_;
};

// ---- the per-step record ------------------------------------------------------------------

struct StepRow {
  uint64_t step = 0;
  uint64_t version = 0;
  double wall_s = 0;
  double mean_reward = 0;
  double eval_accuracy = -1;  // -1: not evaluated at this step
  double k3 = 0;
  double staleness_mean = 0;
  uint64_t staleness_max = 0;
  double delta_density = 0;
  uint64_t delta_bytes = 0;     // the version's delta artifact (compressed)
  uint64_t keyframe_bytes = 0;  // a keyframe written at this version too (every keyframe_every)
  uint64_t full_bytes = 0;
  uint64_t wan_bytes = 0;  // since the previous step
  double sync_ms = -1;     // the newest version all workers serve: publish -> last swap
  uint64_t sync_version = 0;
  uint64_t samples = 0;
  double samples_per_s = 0;
  uint64_t dropped_stale = 0;  // cumulative samples
  double loss = 0;
  double grad_norm = 0;
  double clip_fraction = 0;

  static const char* CsvHeader() {
    return "step,version,wall_s,mean_reward,eval_accuracy,k3,staleness_mean,staleness_max,"
           "delta_density,delta_bytes,full_bytes,wan_bytes,sync_ms,sync_version,samples,"
           "samples_per_s,dropped_stale,loss,grad_norm,clip_fraction,keyframe_bytes";
  }
  std::string Csv() const {
    std::ostringstream out;
    out.precision(6);
    out << step << ',' << version << ',' << wall_s << ',' << mean_reward << ',';
    if (eval_accuracy >= 0) out << eval_accuracy;
    out << ',' << k3 << ',' << staleness_mean << ',' << staleness_max << ',' << delta_density
        << ',' << delta_bytes << ',' << full_bytes << ',' << wan_bytes << ',';
    if (sync_ms >= 0) out << sync_ms;
    out << ',' << sync_version << ',' << samples << ',' << samples_per_s << ',' << dropped_stale
        << ',' << loss << ',' << grad_norm << ',' << clip_fraction << ',' << keyframe_bytes;
    return out.str();
  }
  json Json() const {
    return {{"step", step}, {"version", version}, {"wall_s", wall_s}, {"mean_reward", mean_reward},
            {"eval_accuracy", eval_accuracy}, {"k3", k3}, {"staleness_mean", staleness_mean},
            {"staleness_max", staleness_max}, {"delta_density", delta_density},
            {"delta_bytes", delta_bytes}, {"keyframe_bytes", keyframe_bytes}, {"full_bytes", full_bytes}, {"wan_bytes", wan_bytes},
            {"sync_ms", sync_ms}, {"sync_version", sync_version}, {"samples", samples},
            {"samples_per_s", samples_per_s}, {"dropped_stale", dropped_stale}, {"loss", loss},
            {"grad_norm", grad_norm}, {"clip_fraction", clip_fraction}};
  }
  static StepRow FromJson(const json& j) {
    StepRow r;
    r.step = j.value("step", uint64_t{0});
    r.version = j.value("version", uint64_t{0});
    r.wall_s = j.value("wall_s", 0.0);
    r.mean_reward = j.value("mean_reward", 0.0);
    r.eval_accuracy = j.value("eval_accuracy", -1.0);
    r.k3 = j.value("k3", 0.0);
    r.staleness_mean = j.value("staleness_mean", 0.0);
    r.staleness_max = j.value("staleness_max", uint64_t{0});
    r.delta_density = j.value("delta_density", 0.0);
    r.delta_bytes = j.value("delta_bytes", uint64_t{0});
    r.keyframe_bytes = j.value("keyframe_bytes", uint64_t{0});
    r.full_bytes = j.value("full_bytes", uint64_t{0});
    r.wan_bytes = j.value("wan_bytes", uint64_t{0});
    r.sync_ms = j.value("sync_ms", -1.0);
    r.sync_version = j.value("sync_version", uint64_t{0});
    r.samples = j.value("samples", uint64_t{0});
    r.samples_per_s = j.value("samples_per_s", 0.0);
    r.dropped_stale = j.value("dropped_stale", uint64_t{0});
    r.loss = j.value("loss", 0.0);
    r.grad_norm = j.value("grad_norm", 0.0);
    r.clip_fraction = j.value("clip_fraction", 0.0);
    return r;
  }
};

std::string HumanBytes(double bytes) {
  char text[32];
  if (bytes < 1024) std::snprintf(text, sizeof text, "%.0f B", bytes);
  else if (bytes < 1024 * 1024) std::snprintf(text, sizeof text, "%.1f KB", bytes / 1024);
  else std::snprintf(text, sizeof text, "%.1f MB", bytes / (1024 * 1024));
  return text;
}

std::string StepLine(const StepRow& r, int64_t max_staleness, double last_accuracy) {
  char line[320];
  char sync[32] = "    -";
  if (r.sync_ms >= 0) std::snprintf(sync, sizeof sync, "%5.0f ms (v%llu)", r.sync_ms,
                                    static_cast<unsigned long long>(r.sync_version));
  std::snprintf(line, sizeof line,
                "step %4llu  v%-4llu %6.1fs  reward %.3f  acc %s%.3f  k3 %.1e  stale %.2f/%llu (k=%lld)"
                "  delta %.2f%% %s  wan %s  sync %s",
                static_cast<unsigned long long>(r.step), static_cast<unsigned long long>(r.version),
                r.wall_s, r.mean_reward, r.eval_accuracy >= 0 ? " " : "~", last_accuracy, r.k3,
                r.staleness_mean, static_cast<unsigned long long>(r.staleness_max),
                static_cast<long long>(max_staleness), 100 * r.delta_density,
                HumanBytes(r.delta_bytes).c_str(), HumanBytes(r.wan_bytes).c_str(), sync);
  return line;
}

// The fraction of 16-bit words (the serving dtype's) that differ between two snapshots.
double ChangedFraction(const OwnedCheckpoint& before, const OwnedCheckpoint& after) {
  uint64_t changed = 0, total = 0;
  for (size_t t = 0; t < after.tensors.size() && t < before.tensors.size(); ++t) {
    const auto& a = before.tensors[t].data;
    const auto& b = after.tensors[t].data;
    if (a.size() != b.size()) continue;
    const uint16_t* x = reinterpret_cast<const uint16_t*>(a.data());
    const uint16_t* y = reinterpret_cast<const uint16_t*>(b.data());
    const size_t words = a.size() / 2;
    for (size_t i = 0; i < words; ++i) changed += x[i] != y[i];
    total += words;
  }
  return total == 0 ? 0.0 : static_cast<double>(changed) / total;
}

transport::awaitable<transport::HttpResponse> JsonAnswer(json answer) {
  co_return transport::HttpResponse{200, "application/json", answer.dump()};
}

}  // namespace

Result<std::string> ModelConfigJson(const RunConfig& config, int64_t vocab) {
  FW_ASSIGN_OR_RETURN(model::ModelConfig model_config, MakeModelConfig(config, vocab));
  return model_config.ToJson().dump(2);
}

Status RunTrainer(const TrainRunOptions& options) {
  const RunConfig& config = options.config;
  FW_RETURN_IF_ERROR(config.Validate());
  if (config.sft.steps > 0 && config.sft.dataset.empty()) {
    return Status::InvalidArgument("sft.steps = " + std::to_string(config.sft.steps) +
                                   " needs sft.dataset (a JSONL file of chat examples)");
  }
  if (config.dpo.steps > 0 && config.dpo.dataset.empty()) {
    return Status::InvalidArgument("dpo.steps = " + std::to_string(config.dpo.steps) +
                                   " needs dpo.dataset (a JSONL file of preference pairs)");
  }
  if (options.state_dir.empty() || options.report_dir.empty()) {
    return Status::InvalidArgument("the trainer needs a state directory and a report directory");
  }
  const fs::path state_dir = options.state_dir;
  const fs::path report_dir = options.report_dir;
  std::error_code ec;
  fs::create_directories(state_dir, ec);
  fs::create_directories(report_dir, ec);
  if (ec) return Status::IOError("cannot create " + state_dir.string() + " or " + report_dir.string());

  FW_ASSIGN_OR_RETURN(std::unique_ptr<pipeline::Task> task, pipeline::Task::Create(config.task));
  FW_ASSIGN_OR_RETURN(std::unique_ptr<model::CharTokenizer> char_tokenizer,
                      model::CharTokenizer::Create(task->alphabet()));
  std::shared_ptr<const model::Tokenizer> tokenizer = std::move(char_tokenizer);
  FW_ASSIGN_OR_RETURN(model::ModelConfig model_config,
                      MakeModelConfig(config, tokenizer->vocab_size()));
  const fs::path model_config_path = state_dir / "config.json";
  FW_RETURN_IF_ERROR(WriteFileAtomically(model_config_path, model_config.ToJson().dump(2)));
  const bool moe = model_config.num_experts > 0;
  const int64_t max_tokens = task->max_answer_chars() + 1;

  TrainerOptions trainer_options;
  trainer_options.config = model_config;
  trainer_options.seed = static_cast<uint64_t>(config.run.seed);
  trainer_options.threads = static_cast<int>(config.run.threads);
  FW_ASSIGN_OR_RETURN(std::unique_ptr<TrainingClient> client,
                      TrainingClient::Create(trainer_options));

  // Resume?
  const fs::path trainer_state = state_dir / "trainer";
  const fs::path progress_path = state_dir / "progress.json";
  json progress = json::object();
  std::vector<StepRow> rows;
  if (fs::exists(progress_path)) {
    std::ifstream in(progress_path);
    progress = json::parse(in, nullptr, false);
    if (!progress.is_object() || !fs::exists(trainer_state)) {
      return Status::Corruption(progress_path.string() + " is unreadable or " +
                                trainer_state.string() + " is missing: start with a fresh state dir");
    }
    FW_RETURN_IF_ERROR(client->LoadState(trainer_state.string()));
    for (const json& row : progress.value("rows", json::array())) rows.push_back(StepRow::FromJson(row));
  }
  const bool resumed = progress.contains("version");

  // The publisher (in process) and the coordinator's HTTP endpoint, on one I/O thread.
  transport::asio::io_context io(1);
  auto work = transport::asio::make_work_guard(io);
  sync::PublisherOptions publisher_options;
  publisher_options.common.region = "home";
  publisher_options.common.node_id = "trainer";
  FW_ASSIGN_OR_RETURN(publisher_options.common.http, transport::ParseEndpoint(options.publisher_http));
  publisher_options.common.token = options.token;
  publisher_options.common.wan_rate = config.fleet.wan_rate_mbit * 1e6 / 8;
  publisher_options.common.wan_latency_ms = config.fleet.wan_latency_ms;
  FW_ASSIGN_OR_RETURN(publisher_options.listen, transport::ParseEndpoint(options.listen));
  publisher_options.log.dir = (state_dir / "versions").string();
  publisher_options.log.keyframe_every = static_cast<uint64_t>(config.fleet.keyframe_every);
  publisher_options.log.retain = 2 * static_cast<uint64_t>(config.fleet.keyframe_every);
  publisher_options.max_staleness = static_cast<uint64_t>(config.pipeline.max_staleness);
  FW_ASSIGN_OR_RETURN(std::unique_ptr<sync::Publisher> publisher,
                      sync::Publisher::Start(io.get_executor(), publisher_options));
  client->AttachPublisher(publisher.get());

  pipeline::CoordinatorOptions coordinator_options;
  coordinator_options.group_size = config.algorithm.group_size;
  coordinator_options.groups_per_step = config.algorithm.groups_per_step;
  coordinator_options.max_staleness = config.pipeline.max_staleness;
  coordinator_options.lease = std::chrono::milliseconds(static_cast<int64_t>(config.pipeline.lease_s * 1000));
  coordinator_options.temperature = config.algorithm.temperature;
  coordinator_options.max_tokens = max_tokens;
  coordinator_options.vocab_size = tokenizer->vocab_size();
  coordinator_options.max_prompt_tokens = 1 + task->max_prompt_chars();  // BOS + prompt
  coordinator_options.moe_layers = model_config.NumMoeLayers();
  coordinator_options.top_k = model_config.num_experts_per_tok;
  coordinator_options.num_experts = model_config.num_experts;
  coordinator_options.seed = static_cast<uint64_t>(config.run.seed) * 7919 + rows.size();
  pipeline::Coordinator coordinator(*task, coordinator_options);

  std::mutex status_mutex;
  json status = {{"role", "trainer"}, {"step", 0}, {"version", 0}, {"phase", "starting"}};
  transport::HttpServerOptions http_options;
  http_options.token = options.token;
  FW_ASSIGN_OR_RETURN(transport::Endpoint http_endpoint, transport::ParseEndpoint(options.http));
  FW_ASSIGN_OR_RETURN(std::unique_ptr<transport::HttpServer> http,
                      transport::HttpServer::Start(io.get_executor(), http_endpoint, http_options));
  pipeline::Coordinator* coordinator_ptr = &coordinator;
  http->RoutePost("/v1/rollout/claim", [coordinator_ptr](std::string, std::string body) {
    json request = json::parse(body, nullptr, false);
    return JsonAnswer(coordinator_ptr->Claim(request));
  });
  http->RoutePost(
      "/v1/rollout/submit",
      [coordinator_ptr](std::string, std::string body) {
        json request = json::parse(body, nullptr, false);
        return JsonAnswer(coordinator_ptr->Submit(request));
      },
      64 << 20);
  http->Route("/v1/status", [&status_mutex, &status, coordinator_ptr](const std::string&) {
    json answer;
    {
      std::lock_guard lock(status_mutex);
      answer = status;
    }
    // The coordinator's counters live (the rest is as of the last step).
    const pipeline::CoordinatorStats stats = coordinator_ptr->stats();
    answer["claims"] = stats.claims;
    answer["groups_accepted"] = stats.groups_accepted;
    answer["groups_trained"] = stats.groups_trained;
    answer["samples_dropped_stale"] = stats.samples_dropped_stale;
    answer["leases_expired"] = stats.leases_expired;
    answer["submissions_refused"] = stats.submissions_refused;
    answer["groups_by_worker"] = stats.groups_by_worker;
    answer["leases_by_worker"] = stats.leases_by_worker;
    answer["queued_groups"] = coordinator_ptr->queued();
    return transport::HttpResponse{200, "application/json", answer.dump()};
  });
  std::thread io_thread([&io] { io.run(); });
  struct Joiner {
    transport::asio::io_context& io;
    std::unique_ptr<transport::HttpServer>& http;
    std::unique_ptr<sync::Publisher>& publisher;
    std::thread& thread;
    decltype(work)& guard;
    ~Joiner() {
      std::promise<void> stopped;
      transport::asio::post(io, [&] {
        http->Stop();
        stopped.set_value();
      });
      stopped.get_future().wait_for(std::chrono::seconds(5));
      publisher->Stop();
      guard.reset();
      io.stop();
      if (thread.joinable()) thread.join();
    }
  } joiner{io, http, publisher, io_thread, work};
  const auto publisher_status = [&]() -> json {
    std::promise<json> answer;
    transport::asio::post(io, [&] { answer.set_value(publisher->StatusJson()); });
    return answer.get_future().get();
  };

  if (!options.ready_file.empty()) {
    const json ready = {{"listen", "127.0.0.1:" + std::to_string(publisher->port())},
                        {"http", "127.0.0.1:" + std::to_string(http->port())},
                        {"publisher_http", "127.0.0.1:" + std::to_string(publisher->http_port())},
                        {"model_config", model_config_path.string()},
                        {"tokenizer", "chars:" + task->alphabet()}};
    FW_RETURN_IF_ERROR(WriteFileAtomically(options.ready_file, ready.dump()));
  }
  std::signal(SIGINT, OnStopSignal);
  std::signal(SIGTERM, OnStopSignal);
  const auto say = [&](const std::string& line) {
    if (!options.quiet) {
      std::cout << line << std::endl;
    }
  };
  const auto set_phase = [&](const std::string& phase) {
    std::lock_guard lock(status_mutex);
    status["phase"] = phase;
  };

  const Clock::time_point started = Clock::now();
  const double wall_before = progress.value("wall_s", 0.0);
  const auto wall = [&] {
    return wall_before + std::chrono::duration<double>(Clock::now() - started).count();
  };
  Evaluator evaluator(model_config, task->HeldOut(static_cast<size_t>(config.run.eval_prompts), 4242),
                      tokenizer, max_tokens);
  const std::string algorithm = config.algorithm.name;
  const bool dapo = algorithm == "dapo";
  LossConfig loss_config;
  std::string loss_name = "ppo";
  loss_config.aggregation = Aggregation::kSeqMeanTokenMean;
  if (dapo) loss_config.aggregation = Aggregation::kTokenMean;
  if (algorithm == "gspo") loss_name = "gspo";
  if (algorithm == "cispo") {
    loss_name = "cispo";
    loss_config.aggregation = Aggregation::kTokenMean;
  }
  loss_config.clip_low = config.algorithm.clip_low;
  loss_config.clip_high = config.algorithm.clip_high;
  loss_config.tis_cap = config.algorithm.tis_cap;
  AdamWParams adam;
  adam.lr = config.algorithm.lr;
  adam.weight_decay = config.algorithm.weight_decay;
  adam.grad_clip = config.algorithm.grad_clip;

  uint64_t version = progress.value("version", uint64_t{0});
  double initial_accuracy = progress.value("initial_accuracy", -1.0);
  double warmup_accuracy = progress.value("warmup_accuracy", -1.0);
  double last_accuracy = progress.value("last_accuracy", -1.0);
  double time_to_target = progress.value("time_to_target_s", -1.0);
  OwnedCheckpoint previous;
  const auto save_progress = [&]() -> Status {
    json rows_json = json::array();
    for (const StepRow& row : rows) rows_json.push_back(row.Json());
    progress["version"] = version;
    progress["wall_s"] = wall();
    progress["initial_accuracy"] = initial_accuracy;
    progress["warmup_accuracy"] = warmup_accuracy;
    progress["last_accuracy"] = last_accuracy;
    progress["time_to_target_s"] = time_to_target;
    progress["rows"] = std::move(rows_json);
    FW_RETURN_IF_ERROR(client->SaveState(trainer_state.string()));
    return WriteFileAtomically(progress_path, progress.dump());
  };
  const auto publish = [&](uint64_t new_version) -> Result<SamplerSnapshot> {
    const int64_t at = static_cast<int64_t>(sync::UnixMicrosNow());
    coordinator.NotePublished(new_version, at);
    FW_ASSIGN_OR_RETURN(SamplerSnapshot snapshot, client->SaveWeightsForSampler(new_version));
    version = new_version;
    coordinator.SetVersion(version);
    return snapshot;
  };

  if (!resumed) {
    set_phase("warm-up");
    FW_ASSIGN_OR_RETURN(initial_accuracy, evaluator.Accuracy(client->model()));
    say("untrained policy: held-out accuracy " + std::to_string(initial_accuracy) + " on " +
        std::to_string(config.run.eval_prompts) + " prompts (" + config.task.name + ", " +
        std::to_string(config.task.digits) + " digits)");
    if (config.sft.steps > 0) {
      FW_ASSIGN_OR_RETURN(std::vector<Datum> examples, LoadSft(config.sft.dataset, *tokenizer));
      AdamWParams sft_adam = adam;
      sft_adam.lr = config.sft.lr;
      std::mt19937_64 rng(static_cast<uint64_t>(config.run.seed));
      for (int64_t step = 0; step < config.sft.steps && !g_stop; ++step) {
        std::vector<Datum> batch;
        for (int64_t i = 0; i < config.sft.batch_size; ++i) batch.push_back(examples[rng() % examples.size()]);
        FW_ASSIGN_OR_RETURN(Metrics fb, client->ForwardBackward(batch, "cross_entropy"));
        FW_RETURN_IF_ERROR(client->OptimStep(sft_adam).status());
        if ((step + 1) % 10 == 0 || step + 1 == config.sft.steps) {
          char line[128];
          std::snprintf(line, sizeof line, "sft  %4lld/%lld  loss %.4f", static_cast<long long>(step + 1),
                        static_cast<long long>(config.sft.steps), fb.loss);
          say(line);
        }
      }
    }
    if (config.dpo.steps > 0) {
      FW_ASSIGN_OR_RETURN(std::vector<Datum> pairs, LoadDpo(config.dpo.dataset, *tokenizer));
      FW_ASSIGN_OR_RETURN(ForwardOutput reference, client->Forward(pairs));
      for (size_t i = 0; i < pairs.size(); ++i) pairs[i].ref_logprobs = reference.logprobs[i];
      AdamWParams dpo_adam = adam;
      dpo_adam.lr = config.dpo.lr;
      LossConfig dpo_config;
      dpo_config.dpo_beta = config.dpo.beta;
      std::mt19937_64 rng(static_cast<uint64_t>(config.run.seed) + 1);
      const size_t pair_count = pairs.size() / 2;
      for (int64_t step = 0; step < config.dpo.steps && !g_stop; ++step) {
        std::vector<Datum> batch;
        for (int64_t i = 0; i < config.dpo.batch_size; ++i) {
          const size_t p = rng() % pair_count;
          batch.push_back(pairs[2 * p]);
          batch.push_back(pairs[2 * p + 1]);
        }
        FW_ASSIGN_OR_RETURN(Metrics fb, client->ForwardBackward(batch, "dpo", dpo_config));
        FW_RETURN_IF_ERROR(client->OptimStep(dpo_adam).status());
        if ((step + 1) % 10 == 0 || step + 1 == config.dpo.steps) {
          char line[128];
          std::snprintf(line, sizeof line, "dpo  %4lld/%lld  loss %.4f", static_cast<long long>(step + 1),
                        static_cast<long long>(config.dpo.steps), fb.loss);
          say(line);
        }
      }
    }
    FW_ASSIGN_OR_RETURN(warmup_accuracy, evaluator.Accuracy(client->model()));
    last_accuracy = warmup_accuracy;
    if (config.sft.steps > 0 || config.dpo.steps > 0) {
      say("after warm-up: held-out accuracy " + std::to_string(warmup_accuracy));
    }
    // Version 1, or above what an earlier attempt published before it could save progress.
    FW_ASSIGN_OR_RETURN(SamplerSnapshot first, publish(publisher->version() + 1));
    previous = std::move(first.checkpoint);
    FW_RETURN_IF_ERROR(save_progress());
  } else {
    // Resumed: make sure the publisher serves the restored version.
    const uint64_t published = publisher->version();
    const uint64_t restored = version;
    if (published < restored) {
      FW_ASSIGN_OR_RETURN(SamplerSnapshot snapshot, publish(restored));
      previous = std::move(snapshot.checkpoint);
    } else if (published > restored) {
      // The state is older than what was published (a crash between them): go on above it.
      FW_ASSIGN_OR_RETURN(SamplerSnapshot snapshot, publish(published + 1));
      previous = std::move(snapshot.checkpoint);
    } else {
      // Already served; the first step after the resume reports no density (no baseline).
      coordinator.SetVersion(version);
    }
    say("resumed after optimizer step " + std::to_string(client->step()) + ", version " + std::to_string(version) +
        " (" + std::to_string(rows.size()) + " RL steps done)");
  }

  // ---- the RL loop ----
  set_phase("rl");
  uint64_t wan_before = publisher_status().value("wan_bytes_out", uint64_t{0});
  Clock::time_point last_step_time = Clock::now();
  Clock::time_point last_report = Clock::now();
  bool reached = time_to_target >= 0;
  Status failure = Status::Ok();
  double last_sync_ms = -1;
  uint64_t last_sync_version = 0;
  while (!g_stop && static_cast<int64_t>(rows.size()) < config.run.max_steps &&
         wall() < config.run.time_limit_s && !reached) {
    // A full batch; after 30 s without one, whatever arrived (a fleet smaller than a batch).
    const bool partial = Clock::now() - last_step_time > std::chrono::seconds(30);
    std::vector<pipeline::Group> groups =
        coordinator.TakeBatch(Clock::now() + std::chrono::seconds(1), partial);
    if (groups.empty()) {
      if (Clock::now() - last_report > std::chrono::seconds(15)) {
        say("waiting for samples: " + std::to_string(coordinator.queued()) + " of " +
            std::to_string(config.algorithm.groups_per_step) + " groups queued");
        last_report = Clock::now();
      }
      continue;
    }
    // Build the batch.
    std::vector<double> rewards;
    for (const auto& g : groups) {
      for (const auto& s : g.samples) rewards.push_back(s.reward);
    }
    GroupAdvantageOptions advantage_options;
    advantage_options.drop_all_equal = dapo;
    FW_ASSIGN_OR_RETURN(GroupAdvantages advantages,
                        ComputeGroupAdvantages(rewards, static_cast<size_t>(config.algorithm.group_size),
                                               advantage_options));
    std::vector<Datum> datums;
    double staleness_sum = 0;
    uint64_t staleness_max = 0, staleness_tokens = 0;
    size_t index = 0;
    for (const auto& g : groups) {
      for (const auto& s : g.samples) {
        const size_t i = index++;
        for (uint64_t v : s.versions) {
          const uint64_t lag = version > v ? version - v : 0;
          staleness_sum += static_cast<double>(lag);
          staleness_max = std::max(staleness_max, lag);
          ++staleness_tokens;
        }
        if (!advantages.keep[i]) continue;
        std::vector<int32_t> full = s.prompt_tokens;
        full.insert(full.end(), s.tokens.begin(), s.tokens.end());
        const size_t length = full.size() - 1;
        const size_t first = s.prompt_tokens.size() - 1;
        Datum d;
        d.tokens.assign(full.begin(), full.end() - 1);
        d.target_tokens.assign(full.begin() + 1, full.end());
        d.weights.assign(length, 0.0f);
        d.logprobs.assign(length, 0.0f);
        d.advantages.assign(length, static_cast<float>(advantages.advantages[i]));
        d.policy_versions.assign(length, s.versions.front());
        for (size_t j = 0; j < s.tokens.size(); ++j) {
          d.weights[first + j] = 1.0f;
          d.logprobs[first + j] = s.logprobs[j];
          d.policy_versions[first + j] = s.versions[j];
        }
        if (moe && config.model.routing_replay && !s.routing.empty()) d.routing = s.routing;
        datums.push_back(std::move(d));
      }
    }
    StepRow row;
    row.step = rows.size() + 1;
    row.samples = rewards.size();
    double reward_sum = 0;
    for (double r : rewards) reward_sum += r;
    row.mean_reward = rewards.empty() ? 0 : reward_sum / rewards.size();
    row.staleness_mean = staleness_tokens ? staleness_sum / staleness_tokens : 0;
    row.staleness_max = staleness_max;
    if (!datums.empty()) {
      Result<Metrics> fb = client->ForwardBackward(datums, loss_name, loss_config);
      if (!fb.ok()) {
        failure = fb.status().WithContext("forward_backward at step " + std::to_string(row.step));
        break;
      }
      row.loss = fb->loss;
      row.k3 = fb->kl_sampler_k3;
      row.clip_fraction = fb->clip_fraction;
      Result<Metrics> step = client->OptimStep(adam);
      if (!step.ok()) {
        failure = step.status().WithContext("optim_step");
        break;
      }
      row.grad_norm = step->grad_norm;
    }
    // Publish the new version; the state follows (a crash in between resumes from the
    // previous state and publishes above the lost version).
    const uint64_t new_version = version + 1;
    const bool save_now = static_cast<int64_t>(row.step) % config.run.state_every == 0;
    Result<SamplerSnapshot> snapshot = publish(new_version);
    if (!snapshot.ok()) {
      failure = snapshot.status().WithContext("publishing version " + std::to_string(new_version));
      break;
    }
    row.version = version;
    row.full_bytes = snapshot->bytes;
    if (!previous.tensors.empty()) row.delta_density = ChangedFraction(previous, snapshot->checkpoint);
    previous = std::move(snapshot->checkpoint);
    const json pub = publisher_status();
    row.delta_bytes = snapshot->published_delta_bytes;
    row.keyframe_bytes = snapshot->published_keyframe_bytes;
    const uint64_t wan_now = pub.value("wan_bytes_out", uint64_t{0});
    row.wan_bytes = wan_now - std::min(wan_now, wan_before);
    wan_before = wan_now;
    for (const auto& synced : coordinator.TakeSynced()) {
      last_sync_ms = synced.ms;
      last_sync_version = synced.version;
    }
    row.sync_ms = last_sync_ms;
    row.sync_version = last_sync_version;
    const pipeline::CoordinatorStats stats = coordinator.stats();
    row.dropped_stale = stats.samples_dropped_stale;
    const Clock::time_point now = Clock::now();
    row.samples_per_s = row.samples / std::max(1e-6, std::chrono::duration<double>(now - last_step_time).count());
    last_step_time = now;
    if (static_cast<int64_t>(row.step) % config.run.eval_every == 0) {
      Result<double> accuracy = evaluator.Accuracy(client->model());
      if (!accuracy.ok()) {
        failure = accuracy.status().WithContext("evaluation");
        break;
      }
      row.eval_accuracy = *accuracy;
      last_accuracy = *accuracy;
      if (config.run.target_accuracy > 0 && *accuracy >= config.run.target_accuracy) {
        reached = true;
        time_to_target = wall();
      }
    }
    row.wall_s = wall();
    rows.push_back(row);
    say(StepLine(row, config.pipeline.max_staleness, last_accuracy));
    {
      std::lock_guard lock(status_mutex);
      status["step"] = row.step;
      status["version"] = version;
      status["accuracy"] = last_accuracy;
      status["mean_reward"] = row.mean_reward;
      status["resumed"] = resumed;
    }
    if (save_now || reached) {
      Status saved = save_progress();
      if (!saved.ok()) {
        failure = saved.WithContext("saving the trainer state");
        break;
      }
    }
  }
  coordinator.Finish();
  set_phase(failure.ok() ? "done" : "failed");
  FW_RETURN_IF_ERROR(failure);
  FW_RETURN_IF_ERROR(save_progress());

  // ---- report ----
  std::ofstream csv(report_dir / "metrics.csv", std::ios::trunc);
  csv << StepRow::CsvHeader() << "\n";
  for (const StepRow& row : rows) csv << row.Csv() << "\n";
  csv.close();
  const pipeline::CoordinatorStats stats = coordinator.stats();
  double k3_sum = 0, delta_sum = 0, sync_sum = 0, stale_sum = 0;
  uint64_t max_stale = 0, syncs = 0, wan_total = 0, samples_total = 0;
  std::set<uint64_t> sync_versions;
  for (const StepRow& row : rows) {
    k3_sum += row.k3;
    delta_sum += static_cast<double>(row.delta_bytes);
    stale_sum += row.staleness_mean;
    max_stale = std::max(max_stale, row.staleness_max);
    wan_total += row.wan_bytes;
    samples_total += row.samples;
    if (row.sync_ms >= 0 && sync_versions.insert(row.sync_version).second) {
      sync_sum += row.sync_ms;
      ++syncs;
    }
  }
  const double n = std::max<double>(1, rows.size());
  const json summary = {
      {"task", config.task.name + "-" + std::to_string(config.task.digits)},
      {"algorithm", config.algorithm.name},
      {"model", config.model.config.empty() ? config.model.preset : config.model.config},
      {"parameters", [&] {
         int64_t count = 0;
         for (const auto& p : client->model().parameters()) count += p.numel();
         return count;
       }()},
      {"initial_accuracy", initial_accuracy},
      {"warmup_accuracy", warmup_accuracy},
      {"final_accuracy", last_accuracy},
      {"target_accuracy", config.run.target_accuracy},
      {"reached_target", reached},
      {"time_to_target_s", time_to_target},
      {"wall_seconds", wall()},
      {"steps", rows.size()},
      {"versions", version},
      {"samples", samples_total},
      {"max_staleness_allowed", config.pipeline.max_staleness},
      {"max_staleness_observed", max_stale},
      {"mean_staleness", stale_sum / n},
      {"mean_k3", k3_sum / n},
      {"delta_bytes_mean", delta_sum / n},
      {"full_bytes", rows.empty() ? 0 : rows.back().full_bytes},
      {"wan_bytes_total", wan_total},
      {"workers", config.fleet.regions.size() * config.fleet.workers_per_region},
      {"regions", config.fleet.regions.size()},
      {"sync_ms_mean", syncs ? sync_sum / syncs : -1.0},
      {"samples_dropped_stale", stats.samples_dropped_stale},
      {"leases_expired", stats.leases_expired},
      {"submissions_refused", stats.submissions_refused},
      {"resumed", resumed},
  };
  FW_RETURN_IF_ERROR(WriteFileAtomically(report_dir / "summary.json", summary.dump(2)));
  return Status::Ok();
}

}  // namespace flywheel::rl
