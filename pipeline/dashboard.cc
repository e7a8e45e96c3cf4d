#include "pipeline/dashboard.h"

#include <filesystem>
#include <iomanip>
#include <random>
#include <span>
#include <sstream>
#include <string_view>
#include <thread>

#include "base/env.h"
#include "ops/process.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// At most `limit` bytes of `text`, never ending inside a UTF-8 character.
std::string Cut(std::string text, size_t limit) {
  if (text.size() <= limit) return text;
  size_t end = limit;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  text.resize(end);
  text += "…";
  return text;
}

// A step row as the page plots it: -1 ("not measured") becomes null, a gap in the curve.
json RowJson(const StepRow& row) {
  json out = row.ToJson();
  if (row.eval_accuracy < 0) out["eval_accuracy"] = nullptr;
  if (row.sync_ms < 0) out["sync_ms"] = nullptr;
  return out;
}

// 32 hex digits from the OS's random source (std::random_device reads /dev/urandom).
std::string RandomToken() {
  std::random_device device;
  std::ostringstream token;
  token << std::hex;
  for (int i = 0; i < 4; ++i) token << std::setw(8) << std::setfill('0') << device();
  return token.str();
}

// "since=N" of a request target; 0 when absent or not a number.
uint64_t SinceOf(const std::string& target) {
  const size_t query = target.find('?');
  if (query == std::string::npos) return 0;
  std::istringstream pairs(target.substr(query + 1));
  std::string pair;
  while (std::getline(pairs, pair, '&')) {
    if (pair.rfind("since=", 0) != 0) continue;
    try {
      size_t used = 0;
      const unsigned long long value = std::stoull(pair.substr(6), &used);
      if (used == pair.size() - 6) return value;
    } catch (const std::exception&) {
    }
    return 0;
  }
  return 0;
}

std::string Dump(const json& value) {
  // Decoded completions may hold invalid UTF-8 (a character split across tokens).
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<std::vector<StepRow>> ReadRows(const std::string& path) {
  FW_ASSIGN_OR_RETURN(std::string text, ops::ReadWholeFile(path));
  std::vector<StepRow> rows;
  std::istringstream lines(text);
  std::string line;
  size_t number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (number == 1 || line.empty()) continue;  // the header
    Result<StepRow> row = StepRow::FromCsv(line);
    if (!row.ok()) {
      return Status::Corruption(path + ":" + std::to_string(number) + ": " + row.status().message());
    }
    rows.push_back(*row);
  }
  return rows;
}

Result<std::vector<RolloutView>> ReadRollouts(const std::string& path) {
  std::vector<RolloutView> rollouts;
  if (!fs::exists(path)) return rollouts;
  FW_ASSIGN_OR_RETURN(std::string text, ops::ReadWholeFile(path));
  std::istringstream lines(text);
  std::string line;
  size_t number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (line.empty()) continue;
    json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
    Result<RolloutView> rollout = RolloutView::FromJson(value);
    if (!rollout.ok()) {
      return Status::Corruption(path + ":" + std::to_string(number) + ": " + rollout.status().message());
    }
    rollouts.push_back(std::move(*rollout));
  }
  return rollouts;
}

}  // namespace

json RolloutView::ToJson() const {
  return {{"step", step},     {"version", version},       {"worker", worker},
          {"prompt", prompt}, {"completion", completion}, {"reward", reward}};
}

Result<RolloutView> RolloutView::FromJson(const json& value) {
  if (!value.is_object()) return Status::Corruption("a rollout is not a JSON object");
  RolloutView out;
  try {
    out.step = value.at("step").get<uint64_t>();
    out.version = value.at("version").get<uint64_t>();
    out.worker = value.at("worker").get<std::string>();
    out.prompt = value.at("prompt").get<std::string>();
    out.completion = value.at("completion").get<std::string>();
    out.reward = value.at("reward").get<double>();
  } catch (const json::exception& e) {
    return Status::Corruption(std::string("a rollout's keys: ") + e.what());
  }
  return out;
}

DashboardFeed::DashboardFeed(json run) : run_(std::move(run)) {}

void DashboardFeed::AddStep(const StepRow& row, json extra) {
  std::lock_guard lock(mutex_);
  rows_.push_back(row);
  extras_.push_back(extra.is_object() ? std::move(extra) : json::object());
}

void DashboardFeed::AddRollouts(std::vector<RolloutView> rollouts) {
  std::lock_guard lock(mutex_);
  for (RolloutView& rollout : rollouts) {
    rollout.prompt = Cut(std::move(rollout.prompt), kText);
    rollout.completion = Cut(std::move(rollout.completion), kText);
    rollouts_.push_back(std::move(rollout));
    if (rollouts_.size() > kRollouts) rollouts_.pop_front();
  }
}

void DashboardFeed::SetLive(std::function<json()> live) {
  std::lock_guard lock(mutex_);
  live_ = std::move(live);
}

json DashboardFeed::Json(uint64_t since) const {
  std::function<json()> live;
  json out;
  {
    std::lock_guard lock(mutex_);
    json steps = json::array();
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (rows_[i].step <= since) continue;
      json row = RowJson(rows_[i]);
      row.update(extras_[i]);
      steps.push_back(std::move(row));
    }
    json rollouts = json::array();
    for (auto it = rollouts_.rbegin(); it != rollouts_.rend(); ++it) rollouts.push_back(it->ToJson());
    out = {{"run", run_},
           {"steps", std::move(steps)},
           {"last_step", rows_.empty() ? 0 : rows_.back().step},
           {"rollouts", std::move(rollouts)}};
    live = live_;
  }
  // Outside the lock: the live part reads the trainer's and the publisher's state.
  out["live"] = live ? live() : json(nullptr);
  return out;
}

std::vector<RolloutView> DashboardFeed::rollouts() const {
  std::lock_guard lock(mutex_);
  return {rollouts_.begin(), rollouts_.end()};
}

size_t DashboardFeed::steps() const {
  std::lock_guard lock(mutex_);
  return rows_.size();
}

Result<std::shared_ptr<DashboardFeed>> DashboardFeed::FromReport(const std::string& report_dir) {
  const std::string metrics = (fs::path(report_dir) / "metrics.csv").string();
  if (!fs::exists(metrics)) {
    return Status::NotFound(report_dir + " holds no run report (no metrics.csv)");
  }
  FW_ASSIGN_OR_RETURN(std::vector<StepRow> rows, ReadRows(metrics));
  json run = {{"title", fs::path(report_dir).lexically_normal().string()}, {"source", "report"}};
  Result<RunSummary> summary = ReadSummary(report_dir);
  if (summary.ok()) {
    run["summary"] = summary->ToJson();
  } else if (summary.status().code() != StatusCode::kNotFound) {
    return summary.status();
  }
  auto feed = std::make_shared<DashboardFeed>(std::move(run));
  for (const StepRow& row : rows) feed->AddStep(row);
  FW_ASSIGN_OR_RETURN(std::vector<RolloutView> rollouts,
                      ReadRollouts((fs::path(report_dir) / "rollouts.jsonl").string()));
  feed->AddRollouts(std::move(rollouts));
  return feed;
}

Status WriteRollouts(const std::string& report_dir, const std::vector<RolloutView>& rollouts) {
  std::string text;
  for (const RolloutView& rollout : rollouts) text += Dump(rollout.ToJson()) + "\n";
  return WriteFileAtomically((fs::path(report_dir) / "rollouts.jsonl").string(),
                             std::as_bytes(std::span(text.data(), text.size())));
}

void AddDashboardRoutes(transport::HttpServer& server, std::shared_ptr<DashboardFeed> feed) {
  server.Route(
      "/dashboard",
      [](const std::string&) { return transport::HttpResponse{200, "text/html; charset=utf-8", DashboardPage()}; },
      /*is_public=*/true);
  server.Route(
      "/dashboard/chart.js",
      [](const std::string&) {
        if (ChartJs().empty()) {
          return transport::HttpResponse{404, "text/plain; charset=utf-8",
                                         "this build has no Chart.js (Debian's libjs-chart.js was not "
                                         "installed when it was configured): the page shows tables only\n"};
        }
        return transport::HttpResponse{200, "text/javascript; charset=utf-8", ChartJs()};
      },
      /*is_public=*/true);
  server.Route(
      "/v1/dashboard",
      [feed](const std::string& target) {
        return transport::HttpResponse{200, "application/json", Dump(feed->Json(SinceOf(target)))};
      },
      /*is_public=*/false, transport::kScopeRead);
}

Result<std::string> DashboardToken(const std::string& path) {
  if (fs::exists(path)) {
    Result<std::string> text = ops::ReadWholeFile(path);
    if (!text.ok()) return Status::IOError("cannot read the dashboard token " + path + ": " + text.status().message());
    std::string token = *text;
    while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
    if (token.empty()) return Status::InvalidArgument(path + " holds no dashboard token (remove it to make a new one)");
    return token;
  }
  const std::string token = RandomToken();
  const std::string line = token + "\n";
  Result<AtomicFile> file = AtomicFile::Create(path, Env::Default(), 0600);
  if (!file.ok()) return Status::IOError("cannot write the dashboard token " + path + ": " + file.status().message());
  FW_RETURN_IF_ERROR(file->Append(std::as_bytes(std::span(line.data(), line.size()))));
  FW_RETURN_IF_ERROR(file->Commit());
  return token;
}

struct ReportServer::Impl {
  transport::asio::io_context io{1};
  std::shared_ptr<DashboardFeed> feed;
  std::unique_ptr<transport::HttpServer> http;
  std::string token;
  std::string endpoint;
  std::thread thread;
};

Result<std::unique_ptr<ReportServer>> ReportServer::Start(const std::string& report_dir,
                                                          const std::string& listen) {
  auto impl = std::make_unique<Impl>();
  FW_ASSIGN_OR_RETURN(impl->feed, DashboardFeed::FromReport(report_dir));
  FW_ASSIGN_OR_RETURN(transport::Endpoint endpoint, transport::ParseEndpoint(listen));
  impl->token = RandomToken();
  transport::HttpServerOptions options;
  options.scoped_tokens.push_back({impl->token, transport::kScopeRead});
  FW_ASSIGN_OR_RETURN(impl->http, transport::HttpServer::Start(impl->io.get_executor(), endpoint, options));
  AddDashboardRoutes(*impl->http, impl->feed);
  const size_t colon = listen.rfind(':');
  impl->endpoint = listen.substr(0, colon) + ":" + std::to_string(impl->http->port());
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<ReportServer>(new ReportServer(std::move(impl)));
}

ReportServer::ReportServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ReportServer::~ReportServer() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->http.reset();  // stopped after its executor (transport/http.h allows it)
}

uint16_t ReportServer::port() const { return impl_->http->port(); }
const std::string& ReportServer::token() const { return impl_->token; }
std::string ReportServer::url() const { return DashboardUrl(impl_->endpoint, impl_->token, false); }
const DashboardFeed& ReportServer::feed() const { return *impl_->feed; }

std::string DashboardUrl(const std::string& endpoint, const std::string& token, bool tls) {
  std::string host = endpoint;
  if (host.rfind("0.0.0.0:", 0) == 0) host = "127.0.0.1:" + host.substr(8);
  if (host.rfind("[::]:", 0) == 0) host = "127.0.0.1:" + host.substr(5);
  std::string url = std::string(tls ? "https://" : "http://") + host + "/dashboard";
  if (!token.empty()) url += "#token=" + token;
  return url;
}

}  // namespace flywheel::pipeline
