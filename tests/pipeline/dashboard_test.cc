// pipeline/dashboard.h: what the dashboard serves (steps after `since`, gaps as nulls, the
// newest rollouts, texts cut at character boundaries), a report directory read back (and
// the errors of a malformed one), the routes over HTTP with their scopes, the read-only
// token file. The page in a real browser: tests/pipeline/dashboard_browser_test.py.
#include "pipeline/dashboard.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

StepRow Row(uint64_t step) {
  StepRow row;
  row.step = step;
  row.version = step;
  row.mean_reward = 0.125 * static_cast<double>(step);
  row.eval_accuracy = step % 2 == 0 ? 0.5 : -1;
  row.sync_ms = step > 1 ? 40 : -1;
  row.loss = -0.25;
  row.samples = 64;
  return row;
}

fs::path TempDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("fw-dashboard-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(DashboardFeedTest, StepsAfterSinceWithGapsAsNullsAndTheirExtras) {
  DashboardFeed feed(json{{"title", "t"}});
  for (uint64_t step = 1; step <= 5; ++step) feed.AddStep(Row(step), json{{"samples_ungraded", step * 2}});
  const json all = feed.Json(0);
  ASSERT_EQ(all["steps"].size(), 5u);
  EXPECT_EQ(all["last_step"], 5);
  EXPECT_TRUE(all["steps"][0]["eval_accuracy"].is_null());  // not evaluated at step 1
  EXPECT_TRUE(all["steps"][0]["sync_ms"].is_null());
  EXPECT_EQ(all["steps"][1]["eval_accuracy"], 0.5);
  EXPECT_EQ(all["steps"][2]["samples_ungraded"], 6);
  EXPECT_TRUE(all["live"].is_null());
  const json later = feed.Json(3);
  ASSERT_EQ(later["steps"].size(), 2u);
  EXPECT_EQ(later["steps"][0]["step"], 4);
  EXPECT_EQ(feed.Json(5)["steps"].size(), 0u);
  feed.SetLive([] { return json{{"status", {{"phase", "rl"}}}}; });
  EXPECT_EQ(feed.Json(5)["live"]["status"]["phase"], "rl");
}

TEST(DashboardFeedTest, KeepsTheNewestRolloutsFirstAndCutsTextAtACharacterBoundary) {
  DashboardFeed feed(json::object());
  std::vector<RolloutView> views;
  for (uint64_t i = 0; i < DashboardFeed::kRollouts + 10; ++i) {
    views.push_back({.step = i, .version = i, .worker = "w", .prompt = "p", .completion = "c", .reward = 1});
  }
  feed.AddRollouts(views);
  const json doc = feed.Json(0);
  ASSERT_EQ(doc["rollouts"].size(), DashboardFeed::kRollouts);
  EXPECT_EQ(doc["rollouts"][0]["step"], DashboardFeed::kRollouts + 9);  // newest first
  EXPECT_EQ(doc["rollouts"].back()["step"], 10);
  // A 3-byte character straddling the limit is dropped whole, never split.
  std::string long_text(DashboardFeed::kText - 1, 'a');
  long_text += "\xE2\x82\xAC tail";
  feed.AddRollouts({{.step = 1, .version = 1, .worker = "w", .prompt = long_text, .completion = "x", .reward = 0}});
  const std::string kept = feed.rollouts().back().prompt;
  EXPECT_EQ(kept, std::string(DashboardFeed::kText - 1, 'a') + "…");
}

TEST(DashboardFeedTest, ReadsAReportDirectoryBack) {
  const fs::path dir = TempDir("report");
  std::vector<StepRow> rows = {Row(1), Row(2), Row(3)};
  {
    std::ofstream(dir / "metrics.csv") << MetricsCsv(rows);
  }
  const std::vector<RolloutView> rollouts = {
      {.step = 3, .version = 2, .worker = "worker-us-1", .prompt = "sort 312", .completion = "123", .reward = 1}};
  ASSERT_TRUE(WriteRollouts(dir.string(), rollouts).ok());
  Result<std::shared_ptr<DashboardFeed>> feed = DashboardFeed::FromReport(dir.string());
  ASSERT_TRUE(feed.ok()) << feed.status().ToString();
  EXPECT_EQ((*feed)->steps(), 3u);
  EXPECT_EQ((*feed)->rollouts(), rollouts);
  const json doc = (*feed)->Json(0);
  EXPECT_EQ(doc["run"]["source"], "report");
  EXPECT_FALSE(doc["run"].contains("summary"));  // an interrupted run: no summary.json
  EXPECT_EQ(doc["steps"][2]["mean_reward"], 0.375);
  fs::remove_all(dir);
}

TEST(DashboardFeedTest, AMalformedReportIsNamedByFileAndLine) {
  const fs::path dir = TempDir("bad");
  EXPECT_EQ(DashboardFeed::FromReport(dir.string()).status().code(), StatusCode::kNotFound);
  {
    std::ofstream(dir / "metrics.csv") << MetricsCsv({Row(1)}) << "2,3,not-a-number\n";
  }
  Status bad = DashboardFeed::FromReport(dir.string()).status();
  EXPECT_EQ(bad.code(), StatusCode::kCorruption);
  EXPECT_NE(bad.message().find("metrics.csv:3"), std::string::npos) << bad.message();
  {
    std::ofstream(dir / "metrics.csv") << MetricsCsv({Row(1)});
    std::ofstream(dir / "rollouts.jsonl") << "{\"step\": 1}\n";
  }
  bad = DashboardFeed::FromReport(dir.string()).status();
  EXPECT_EQ(bad.code(), StatusCode::kCorruption);
  EXPECT_NE(bad.message().find("rollouts.jsonl:1"), std::string::npos) << bad.message();
  fs::remove_all(dir);
}

TEST(DashboardTokenTest, MadeOnceWithMode0600AndKept) {
  const fs::path dir = TempDir("token");
  const std::string path = (dir / "dashboard.token").string();
  Result<std::string> first = DashboardToken(path);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->size(), 32u);
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  EXPECT_EQ(*DashboardToken(path), *first);  // a restarted trainer keeps the URL
  const fs::path other = dir / "other.token";
  EXPECT_NE(*DashboardToken(other.string()), *first);
  {
    std::ofstream(dir / "empty.token") << "\n";
  }
  EXPECT_EQ(DashboardToken((dir / "empty.token").string()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DashboardUrl("0.0.0.0:8080", "abc", false), "http://127.0.0.1:8080/dashboard#token=abc");
  EXPECT_EQ(DashboardUrl("127.0.0.1:1", "", true), "https://127.0.0.1:1/dashboard");
  fs::remove_all(dir);
}

// The routes on a real server with a read token and a submit-only token.
TEST(DashboardRoutesTest, ThePageIsPublicTheDataNeedsTheReadScope) {
  transport::asio::io_context io{1};
  transport::HttpServerOptions options;
  options.token = "fleet-token";
  options.scoped_tokens = {{"reader", transport::kScopeRead}, {"submitter", transport::kScopeSubmit}};
  Result<std::unique_ptr<transport::HttpServer>> server =
      transport::HttpServer::Start(io.get_executor(), {"127.0.0.1", 0}, options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto feed = std::make_shared<DashboardFeed>(json{{"title", "routes"}});
  feed->AddStep(Row(1));
  feed->AddStep(Row(2));
  AddDashboardRoutes(**server, feed);
  std::thread thread([&] { io.run(); });
  const transport::Endpoint endpoint{"127.0.0.1", (*server)->port()};
  auto get = [&](const std::string& target, const std::string& token) {
    transport::HttpGetOptions get_options;
    get_options.token = token;
    Result<transport::HttpResponse> response = transport::HttpGet(endpoint, target, get_options);
    EXPECT_TRUE(response.ok()) << response.status().ToString();
    return response.ok() ? *response : transport::HttpResponse{0, "", ""};
  };
  const transport::HttpResponse page = get("/dashboard", "");
  EXPECT_EQ(page.status, 200);
  EXPECT_NE(page.content_type.find("text/html"), std::string::npos);
  EXPECT_NE(page.body.find("/v1/dashboard"), std::string::npos);
  const transport::HttpResponse chart = get("/dashboard/chart.js", "");
  if (ChartJs().empty()) {
    EXPECT_EQ(chart.status, 404);
  } else {
    EXPECT_EQ(chart.status, 200);
    EXPECT_NE(chart.body.find("Chart"), std::string::npos);
  }
  EXPECT_EQ(get("/v1/dashboard", "").status, 401);
  EXPECT_EQ(get("/v1/dashboard", "submitter").status, 403);
  const transport::HttpResponse data = get("/v1/dashboard?since=1", "reader");
  ASSERT_EQ(data.status, 200);
  const json doc = json::parse(data.body);
  ASSERT_EQ(doc["steps"].size(), 1u);
  EXPECT_EQ(doc["steps"][0]["step"], 2);
  EXPECT_EQ(get("/v1/dashboard?since=oops", "fleet-token").status, 200);  // the fleet token reads too
  transport::asio::post(io, [&] { (*server)->Stop(); });
  thread.join();
}

TEST(ReportServerTest, ServesAReportBehindATokenOfItsOwn) {
  const fs::path dir = TempDir("serve");
  {
    std::ofstream(dir / "metrics.csv") << MetricsCsv({Row(1), Row(2)});
  }
  Result<std::unique_ptr<ReportServer>> server = ReportServer::Start(dir.string(), "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_NE((*server)->url().find("#token=" + (*server)->token()), std::string::npos);
  const transport::Endpoint endpoint{"127.0.0.1", (*server)->port()};
  transport::HttpGetOptions options;
  EXPECT_EQ(transport::HttpGet(endpoint, "/v1/dashboard", options)->status, 401);
  options.token = (*server)->token();
  Result<transport::HttpResponse> data = transport::HttpGet(endpoint, "/v1/dashboard", options);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(json::parse(data->body)["steps"].size(), 2u);
  server->reset();
  EXPECT_FALSE(ReportServer::Start((dir / "missing").string(), "127.0.0.1:0").ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::pipeline
