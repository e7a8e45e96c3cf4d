#include "bench/training_api_bench.h"

#include <boost/asio.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <random>
#include <thread>

#include "bench/stats.h"
#include "bench/util.h"
#include "model/model_config.h"
#include "pipeline/task.h"
#include "service/training_service.h"
#include "service/training_wire.h"
#include "testing/local_http_server.h"
#include "trainer/training_client.h"
#include "transport/http.h"

namespace flywheel::bench {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}


// The demo's batch: 8 groups x 8 samples, BOS + 6-digit prompt + ">" then 6 answer digits +
// EOS (15 tokens; loss on the answer), sampling logprobs near uniform, group advantages.
std::vector<trainer::Datum> DemoBatch(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<trainer::Datum> out;
  for (int g = 0; g < 8; ++g) {
    for (int s = 0; s < 8; ++s) {
      std::vector<int32_t> seq = {static_cast<int32_t>(vocab - 2)};
      for (int i = 0; i < 6; ++i) seq.push_back(static_cast<int32_t>(rng() % 10));
      seq.push_back(12);
      for (int i = 0; i < 6; ++i) seq.push_back(static_cast<int32_t>(rng() % 10));
      seq.push_back(static_cast<int32_t>(vocab - 1));
      trainer::Datum d;
      d.tokens.assign(seq.begin(), seq.end() - 1);
      d.target_tokens.assign(seq.begin() + 1, seq.end());
      const float advantage = (s % 2 ? 1.0f : -1.0f) * (0.5f + 0.1f * g);
      for (size_t t = 0; t < d.tokens.size(); ++t) {
        d.weights.push_back(t >= 7 ? 1.0f : 0.0f);
        d.logprobs.push_back(-std::log(static_cast<float>(vocab)) + 0.05f * ((rng() % 21) - 10.0f) / 10.0f);
        d.advantages.push_back(advantage);
      }
      out.push_back(std::move(d));
    }
  }
  return out;
}

class LoopbackService {
 public:
  static Result<std::unique_ptr<LoopbackService>> Start(service::TrainingServiceOptions options) {
    auto self = std::unique_ptr<LoopbackService>(new LoopbackService());
    FW_ASSIGN_OR_RETURN(self->service_,
                        service::TrainingService::Create(std::move(options), nullptr));
    service::TrainingService* service = self->service_.get();
    FW_ASSIGN_OR_RETURN(self->http_, testing::LocalHttpServer::Start([service](
                                         transport::HttpServer& http) { service->Register(http); }));
    self->endpoint_ = self->http_->endpoint();
    return self;
  }
  // The server stops before the service goes; the io thread after both.
  ~LoopbackService() {
    if (http_) http_->Stop();
    service_.reset();
  }
  // POST; the body of a 2xx answer, else the error.
  Result<std::string> Post(const std::string& target, const std::string& body,
                           const std::string& type = "application/json") {
    transport::HttpGetOptions options;
    options.timeout = std::chrono::seconds(300);
    FW_ASSIGN_OR_RETURN(transport::HttpResponse r,
                        transport::HttpCall(endpoint_, "POST", target, body, options, type));
    if (r.status / 100 != 2) return Status::Internal("POST " + target + ": " + std::to_string(r.status) + " " + r.body);
    return r.body;
  }
  Result<std::string> Open(const std::string& name) {
    FW_ASSIGN_OR_RETURN(std::string body, Post("/v1/train/sessions", json{{"name", name}}.dump()));
    return json::parse(body)["id"].get<std::string>();
  }
  Result<json> Call(const std::string& id, const std::string& call, const json& body) {
    FW_ASSIGN_OR_RETURN(std::string answer, Post("/v1/train/sessions/" + id + "/" + call, body.dump()));
    return json::parse(answer);
  }
  Result<std::string> Batch(const std::string& id, const std::string& call, const json& header,
                            const std::vector<trainer::Datum>& datums,
                            const std::vector<std::vector<float>>& grads = {}) {
    return Post("/v1/train/sessions/" + id + "/" + call, service::EncodeBatch(header, datums, grads),
                service::kBatchContentType);
  }

 private:
  LoopbackService() = default;
  std::unique_ptr<testing::LocalHttpServer> http_;  // declared first: destroyed last
  std::unique_ptr<service::TrainingService> service_;
  transport::Endpoint endpoint_;
};

// Importance sampling, token mean, and its gradient per logprob: what a user's loss function
// computes on the client.
double IsLossAndGrads(const std::vector<trainer::Datum>& data, const trainer::ForwardOutput& lp,
                      std::vector<std::vector<float>>& grads) {
  double weight_sum = 0, loss = 0;
  for (const auto& d : data)
    for (float w : d.weights) weight_sum += w;
  grads.clear();
  for (size_t i = 0; i < data.size(); ++i) {
    std::vector<float> g(data[i].tokens.size());
    for (size_t t = 0; t < g.size(); ++t) {
      const double ratio = std::exp(static_cast<double>(lp.logprobs[i][t]) - data[i].logprobs[t]);
      const double term = data[i].weights[t] * ratio * data[i].advantages[t] / weight_sum;
      loss -= term;
      g[t] = static_cast<float>(-term);
    }
    grads.push_back(std::move(g));
  }
  return loss;
}

// What every step measures with: the demo's model and batch, and the PPO loss.
struct ApiBench {
  const TrainingApiBenchOptions& options;
  trainer::TrainerOptions trainer_options;
  int64_t vocab = 0;
  std::vector<trainer::Datum> batch;
  int64_t loss_tokens = 0;
  json ppo = {{"loss", "ppo"}, {"loss_config", {{"tis_cap", 2.0}}}};
  trainer::LossConfig ppo_config;
};

Result<ApiBench> MakeApiBench(const TrainingApiBenchOptions& options) {
  FW_ASSIGN_OR_RETURN(auto task, pipeline::Task::Create({}));
  ApiBench bench{options};
  bench.vocab = static_cast<int64_t>(task->alphabet().size()) + 2;
  bench.trainer_options.config = model::PipelineTinyConfig(bench.vocab, false);
  bench.trainer_options.seed = 1;
  bench.trainer_options.threads = options.threads;
  bench.batch = DemoBatch(bench.vocab, 3);
  for (const auto& d : bench.batch)
    for (float w : d.weights) bench.loss_tokens += w > 0;
  bench.ppo_config.tis_cap = 2.0;
  return bench;
}

// Timings of each part, in seconds (ratios unitless), one entry per timed round.
struct ApiTimes {
  std::vector<double> local_s, api_s, ratios;       // 1. in process vs over the API
  std::vector<double> empty_s, codec_s;             //    the API's fixed cost
  std::vector<double> builtin_s, custom_s, custom_ratio;  // 2. custom vs built-in loss
  double lora_sequential_s = 0, lora_together_s = 0;      // 3. two LoRA sessions
};

// One interleaved pair (which goes first alternates by round): the in-process
// forward_backward and the same call over the API; their losses must agree.
Status TimePair(const ApiBench& bench, trainer::TrainingClient& local, LoopbackService& service,
                const std::string& id, int round, double& local_s, double& api_s) {
  Result<trainer::Metrics> mine_or = Status::Internal("not run");
  Result<std::string> answer_or = Status::Internal("not run");
  for (int k = 0; k < 2; ++k) {
    const Clock::time_point start = Clock::now();
    if ((k == 0) == (round % 2 == 0)) {
      mine_or = local.ForwardBackward(bench.batch, "ppo", bench.ppo_config);
      local_s = Since(start);
    } else {
      answer_or = service.Batch(id, "forward_backward", bench.ppo, bench.batch);
      api_s = Since(start);
    }
  }
  FW_ASSIGN_OR_RETURN(trainer::Metrics mine, std::move(mine_or));
  FW_ASSIGN_OR_RETURN(std::string answer, std::move(answer_or));
  const double theirs = json::parse(answer)["metrics"]["loss"].get<double>();
  if (std::abs(theirs - mine.loss) > 1e-6) {
    return Status::Internal("the API's loss " + std::to_string(theirs) +
                            " differs from the in-process loss " + std::to_string(mine.loss));
  }
  return Status::Ok();
}

// 1. Overhead: interleaved pairs (two warm-up rounds), then the API's fixed cost: a call
// that does no training (get_info) through the same ordering and trainer thread, and the
// batch's encode + decode on its own.
Status MeasureOverhead(const ApiBench& bench, LoopbackService& service, const std::string& id,
                       ApiTimes& times) {
  FW_ASSIGN_OR_RETURN(auto local, trainer::TrainingClient::Create(bench.trainer_options));
  for (int round = -2; round < bench.options.rounds; ++round) {
    double l = 0, a = 0;
    FW_RETURN_IF_ERROR(TimePair(bench, *local, service, id, round, l, a));
    if (round < 0) continue;
    times.local_s.push_back(l);
    times.api_s.push_back(a);
    times.ratios.push_back(a / l);
  }
  service::WireLimits limits;
  for (int round = 0; round < bench.options.rounds; ++round) {
    Clock::time_point start = Clock::now();
    FW_RETURN_IF_ERROR(service.Call(id, "get_info", json::object()).status());
    times.empty_s.push_back(Since(start));
    start = Clock::now();
    FW_ASSIGN_OR_RETURN(service::WireBatch decoded,
                        service::DecodeBatch(service::EncodeBatch(bench.ppo, bench.batch), limits));
    times.codec_s.push_back(Since(start));
    if (decoded.datums.size() != bench.batch.size()) return Status::Internal("the batch did not round-trip");
  }
  return Status::Ok();
}

// 2. Custom vs built-in, both over the API (one warm-up round); the losses must agree.
Status MeasureCustomLoss(const ApiBench& bench, LoopbackService& service, const std::string& id,
                         ApiTimes& times) {
  const auto& batch = bench.batch;
  for (int round = -1; round < bench.options.rounds; ++round) {
    Clock::time_point start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::string fb, service.Batch(id, "forward_backward",
                                                      {{"loss", "importance_sampling"}}, batch));
    const double b = Since(start);
    start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::string forward, service.Batch(id, "forward", json::object(), batch));
    FW_ASSIGN_OR_RETURN(trainer::ForwardOutput lp, service::DecodeForwardOutput(forward));
    std::vector<std::vector<float>> grads;
    const double loss = IsLossAndGrads(batch, lp, grads);
    FW_ASSIGN_OR_RETURN(std::string fbc, service.Batch(id, "forward_backward_custom",
                                                       {{"loss_value", loss}}, batch, grads));
    const double c = Since(start);
    const double builtin_loss = json::parse(fb)["metrics"]["loss"].get<double>();
    if (std::abs(builtin_loss - loss) > 1e-6) {
      return Status::Internal("the custom loss " + std::to_string(loss) +
                              " differs from the built-in " + std::to_string(builtin_loss));
    }
    if (round < 0) continue;
    times.builtin_s.push_back(b);
    times.custom_s.push_back(c);
    times.custom_ratio.push_back(c / b);
  }
  return Status::Ok();
}

// Two LoRA sessions on a fresh service in `dir`, trained one after the other or at once;
// returns the seconds taken and appends each session's adapter hash to `hashes`.
Result<double> RunLoraSessions(const ApiBench& bench, service::TrainingServiceOptions o,
                               bool together, std::vector<std::string>& hashes) {
  FW_ASSIGN_OR_RETURN(auto s, LoopbackService::Start(o));
  FW_ASSIGN_OR_RETURN(std::string a, s->Open("a"));
  FW_ASSIGN_OR_RETURN(std::string b, s->Open("b"));
  const std::vector<trainer::Datum> batch_b = DemoBatch(bench.vocab, 4);
  auto train = [&](const std::string& session, const std::vector<trainer::Datum>& data) -> Status {
    for (int step = 0; step < bench.options.lora_steps; ++step) {
      FW_RETURN_IF_ERROR(s->Batch(session, "forward_backward", bench.ppo, data).status());
      FW_RETURN_IF_ERROR(s->Call(session, "optim_step", {{"adam", {{"lr", 1e-3}}}}).status());
    }
    return Status::Ok();
  };
  const Clock::time_point start = Clock::now();
  if (together) {
    auto other = std::async(std::launch::async, [&] { return train(b, batch_b); });
    Status mine = train(a, bench.batch);
    Status theirs = other.get();
    FW_RETURN_IF_ERROR(mine);
    FW_RETURN_IF_ERROR(theirs);
  } else {
    FW_RETURN_IF_ERROR(train(a, bench.batch));
    FW_RETURN_IF_ERROR(train(b, batch_b));
  }
  const double seconds = Since(start);
  for (const std::string& session : {a, b}) {
    FW_ASSIGN_OR_RETURN(json saved, s->Call(session, "save_weights_for_sampler", json::object()));
    hashes.push_back(saved["adapter_hash"].get<std::string>());
  }
  return seconds;
}

// 3. Two LoRA sessions: one after the other, then at once; the adapters must be the same.
Status MeasureLora(const ApiBench& bench, const service::TrainingServiceOptions& full,
                   const std::string& work_dir, ApiTimes& times) {
  service::TrainingServiceOptions lora = full;
  lora.trainer.lora = model::LoraOptions{.rank = 8, .alpha = 16};
  std::vector<std::string> sequential_hashes, together_hashes;
  lora.state_dir = (fs::path(work_dir) / "lora1").string();
  FW_ASSIGN_OR_RETURN(times.lora_sequential_s, RunLoraSessions(bench, lora, false, sequential_hashes));
  lora.state_dir = (fs::path(work_dir) / "lora2").string();
  FW_ASSIGN_OR_RETURN(times.lora_together_s, RunLoraSessions(bench, lora, true, together_hashes));
  if (sequential_hashes != together_hashes) {
    return Status::Internal("two LoRA sessions trained at once ended with other adapters than "
                            "trained one after the other");
  }
  return Status::Ok();
}

Table ApiTable(const ApiBench& bench, const ApiTimes& t) {
  const double overhead = Median(t.ratios);
  const double lora_tokens = 2.0 * bench.options.lora_steps * static_cast<double>(bench.loss_tokens);
  Table table;
  table.header = {"measure", "in-process / built-in", "over the API", "ratio", "target", "result"};
  table.rows.push_back({"forward_backward (ppo + TIS), ms", Fixed(Median(t.local_s) * 1e3, 1),
                        Fixed(Median(t.api_s) * 1e3, 1), Fixed(overhead, 3) + "x", "<= 1.10x",
                        PassFail(overhead <= 1.10)});
  table.rows.push_back({"fixed cost per call: batch encode+decode; get_info round trip, ms",
                        Fixed(Median(t.codec_s) * 1e3, 2), Fixed(Median(t.empty_s) * 1e3, 2),
                        Fixed(Median(t.empty_s) / Median(t.local_s), 3) + "x of fb", "-", "-"});
  table.rows.push_back({"custom (forward + fb_custom) vs built-in fb, ms",
                        Fixed(Median(t.builtin_s) * 1e3, 1), Fixed(Median(t.custom_s) * 1e3, 1),
                        Fixed(Median(t.custom_ratio), 3) + "x", "reported", "-"});
  table.rows.push_back({"two LoRA sessions: loss tokens/s, sequential vs at once",
                        Fixed(lora_tokens / t.lora_sequential_s, 0),
                        Fixed(lora_tokens / t.lora_together_s, 0),
                        Fixed(t.lora_sequential_s / t.lora_together_s, 3) + "x", "reported", "-"});
  return table;
}

Status Report(const ApiBench& bench, const ApiTimes& times, size_t body_bytes, std::ostream& out) {
  const TrainingApiBenchOptions& options = bench.options;
  const Table table = ApiTable(bench, times);
  out << RenderText(table) << "\nRequest body: " << body_bytes << " bytes for " << bench.batch.size()
      << " datums (binary batch). Ratios are medians of interleaved pairs ("
      << options.rounds << " rounds).\n";
  if (!options.markdown_out.empty()) {
    std::string section = "## Training API benchmark\n\n`flywheel bench training-api`: " +
                          std::to_string(bench.batch.size()) + " sequences x " +
                          std::to_string(bench.batch[0].tokens.size()) +
                          " tokens, the tiny preset, loopback HTTP, medians of " +
                          std::to_string(options.rounds) + " interleaved pairs.\n\n" +
                          RenderMarkdown(table) + "\n";
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Training API benchmark", section));
  }
  const double overhead = Median(times.ratios);
  if (options.check && overhead > 1.10) {
    return Status::Internal("the API costs " + Fixed(overhead, 3) +
                            "x the in-process forward_backward (target <= 1.10x)");
  }
  return Status::Ok();
}

}  // namespace

Status RunTrainingApiBench(const TrainingApiBenchOptions& options, std::ostream& out) {
  if (options.rounds < 1 || options.lora_steps < 1)
    return Status::InvalidArgument("rounds and lora steps must be >= 1");
  ScopedWorkDir work;
  FW_RETURN_IF_ERROR(work.Prepare("", "fw-training-api", false));
  FW_ASSIGN_OR_RETURN(const ApiBench bench, MakeApiBench(options));
  out << "Training API benchmark: the demo's model (tiny preset, vocab " << bench.vocab
      << ") and batch (" << bench.batch.size() << " sequences x " << bench.batch[0].tokens.size()
      << " tokens, " << bench.loss_tokens << " loss tokens), loopback HTTP\n\n";
  service::TrainingServiceOptions full;
  full.trainer = bench.trainer_options;
  full.state_dir = (fs::path(work.path()) / "full").string();
  ApiTimes times;
  {
    FW_ASSIGN_OR_RETURN(auto service, LoopbackService::Start(full));
    FW_ASSIGN_OR_RETURN(std::string id, service->Open("bench"));
    FW_RETURN_IF_ERROR(MeasureOverhead(bench, *service, id, times));
    FW_RETURN_IF_ERROR(MeasureCustomLoss(bench, *service, id, times));
  }
  FW_RETURN_IF_ERROR(MeasureLora(bench, full, work.path(), times));
  const size_t body_bytes = service::EncodeBatch(bench.ppo, bench.batch).size();
  return Report(bench, times, body_bytes, out);
}

}  // namespace flywheel::bench
