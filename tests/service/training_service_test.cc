// The training service over loopback HTTP against the in-process training client on the same
// data: every call and loss, the custom-loss path, two LoRA sessions at once, expiry and
// restore after a restart, bad input, a client that leaves mid-call, and seq ordering.
#include "service/training_service.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <boost/asio.hpp>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "checkpoint/safetensors.h"
#include "service/training_wire.h"
#include "testing/local_http_server.h"
#include "tests/model/tiny_models.h"
#include "transport/certs.h"
#include "transport/http.h"
#include "transport/tls.h"

namespace flywheel::service {
namespace {

namespace fs = std::filesystem;
namespace asio = boost::asio;
using json = nlohmann::json;
using trainer::Datum;

constexpr int64_t kVocab = 40;

trainer::TrainerOptions Options(bool lora = false) {
  trainer::TrainerOptions o;
  o.config = testing::TinyConfig({.vocab = kVocab});
  o.seed = 7;
  o.threads = 1;
  if (lora) o.lora = model::LoraOptions{.rank = 4, .alpha = 8};
  return o;
}

std::string TempDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("fw_service_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// Ragged random sequences with RL fields (sampling logprobs are noise around -3).
std::vector<Datum> Data(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0, 0.3f);
  std::vector<Datum> out;
  for (int i = 0; i < count; ++i) {
    const int length = 10 - i % 3;
    Datum d;
    for (int t = 0; t < length; ++t) {
      d.tokens.push_back(static_cast<int32_t>(rng() % kVocab));
      d.target_tokens.push_back(static_cast<int32_t>(rng() % kVocab));
      d.weights.push_back(t < 3 ? 0.0f : 1.0f);
      d.logprobs.push_back(-3.7f + noise(rng));
      d.advantages.push_back(i % 2 ? 1.0f : -0.5f);
      d.ref_logprobs.push_back(-3.7f + noise(rng));
    }
    out.push_back(std::move(d));
  }
  return out;
}

// A service on a loopback HTTP server (no publisher).
class Server {
 public:
  explicit Server(TrainingServiceOptions options, transport::HttpServerOptions http = {}) {
    auto service = TrainingService::Create(std::move(options), nullptr);
    EXPECT_TRUE(service.ok()) << service.status().ToString();
    if (!service.ok()) return;
    service_ = std::move(*service);
    auto server = flywheel::testing::LocalHttpServer::Start(
        [this](transport::HttpServer& routes) { service_->Register(routes); }, http);
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    if (!server.ok()) return;
    http_ = std::move(*server);
    endpoint_ = http_->endpoint();
  }
  // The server stops before the service goes; the io thread after both.
  ~Server() {
    if (http_) http_->Stop();
    service_.reset();
  }

  struct Answer {
    int status = 0;
    std::string body;
    json Json() const { return json::parse(body, nullptr, false); }
  };
  Answer Call(const std::string& method, const std::string& target, const std::string& body,
              const std::string& content_type = "application/json", const std::string& token = "") {
    transport::HttpGetOptions options;
    options.timeout = std::chrono::seconds(120);
    options.token = token;
    options.tls = client_tls;
    auto r = transport::HttpCall(endpoint_, method, target, body, options,
                                 body.empty() ? "" : content_type);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? Answer{r->status, r->body} : Answer{};
  }
  std::string Open(const json& request = json::object()) {
    Answer a = Call("POST", "/v1/train/sessions", request.dump());
    EXPECT_EQ(a.status, 201) << a.body;
    return a.Json().value("id", "");
  }
  Answer Batch(const std::string& id, const std::string& call, json header,
               const std::vector<Datum>& datums, const std::vector<std::vector<float>>& grads = {}) {
    return Call("POST", "/v1/train/sessions/" + id + "/" + call,
                EncodeBatch(std::move(header), datums, grads), kBatchContentType);
  }
  Answer Post(const std::string& id, const std::string& call, const json& body = json::object()) {
    return Call("POST", "/v1/train/sessions/" + id + "/" + call, body.dump());
  }
  TrainingService& service() { return *service_; }
  std::shared_ptr<asio::ssl::context> client_tls;  // set: requests go over TLS
  const transport::Endpoint& endpoint() const { return endpoint_; }

 private:
  std::unique_ptr<flywheel::testing::LocalHttpServer> http_;  // declared first: destroyed last
  std::unique_ptr<TrainingService> service_;
  transport::Endpoint endpoint_;
};

TrainingServiceOptions ServiceOptions(const std::string& dir, bool lora = false) {
  TrainingServiceOptions o;
  o.trainer = Options(lora);
  o.state_dir = dir;
  return o;
}

std::unique_ptr<trainer::TrainingClient> Local(bool lora = false) {
  auto c = trainer::TrainingClient::Create(Options(lora));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(*c);
}

// The fp32 tensors of a saved state's weights.safetensors, by name.
std::map<std::string, std::vector<std::byte>> StateWeights(const std::string& dir) {
  std::map<std::string, std::vector<std::byte>> out;
  auto file = SafetensorsFile::Open((fs::path(dir) / "weights.safetensors").string());
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  if (!file.ok()) return out;
  for (const TensorView& t : file->tensors()) out[t.name].assign(t.data.begin(), t.data.end());
  return out;
}

// Saves the remote session's state as `name` and the local client's beside it; both weights.
void ExpectSameWeights(Server& server, const std::string& id, trainer::TrainingClient& local,
                       const std::string& state_dir, const std::string& name, bool frozen = true) {
  auto saved = server.Post(id, "save_state", {{"name", name}});
  ASSERT_EQ(saved.status, 200) << saved.body;
  const std::string remote = (fs::path(state_dir) / saved.Json()["path"].get<std::string>()).string();
  const std::string mine = (fs::path(state_dir) / ("local-" + name)).string();
  ASSERT_TRUE(local.SaveState(mine, frozen).ok());
  const auto theirs = StateWeights(remote);
  EXPECT_FALSE(theirs.empty());
  EXPECT_EQ(theirs, StateWeights(mine)) << "weights differ after " << name;
}

double Loss(const Server::Answer& a) { return a.Json()["metrics"]["loss"].get<double>(); }

TEST(TrainingServiceTest, EveryCallMatchesTheInProcessClient) {
  const std::string dir = TempDir("calls");
  Server server(ServiceOptions(dir));
  auto local = Local();
  const std::string id = server.Open();
  const std::vector<Datum> data = Data(6, 1);

  // forward: the same logprobs, bit for bit.
  auto forward = server.Batch(id, "forward", json::object(), data);
  ASSERT_EQ(forward.status, 200) << forward.body;
  auto remote_lp = DecodeForwardOutput(forward.body);
  ASSERT_TRUE(remote_lp.ok()) << remote_lp.status().ToString();
  auto local_lp = local->Forward(data);
  ASSERT_TRUE(local_lp.ok());
  EXPECT_EQ(remote_lp->logprobs, local_lp->logprobs);

  // Every built-in loss (with its parameters), then a step: losses equal, weights equal.
  struct Case {
    std::string loss;
    json config;
  };
  const std::vector<Case> cases = {
      {"cross_entropy", json::object()},
      {"importance_sampling", {{"aggregation", "seq-mean-token-mean"}}},
      {"ppo", {{"clip_low", 0.2}, {"clip_high", 0.28}, {"tis_cap", 2.0}, {"dual_clip", 3.0}}},
      {"ppo", {{"kl_coef", 0.1}, {"kl_estimator", "k1"}}},
      {"ppo", {{"kl_coef", 0.1}, {"kl_estimator", "k2"}, {"aggregation", "seq-mean-token-sum-norm"}}},
      {"cispo", {{"cispo_high", 4.0}, {"kl_coef", 0.05}}},
      {"dro", {{"dro_beta", 0.2}}},
      {"gspo", {{"aggregation", "seq-mean-token-mean"}}},
      {"dpo", {{"dpo_beta", 0.2}}},
  };
  const json adam = {{"lr", 1e-3}, {"weight_decay", 0.01}, {"grad_clip", 0.5}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.loss + " " + c.config.dump());
    auto remote = server.Batch(id, "forward_backward", {{"loss", c.loss}, {"loss_config", c.config}}, data);
    ASSERT_EQ(remote.status, 200) << remote.body;
    auto config = LossConfigFromJson(c.config);
    ASSERT_TRUE(config.ok());
    auto mine = local->ForwardBackward(data, c.loss, *config);
    ASSERT_TRUE(mine.ok()) << mine.status().ToString();
    EXPECT_NEAR(Loss(remote), mine->loss, 1e-6);
    EXPECT_EQ(remote.Json()["metrics"]["tokens"].get<int64_t>(), mine->tokens);
    EXPECT_NEAR(remote.Json()["metrics"]["clip_fraction"].get<double>(), mine->clip_fraction, 1e-6);
    auto step = server.Post(id, "optim_step", {{"adam", adam}});
    ASSERT_EQ(step.status, 200) << step.body;
    auto my_step = local->OptimStep(*AdamFromJson(adam));
    ASSERT_TRUE(my_step.ok());
    EXPECT_NEAR(step.Json()["metrics"]["grad_norm"].get<double>(), my_step->grad_norm, 1e-6);
  }
  ExpectSameWeights(server, id, *local, dir, "after-losses");

  // save_weights_for_sampler: the same serving bytes (hash); versions move forward.
  auto saved = server.Post(id, "save_weights_for_sampler");
  ASSERT_EQ(saved.status, 200) << saved.body;
  auto snapshot = local->SaveWeightsForSampler(saved.Json()["version"].get<uint64_t>());
  ASSERT_TRUE(snapshot.ok());
  EXPECT_EQ(saved.Json()["weights_hash"], snapshot->weights_hash);
  auto again = server.Post(id, "save_weights_for_sampler");
  EXPECT_EQ(again.Json()["version"].get<uint64_t>(), saved.Json()["version"].get<uint64_t>() + 1);

  // get_info and the server's info.
  auto info = server.Post(id, "get_info");
  ASSERT_EQ(info.status, 200);
  EXPECT_EQ(info.Json()["step"].get<uint64_t>(), cases.size());
  auto server_info = server.Call("GET", "/v1/train/info", "");
  EXPECT_EQ(server_info.Json()["mode"], "full");
  EXPECT_EQ(server_info.Json()["parameters"]["trainable"].get<int64_t>(), local->trainable_count());

  // load_state goes back to a saved state (the local client does the same). Both first step
  // away from it, so that a load that does nothing leaves other weights than the saved ones.
  const auto saved_weights = StateWeights((fs::path(dir) / "sessions" / id / "after-losses").string());
  ASSERT_FALSE(saved_weights.empty());
  auto away = server.Batch(id, "forward_backward", {{"loss", "cross_entropy"}}, data);
  ASSERT_EQ(away.status, 200) << away.body;
  ASSERT_TRUE(local->ForwardBackward(data, "cross_entropy", *LossConfigFromJson(json::object())).ok());
  ASSERT_EQ(server.Post(id, "optim_step", {{"adam", adam}}).status, 200);
  ASSERT_TRUE(local->OptimStep(*AdamFromJson(adam)).ok());
  ExpectSameWeights(server, id, *local, dir, "stepped-away");
  ASSERT_NE(StateWeights((fs::path(dir) / "sessions" / id / "stepped-away").string()), saved_weights)
      << "the step did not move the weights: the load below would prove nothing";
  auto first = server.Post(id, "load_state", {{"path", "sessions/" + id + "/after-losses"}});
  ASSERT_EQ(first.status, 200) << first.body;
  ASSERT_TRUE(local->LoadState((fs::path(dir) / "local-after-losses").string()).ok());
  ExpectSameWeights(server, id, *local, dir, "reloaded");
  EXPECT_EQ(StateWeights((fs::path(dir) / "sessions" / id / "reloaded").string()), saved_weights)
      << "load_state did not bring the saved weights back";
  fs::remove_all(dir);
}

// A loss computed by the client (importance sampling, token mean, by hand with autograd, as
// the Python SDK's users do) through forward + forward_backward_custom equals the built-in.
TEST(TrainingServiceTest, CustomLossEqualsBuiltIn) {
  const std::string dir = TempDir("custom");
  const std::vector<Datum> data = Data(6, 2);
  const json adam = {{"lr", 1e-3}};
  std::map<std::string, std::vector<std::byte>> builtin_weights;
  double builtin_loss = 0, builtin_grad_norm = 0;
  {
    Server server(ServiceOptions(dir));
    const std::string id = server.Open();
    auto fb = server.Batch(id, "forward_backward", {{"loss", "importance_sampling"}}, data);
    ASSERT_EQ(fb.status, 200) << fb.body;
    builtin_loss = Loss(fb);
    auto builtin_step = server.Post(id, "optim_step", {{"adam", adam}});
    ASSERT_EQ(builtin_step.status, 200) << builtin_step.body;
    builtin_grad_norm = builtin_step.Json()["metrics"]["grad_norm"].get<double>();
    ASSERT_GT(builtin_grad_norm, 0);
    auto saved = server.Post(id, "save_state", {{"name", "builtin"}});
    builtin_weights = StateWeights((fs::path(dir) / saved.Json()["path"].get<std::string>()).string());
    ASSERT_EQ(server.Call("DELETE", "/v1/train/sessions/" + id, "").status, 200);

    const std::string custom = server.Open();  // starts from the initial weights again
    auto forward = server.Batch(custom, "forward", json::object(), data);
    ASSERT_EQ(forward.status, 200);
    auto lp = DecodeForwardOutput(forward.body);
    ASSERT_TRUE(lp.ok());
    // loss = -sum(w * exp(lp - lp_sampling) * adv) / sum(w); its gradient per token.
    double weight_sum = 0, loss = 0;
    for (const Datum& d : data)
      for (float w : d.weights) weight_sum += w;
    std::vector<std::vector<float>> grads;
    for (size_t i = 0; i < data.size(); ++i) {
      std::vector<float> g(data[i].tokens.size());
      for (size_t t = 0; t < g.size(); ++t) {
        const double ratio = std::exp(static_cast<double>(lp->logprobs[i][t]) - data[i].logprobs[t]);
        const double term = data[i].weights[t] * ratio * data[i].advantages[t] / weight_sum;
        loss -= term;
        g[t] = static_cast<float>(-term);  // d(-w r a / W) / d lp = -w r a / W
      }
      grads.push_back(std::move(g));
    }
    auto fbc = server.Batch(custom, "forward_backward_custom", {{"loss_value", loss}}, data, grads);
    ASSERT_EQ(fbc.status, 200) << fbc.body;
    EXPECT_NEAR(Loss(fbc), builtin_loss, 1e-6);
    // The loss above is the client's own number echoed back, and Adam's first step hardly
    // depends on the gradient's scale: the gradient's norm is what shows that the custom
    // path applied the same gradient, scale included.
    auto custom_step = server.Post(custom, "optim_step", {{"adam", adam}});
    ASSERT_EQ(custom_step.status, 200) << custom_step.body;
    EXPECT_NEAR(custom_step.Json()["metrics"]["grad_norm"].get<double>(), builtin_grad_norm,
                1e-5 * builtin_grad_norm);
    auto custom_saved = server.Post(custom, "save_state", {{"name", "custom"}});
    auto custom_weights =
        StateWeights((fs::path(dir) / custom_saved.Json()["path"].get<std::string>()).string());
    ASSERT_EQ(custom_weights.size(), builtin_weights.size());
    double max_diff = 0;
    for (const auto& [name, bytes] : builtin_weights) {
      const auto& other = custom_weights[name];
      ASSERT_EQ(other.size(), bytes.size());
      const float* a = reinterpret_cast<const float*>(bytes.data());
      const float* b = reinterpret_cast<const float*>(other.data());
      for (size_t k = 0; k < bytes.size() / 4; ++k) max_diff = std::max<double>(max_diff, std::abs(a[k] - b[k]));
    }
    EXPECT_LT(max_diff, 1e-6) << "custom and built-in weights differ";
    // A bad gradient array is refused by name.
    auto bad = server.Batch(custom, "forward_backward_custom", {{"loss_value", 1.0}}, data,
                            std::vector<std::vector<float>>(data.size(), std::vector<float>(3, 0.f)));
    EXPECT_EQ(bad.status, 400);
    EXPECT_NE(bad.body.find("grads"), std::string::npos) << bad.body;
  }
  fs::remove_all(dir);
}

// Two LoRA sessions trained at once, calls interleaved, each equal to a solo run; the
// version carries both adapters under their names.
TEST(TrainingServiceTest, TwoLoraSessionsDoNotLeak) {
  const std::string dir = TempDir("lora");
  Server server(ServiceOptions(dir, true));
  const std::string a = server.Open({{"name", "alpha"}});
  const std::string b = server.Open({{"name", "beta"}});
  EXPECT_EQ(server.Call("POST", "/v1/train/sessions", json{{"name", "alpha"}}.dump()).status, 409);
  auto solo_a = Local(true), solo_b = Local(true);
  const std::vector<Datum> data_a = Data(4, 3), data_b = Data(4, 4);
  const json adam = {{"lr", 5e-3}};
  for (int round = 0; round < 3; ++round) {
    auto fa = server.Batch(a, "forward_backward", {{"loss", "ppo"}}, data_a);
    auto fb = server.Batch(b, "forward_backward", {{"loss", "cross_entropy"}}, data_b);
    ASSERT_EQ(fa.status, 200) << fa.body;
    ASSERT_EQ(fb.status, 200) << fb.body;
    auto la = solo_a->ForwardBackward(data_a, "ppo");
    auto lb = solo_b->ForwardBackward(data_b, "cross_entropy");
    EXPECT_EQ(Loss(fa), la->loss);
    EXPECT_EQ(Loss(fb), lb->loss);
    ASSERT_EQ(server.Post(b, "optim_step", {{"adam", adam}}).status, 200);
    ASSERT_EQ(server.Post(a, "optim_step", {{"adam", adam}}).status, 200);
    ASSERT_TRUE(solo_a->OptimStep(*AdamFromJson(adam)).ok());
    ASSERT_TRUE(solo_b->OptimStep(*AdamFromJson(adam)).ok());
  }
  auto va = server.Post(a, "save_weights_for_sampler");
  auto vb = server.Post(b, "save_weights_for_sampler");
  ASSERT_EQ(va.status, 200) << va.body;
  EXPECT_EQ(va.Json()["adapter"], "alpha");
  EXPECT_EQ(vb.Json()["adapter"], "beta");
  EXPECT_GT(vb.Json()["version"].get<uint64_t>(), va.Json()["version"].get<uint64_t>());
  EXPECT_EQ(va.Json()["adapter_hash"], solo_a->SaveWeightsForSampler(1)->weights_hash);
  EXPECT_EQ(vb.Json()["adapter_hash"], solo_b->SaveWeightsForSampler(1)->weights_hash);
  ExpectSameWeights(server, a, *solo_a, dir, "a", false);
  ExpectSameWeights(server, b, *solo_b, dir, "b", false);
  // Closing a session whose adapter is served publishes a version without it.
  const uint64_t before = server.service().version();
  ASSERT_EQ(server.Call("DELETE", "/v1/train/sessions/" + b, "").status, 200);
  for (int i = 0; i < 100 && server.service().version() == before; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(server.service().version(), before + 1);
  EXPECT_EQ(server.Post(b, "get_info").status, 404);
  fs::remove_all(dir);
}

TEST(TrainingServiceTest, SessionsExpireAndComeBackAfterARestart) {
  const std::string dir = TempDir("expiry");
  const std::vector<Datum> data = Data(4, 5);
  std::string id, restored_id;
  auto local = Local();
  {
    TrainingServiceOptions options = ServiceOptions(dir);
    options.session_idle_timeout = std::chrono::milliseconds(800);
    Server server(options);
    id = server.Open({{"name", "run1"}});
    ASSERT_EQ(server.Batch(id, "forward_backward", {{"loss", "cross_entropy"}}, data).status, 200);
    ASSERT_EQ(server.Post(id, "optim_step").status, 200);
    ASSERT_TRUE(local->ForwardBackward(data, "cross_entropy").ok());
    ASSERT_TRUE(local->OptimStep({}).ok());
    auto saved = server.Post(id, "save_state", {{"name", "first"}});
    ASSERT_EQ(saved.status, 200);
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    auto expired = server.Post(id, "get_info");
    EXPECT_EQ(expired.status, 404);
    EXPECT_NE(expired.body.find("expired"), std::string::npos) << expired.body;
    EXPECT_NE(expired.body.find("sessions/" + id + "/first"), std::string::npos) << expired.body;
    // A new session from the expired one's saved state goes on from there.
    restored_id = server.Open({{"name", "run1"}, {"from_state", "sessions/" + id + "/first"}});
    auto info = server.Post(restored_id, "get_info");
    EXPECT_EQ(info.Json()["step"].get<uint64_t>(), 1u);
    ASSERT_EQ(server.Batch(restored_id, "forward_backward", {{"loss", "cross_entropy"}}, data).status, 200);
    ASSERT_EQ(server.Post(restored_id, "optim_step").status, 200);
    ASSERT_EQ(server.Post(restored_id, "save_state", {{"name", "second"}}).status, 200);
    ASSERT_TRUE(local->ForwardBackward(data, "cross_entropy").ok());
    ASSERT_TRUE(local->OptimStep({}).ok());
  }
  // The restarted server restores the session under its id, from its latest state; its
  // client's next seq (whatever it is) is accepted.
  Server server(ServiceOptions(dir));
  auto listed = server.Call("GET", "/v1/train/sessions", "");
  ASSERT_EQ(listed.Json()["sessions"].size(), 1u) << listed.body;
  EXPECT_EQ(listed.Json()["sessions"][0]["id"], restored_id);
  EXPECT_EQ(listed.Json()["sessions"][0]["step"].get<uint64_t>(), 2u);
  auto fb = server.Batch(restored_id, "forward_backward", {{"loss", "cross_entropy"}, {"seq", 17}}, data);
  ASSERT_EQ(fb.status, 200) << fb.body;
  EXPECT_EQ(Loss(fb), local->ForwardBackward(data, "cross_entropy")->loss);
  ASSERT_EQ(server.Post(restored_id, "optim_step", {{"seq", 18}}).status, 200);
  ASSERT_TRUE(local->OptimStep({}).ok());
  ExpectSameWeights(server, restored_id, *local, dir, "third");
  fs::remove_all(dir);
}

TEST(TrainingServiceTest, BadInputIsA4xxAndLeavesTheSessionUsable) {
  const std::string dir = TempDir("bad");
  TrainingServiceOptions options = ServiceOptions(dir);
  options.max_batch_tokens = 100;
  transport::HttpServerOptions http;
  http.token = "fleet-token";
  http.scoped_tokens = {{"train-token", transport::kScopeTrain | transport::kScopeRead}};
  Server server(options, http);
  auto call = [&](const std::string& target, const std::string& body, const std::string& type,
                  const std::string& token = "train-token") {
    return server.Call("POST", target, body, type, token);
  };
  auto open = call("/v1/train/sessions", "{}", "application/json");
  ASSERT_EQ(open.status, 201) << open.body;
  const std::string id = open.Json()["id"];
  const std::string fb = "/v1/train/sessions/" + id + "/forward_backward";
  auto local = Local();
  const std::vector<Datum> good = Data(4, 6);

  struct Bad {
    std::string what, body, expect;
    int status;
  };
  std::vector<Bad> bads;
  bads.push_back({"unknown loss", EncodeBatch({{"loss", "ppo2"}}, good), "ppo2", 400});
  bads.push_back({"unknown config key", EncodeBatch({{"loss", "ppo"}, {"loss_config", {{"clip", 1}}}}, good),
                  "clip", 400});
  {
    auto d = good;
    d[1].weights.pop_back();
    bads.push_back({"wrong shapes", EncodeBatch({{"loss", "ppo"}}, d), "weights", 400});
  }
  {
    auto d = good;
    d[2].tokens[3] = 1000;
    bads.push_back({"token out of range", EncodeBatch({{"loss", "ppo"}}, d), "1000", 400});
  }
  {
    auto d = good;
    d[0].advantages[5] = std::nanf("");
    bads.push_back({"NaN advantage", EncodeBatch({{"loss", "ppo"}}, d), "advantages", 400});
  }
  bads.push_back({"oversized batch", EncodeBatch({{"loss", "ppo"}}, Data(12, 7)), "max-batch-tokens", 413});
  bads.push_back({"not a batch", "{\"loss\": \"ppo\"}", "FWB1", 400});
  {
    std::string truncated = EncodeBatch({{"loss", "ppo"}}, good);
    truncated.resize(truncated.size() - 7);
    bads.push_back({"truncated batch", truncated, "past the end", 400});
  }
  for (const Bad& bad : bads) {
    auto answer = call(fb, bad.body, kBatchContentType);
    EXPECT_EQ(answer.status, bad.status) << bad.what << ": " << answer.body;
    EXPECT_NE(answer.body.find(bad.expect), std::string::npos) << bad.what << ": " << answer.body;
    EXPECT_EQ(answer.Json()["error"]["code"].is_string(), true) << bad.what;
  }
  EXPECT_EQ(call("/v1/train/sessions/s-nope/forward", EncodeBatch({}, good), kBatchContentType).status, 404);
  EXPECT_EQ(call("/v1/train/sessions/" + id + "/optim_step", "{\"adam\": {\"lr\": -1}}",
                 "application/json").status, 400);
  EXPECT_EQ(call("/v1/train/sessions/" + id + "/fly", "{}", "application/json").status, 404);
  EXPECT_EQ(call(fb, EncodeBatch({{"loss", "ppo"}}, good), kBatchContentType, "wrong").status, 401);
  EXPECT_EQ(call(fb, EncodeBatch({{"loss", "ppo"}}, good), kBatchContentType, "fleet-token").status, 403);
  EXPECT_EQ(call("/v1/train/sessions/" + id + "/load_state", "{\"path\": \"../../etc\"}",
                 "application/json").status, 400);
  // JSON nested deep enough to overflow a recursive dump is refused, not crashed on.
  const std::string deep = "{\"adam\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_EQ(call("/v1/train/sessions/" + id + "/optim_step", deep, "application/json").status, 400);
  EXPECT_EQ(call(fb, EncodeBatch({{"loss", "ppo"}, {"loss_config", json::parse(std::string(40, '[') + std::string(40, ']'))}}, good),
                 kBatchContentType).status, 400);
  // The limit counts the padded batch: one long datum and many short ones are refused too.
  {
    std::vector<Datum> ragged = {Data(1, 10)[0]};
    for (int i = 0; i < 12; ++i) ragged.push_back(Datum{{1}, {2}});
    auto answer = call(fb, EncodeBatch({{"loss", "cross_entropy"}}, ragged), kBatchContentType);
    EXPECT_EQ(answer.status, 413) << answer.body;
  }
  // A state name that would replace the session's own file is refused; a seq far ahead too.
  EXPECT_EQ(call("/v1/train/sessions/" + id + "/save_state", "{\"name\": \"session.json\"}",
                 "application/json").status, 400);
  EXPECT_EQ(call("/v1/train/sessions/" + id + "/get_info", "{\"seq\": 100000}", "application/json").status, 400);

  // Nothing of those was applied: the session trains exactly like a fresh client.
  auto ok = call(fb, EncodeBatch({{"loss", "ppo"}}, good), kBatchContentType);
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(Loss(ok), local->ForwardBackward(good, "ppo")->loss);
  ASSERT_EQ(call("/v1/train/sessions/" + id + "/optim_step", "{}", "application/json").status, 200);
  ASSERT_TRUE(local->OptimStep({}).ok());
  auto saved = call("/v1/train/sessions/" + id + "/save_state", "{\"name\": \"x\"}", "application/json");
  ASSERT_EQ(saved.status, 200) << saved.body;
  ASSERT_TRUE(local->SaveState(dir + "/local-x").ok());
  EXPECT_EQ(StateWeights(dir + "/" + saved.Json()["path"].get<std::string>()), StateWeights(dir + "/local-x"));
  fs::remove_all(dir);
}

// The API over TLS 1.3 with mutual authentication (serve-trainer's --tls-* flags): a client
// with the CA's certificate trains; one without a client certificate is refused.
TEST(TrainingServiceTest, TheApiRunsOverMutualTls) {
  const std::string dir = TempDir("tls");
  ASSERT_TRUE(transport::WriteTestCertificates(dir + "/certs").ok());
  const std::string certs = dir + "/certs/";
  transport::HttpServerOptions http;
  auto server_tls = transport::MakeServerTlsContext({certs + "server.crt", certs + "server.key", certs + "ca.crt"});
  ASSERT_TRUE(server_tls.ok()) << server_tls.status().ToString();
  http.tls = *server_tls;
  Server server(ServiceOptions(dir + "/state"), http);
  auto client_tls = transport::MakeClientTlsContext({certs + "client.crt", certs + "client.key", certs + "ca.crt"});
  ASSERT_TRUE(client_tls.ok()) << client_tls.status().ToString();
  server.client_tls = *client_tls;
  const std::string id = server.Open();
  auto fb = server.Batch(id, "forward_backward", {{"loss", "cross_entropy"}}, Data(2, 11));
  EXPECT_EQ(fb.status, 200) << fb.body;
  auto anonymous = transport::MakeClientTlsContext({"", "", certs + "ca.crt"});
  ASSERT_TRUE(anonymous.ok());
  transport::HttpGetOptions options;
  options.tls = *anonymous;
  auto refused = transport::HttpCall(server.endpoint(), "GET", "/v1/train/info", "", options);
  EXPECT_FALSE(refused.ok() && refused->status == 200) << "a client without a certificate was served";
  fs::remove_all(dir);
}

// A client that sends a call and leaves at once: the call still runs once, in its turn; a
// retry with the same seq gets its answer without running it again.
TEST(TrainingServiceTest, AClientLeavingMidCallDoesNotCorruptTheSession) {
  const std::string dir = TempDir("leave");
  Server server(ServiceOptions(dir));
  const std::string id = server.Open();
  auto local = Local();
  const std::vector<Datum> data = Data(8, 8);
  const std::string body = EncodeBatch({{"loss", "ppo"}, {"seq", 1}}, data);
  {
    asio::io_context io;
    asio::ip::tcp::socket socket(io);
    socket.connect({asio::ip::make_address("127.0.0.1"), server.endpoint().port});
    const std::string request = "POST /v1/train/sessions/" + id +
                                "/forward_backward HTTP/1.1\r\nHost: x\r\nContent-Type: " +
                                kBatchContentType + "\r\nContent-Length: " +
                                std::to_string(body.size()) + "\r\n\r\n" + body;
    asio::write(socket, asio::buffer(request));
    socket.close();  // gone before the answer
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto retry = server.Call("POST", "/v1/train/sessions/" + id + "/forward_backward", body, kBatchContentType);
  ASSERT_EQ(retry.status, 200) << retry.body;
  auto mine = local->ForwardBackward(data, "ppo");
  EXPECT_EQ(Loss(retry), mine->loss);
  auto info = server.Post(id, "get_info", {{"seq", 2}});
  EXPECT_EQ(info.Json()["calls"].get<uint64_t>(), 1u) << "the call ran twice: " << info.body;
  ASSERT_EQ(server.Post(id, "optim_step", {{"seq", 3}}).status, 200);
  ASSERT_TRUE(local->OptimStep({}).ok());
  ExpectSameWeights(server, id, *local, dir, "after");
  // An old seq whose answer is still kept is repeated; a seq gap times out with a 408.
  EXPECT_EQ(server.Post(id, "optim_step", {{"seq", 3}}).status, 200);
  fs::remove_all(dir);
}

TEST(TrainingServiceTest, CallsRunInSeqOrderWhateverOrderTheyArrive) {
  const std::string dir = TempDir("order");
  TrainingServiceOptions options = ServiceOptions(dir);
  options.seq_wait = std::chrono::milliseconds(1500);
  Server server(options);
  const std::string id = server.Open();
  const std::vector<Datum> data = Data(4, 9);
  // optim_step (seq 2) arrives first: run first it would fail (no gradients).
  auto step = std::async(std::launch::async, [&] { return server.Post(id, "optim_step", {{"seq", 2}}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto fb = server.Batch(id, "forward_backward", {{"loss", "cross_entropy"}, {"seq", 1}}, data);
  EXPECT_EQ(fb.status, 200) << fb.body;
  auto stepped = step.get();
  EXPECT_EQ(stepped.status, 200) << stepped.body;
  EXPECT_EQ(stepped.Json()["metrics"]["step"].get<uint64_t>(), 1u);
  // seq 5 while 3 never came: 408 naming the missing seq; the session goes on with 3.
  auto gap = server.Post(id, "get_info", {{"seq", 5}});
  EXPECT_EQ(gap.status, 408) << gap.body;
  EXPECT_NE(gap.body.find("seq 3"), std::string::npos) << gap.body;
  EXPECT_EQ(server.Post(id, "get_info", {{"seq", 3}}).status, 200);
  // A retry of a call that waits for a missing seq gets the same 408, and neither hangs.
  auto first = std::async(std::launch::async, [&] { return server.Post(id, "get_info", {{"seq", 6}}); });
  auto retry = std::async(std::launch::async, [&] { return server.Post(id, "get_info", {{"seq", 6}}); });
  EXPECT_EQ(first.get().status, 408);
  EXPECT_EQ(retry.get().status, 408);
  EXPECT_EQ(server.Post(id, "get_info", {{"seq", 4}}).status, 200);
  fs::remove_all(dir);
}

// ---- sessions belong to the token that opened them ----

constexpr const char* kAlice = "alice-train-token";
constexpr const char* kBob = "bob-train-token";

// The fleet token and two tokens with the train scope, as serve-trainer's
// --scoped-token-file would give them.
transport::HttpServerOptions TwoTrainTokens() {
  transport::HttpServerOptions http;
  http.token = "fleet-token";
  http.scoped_tokens = {{kAlice, transport::kScopeTrain | transport::kScopeRead},
                        {kBob, transport::kScopeTrain | transport::kScopeRead}};
  return http;
}

// The error message of an answer, with `id` written as <id> (to compare two refusals).
std::string MessageWithout(const Server::Answer& answer, const std::string& id) {
  const json body = answer.Json();
  if (!body.is_object() || !body.contains("error")) return "(no error: " + answer.body + ")";
  std::string message = body["error"].value("message", "");
  for (size_t at = message.find(id); !id.empty() && at != std::string::npos; at = message.find(id))
    message.replace(at, id.size(), "<id>");
  return message;
}

// Another token's requests on a session are answered exactly as for a session that does not
// exist (404), and change nothing; the owner's session goes on untouched.
TEST(TrainingServiceTest, AnotherTokenCannotSeeDriveOrCloseASession) {
  const std::string dir = TempDir("owner");
  Server server(ServiceOptions(dir, /*lora=*/true), TwoTrainTokens());
  auto as = [&](const char* token, const std::string& method, const std::string& target,
                const std::string& body = "", const std::string& type = "application/json") {
    return server.Call(method, target, body, type, token);
  };
  auto opened = as(kAlice, "POST", "/v1/train/sessions", json{{"name", "alice-run"}}.dump());
  ASSERT_EQ(opened.status, 201) << opened.body;
  const std::string id = opened.Json()["id"];
  const std::string session = "/v1/train/sessions/" + id;
  const std::string never = "s-000000000000";
  auto unknown = as(kBob, "GET", "/v1/train/sessions/" + never);
  ASSERT_EQ(unknown.status, 404) << unknown.body;
  const std::vector<Datum> data = Data(2, 12);
  struct Attempt {
    std::string what, method, target, body, type;
  };
  const std::string batch = kBatchContentType;
  const std::vector<Attempt> attempts = {
      {"read", "GET", session, "", ""},
      {"forward", "POST", session + "/forward", EncodeBatch({}, data), batch},
      {"forward_backward", "POST", session + "/forward_backward",
       EncodeBatch({{"loss", "cross_entropy"}}, data), batch},
      {"optim_step", "POST", session + "/optim_step", "{}", "application/json"},
      {"save_weights_for_sampler", "POST", session + "/save_weights_for_sampler", "{}", "application/json"},
      {"save_state", "POST", session + "/save_state", json{{"name", "stolen"}}.dump(), "application/json"},
      {"load_state", "POST", session + "/load_state",
       json{{"path", "sessions/" + id + "/none"}}.dump(), "application/json"},
      {"get_info", "POST", session + "/get_info", "{}", "application/json"},
      {"close", "DELETE", session, "", ""},
  };
  for (const Attempt& attempt : attempts) {
    auto answer = as(kBob, attempt.method, attempt.target, attempt.body, attempt.type);
    EXPECT_EQ(answer.status, 404) << "bob's " << attempt.what << " of alice's session: " << answer.body;
    EXPECT_EQ(MessageWithout(answer, id), MessageWithout(unknown, never))
        << "bob's " << attempt.what << " tells alice's session from one that never existed";
  }
  for (const std::string target : {"/v1/train/sessions", "/v1/train/info"}) {
    auto listed = as(kBob, "GET", target);
    ASSERT_EQ(listed.status, 200) << listed.body;
    EXPECT_EQ(listed.Json()["sessions"].size(), 0u) << "bob sees alice's session in " << target
                                                    << ": " << listed.body;
  }
  // Nothing bob sent ran: alice's session has no calls, no step, no state, and stays open.
  auto info = as(kAlice, "POST", session + "/get_info", "{}");
  ASSERT_EQ(info.status, 200) << "bob closed alice's session: " << info.body;
  EXPECT_EQ(info.Json()["calls"].get<uint64_t>(), 0u) << info.body;
  EXPECT_EQ(info.Json()["step"].get<uint64_t>(), 0u) << info.body;
  EXPECT_EQ(info.Json()["saved_states"].size(), 0u) << info.body;
  EXPECT_FALSE(fs::exists(fs::path(dir) / "sessions" / id / "stolen"));
  auto listed = as(kAlice, "GET", "/v1/train/sessions");
  EXPECT_EQ(listed.Json()["sessions"].size(), 1u) << listed.body;
  EXPECT_EQ(as(kAlice, "DELETE", session).status, 200);
  fs::remove_all(dir);
}

// A state saved by one token's session is loaded only by that token: not into another
// token's session, not as another token's from_state, not after the session closed, not
// after a restart (the owner is on disk with the state).
TEST(TrainingServiceTest, AnotherTokenCannotLoadASavedState) {
  const std::string dir = TempDir("owner_state");
  const std::vector<Datum> data = Data(4, 13);
  std::string path, alice_again;
  auto open = [](Server& server, const char* token, const json& request) {
    return server.Call("POST", "/v1/train/sessions", request.dump(), "application/json", token);
  };
  auto post = [](Server& server, const char* token, const std::string& id, const std::string& call,
                 const json& body) {
    return server.Call("POST", "/v1/train/sessions/" + id + "/" + call, body.dump(),
                       "application/json", token);
  };
  {
    Server server(ServiceOptions(dir, /*lora=*/true), TwoTrainTokens());
    auto opened = open(server, kAlice, {{"name", "alice-run"}});
    ASSERT_EQ(opened.status, 201) << opened.body;
    const std::string alice = opened.Json()["id"];
    auto fb = server.Call("POST", "/v1/train/sessions/" + alice + "/forward_backward",
                          EncodeBatch({{"loss", "cross_entropy"}}, data), kBatchContentType, kAlice);
    ASSERT_EQ(fb.status, 200) << fb.body;
    ASSERT_EQ(post(server, kAlice, alice, "optim_step", json::object()).status, 200);
    auto saved = post(server, kAlice, alice, "save_state", {{"name", "mine"}});
    ASSERT_EQ(saved.status, 200) << saved.body;
    path = saved.Json()["path"];

    auto bob_opened = open(server, kBob, {{"name", "bob-run"}});
    ASSERT_EQ(bob_opened.status, 201) << bob_opened.body;
    const std::string bob = bob_opened.Json()["id"];
    auto loaded = post(server, kBob, bob, "load_state", {{"path", path}});
    EXPECT_EQ(loaded.status, 404) << "bob loaded alice's state: " << loaded.body;
    auto from = open(server, kBob, {{"name", "bob-copy"}, {"from_state", path}});
    EXPECT_EQ(from.status, 404) << "bob opened a session from alice's state: " << from.body;
    EXPECT_EQ(post(server, kBob, bob, "get_info", json::object()).Json()["step"].get<uint64_t>(), 0u);
    // Closed, its states are still alice's alone.
    ASSERT_EQ(server.Call("DELETE", "/v1/train/sessions/" + alice, "", "", kAlice).status, 200);
    loaded = post(server, kBob, bob, "load_state", {{"path", path}});
    EXPECT_EQ(loaded.status, 404) << "bob loaded a closed session's state: " << loaded.body;
    auto again = open(server, kAlice, {{"name", "alice-again"}, {"from_state", path}});
    ASSERT_EQ(again.status, 201) << again.body;
    alice_again = again.Json()["id"];
    EXPECT_EQ(again.Json()["step"].get<uint64_t>(), 1u);
    ASSERT_EQ(post(server, kAlice, alice_again, "save_state", {{"name", "again"}}).status, 200);
  }
  // After a restart the restored session is alice's, and so are the states.
  Server server(ServiceOptions(dir, /*lora=*/true), TwoTrainTokens());
  auto bob_list = server.Call("GET", "/v1/train/sessions", "", "", kBob);
  EXPECT_EQ(bob_list.Json()["sessions"].size(), 0u) << bob_list.body;
  EXPECT_EQ(post(server, kBob, alice_again, "get_info", json::object()).status, 404);
  auto info = post(server, kAlice, alice_again, "get_info", json::object());
  EXPECT_EQ(info.status, 200) << info.body;
  auto bob_opened = open(server, kBob, {{"name", "bob-after"}});
  ASSERT_EQ(bob_opened.status, 201) << bob_opened.body;
  auto loaded = post(server, kBob, bob_opened.Json()["id"].get<std::string>(), "load_state", {{"path", path}});
  EXPECT_EQ(loaded.status, 404) << "bob loaded alice's state after a restart: " << loaded.body;
  fs::remove_all(dir);
}

// A state saved before owners were recorded (no "owner" in its session.json) belongs to the
// identity of a server without tokens: with tokens configured no token loads it.
TEST(TrainingServiceTest, StatesSavedBeforeOwnersBelongToTheServerWithoutTokens) {
  const std::string dir = TempDir("owner_legacy");
  std::string path;
  {
    Server server(ServiceOptions(dir, /*lora=*/true));
    const std::string id = server.Open({{"name", "old"}});
    auto saved = server.Post(id, "save_state", {{"name", "old"}});
    ASSERT_EQ(saved.status, 200) << saved.body;
    path = saved.Json()["path"];
    ASSERT_EQ(server.Call("DELETE", "/v1/train/sessions/" + id, "").status, 200);
    const fs::path meta_path = fs::path(dir) / "sessions" / id / "session.json";
    std::ifstream in(meta_path);
    json meta = json::parse(in);
    ASSERT_EQ(meta.value("owner", ""), "anonymous") << meta.dump();
    meta.erase("owner");
    std::ofstream(meta_path) << meta.dump(2) << "\n";
  }
  {
    Server server(ServiceOptions(dir, /*lora=*/true), TwoTrainTokens());
    auto from = server.Call("POST", "/v1/train/sessions",
                            json{{"name", "alice"}, {"from_state", path}}.dump(), "application/json", kAlice);
    EXPECT_EQ(from.status, 404) << "a token loaded a state without an owner: " << from.body;
  }
  Server server(ServiceOptions(dir, /*lora=*/true));
  auto from = server.Call("POST", "/v1/train/sessions", json{{"name", "again"}, {"from_state", path}}.dump());
  EXPECT_EQ(from.status, 201) << from.body;
  fs::remove_all(dir);
}

// Open sessions are capped per token (default 8) and in all (default 64); the refusal names
// the cap and the flag that raises it, and a closed session frees its place.
TEST(TrainingServiceTest, SessionsAreCappedPerTokenAndInAll) {
  const std::string dir = TempDir("cap");
  transport::HttpServerOptions http;
  std::vector<std::string> tokens;
  for (int i = 0; i < 9; ++i) {
    tokens.push_back("train-token-" + std::to_string(i));
    http.scoped_tokens.push_back({tokens.back(), transport::kScopeTrain | transport::kScopeRead});
  }
  Server server(ServiceOptions(dir, /*lora=*/true), http);
  auto open = [&](int token, const std::string& name) {
    return server.Call("POST", "/v1/train/sessions", json{{"name", name}}.dump(), "application/json",
                       tokens[token]);
  };
  std::vector<std::string> first_ids;
  for (int i = 0; i < 8; ++i) {
    auto opened = open(0, "t0-" + std::to_string(i));
    ASSERT_EQ(opened.status, 201) << opened.body;
    first_ids.push_back(opened.Json()["id"]);
  }
  auto refused = open(0, "t0-8");
  EXPECT_EQ(refused.status, 409) << "a ninth session of one token: " << refused.body;
  EXPECT_EQ(refused.Json().value("error", json::object()).value("code", ""), "too_many_sessions") << refused.body;
  EXPECT_NE(refused.body.find("8"), std::string::npos) << refused.body;
  EXPECT_NE(refused.body.find("--max-sessions-per-token"), std::string::npos) << refused.body;
  for (int token = 1; token < 8; ++token) {
    for (int i = 0; i < 8; ++i) {
      auto opened = open(token, "t" + std::to_string(token) + "-" + std::to_string(i));
      ASSERT_EQ(opened.status, 201) << opened.body;
    }
  }
  refused = open(8, "t8-0");
  EXPECT_EQ(refused.status, 409) << "a 65th session: " << refused.body;
  EXPECT_EQ(refused.Json().value("error", json::object()).value("code", ""), "too_many_sessions") << refused.body;
  EXPECT_NE(refused.body.find("64"), std::string::npos) << refused.body;
  EXPECT_NE(refused.body.find("--max-sessions"), std::string::npos) << refused.body;
  EXPECT_EQ(refused.body.find("--max-sessions-per-token"), std::string::npos) << refused.body;
  // A closed session frees its place.
  ASSERT_EQ(server.Call("DELETE", "/v1/train/sessions/" + first_ids[0], "", "", tokens[0]).status, 200);
  auto reopened = open(8, "t8-0");
  EXPECT_EQ(reopened.status, 201) << reopened.body;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::service
