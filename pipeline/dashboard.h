// The live dashboard of a run (issue 36), served on the trainer's HTTP port during
// `flywheel train` and `flywheel demo`, and from a finished run's report directory by
// `flywheel report serve DIR`:
//
//   GET /dashboard            the page (public: it holds no data)
//   GET /dashboard/chart.js   Chart.js, built into the binary from Debian's libjs-chart.js
//                             (public; nothing is fetched from elsewhere at view time)
//   GET /v1/dashboard?since=N scope read: the step rows after step N, the run's live status
//                             (the trainer's counters, the fleet as the publisher sees it)
//                             and the latest rollouts, as JSON
//
// The page polls /v1/dashboard every second. Its token travels in the URL's fragment
// (http://host:port/dashboard#token=...), which a browser never sends to a server (so it
// stays out of access logs and Referer headers); the page keeps it in sessionStorage and
// sends it as a bearer token, so the API's scopes apply unchanged: a token without `read`
// gets 403. The trainer mints a read-only token for this (DashboardToken) instead of
// printing the fleet's token.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "pipeline/run_record.h"

namespace flywheel::transport {
class HttpServer;
}

namespace flywheel::pipeline {

// One sampled answer as the dashboard shows it.
struct RolloutView {
  uint64_t step = 0;     // the RL step that trained on it
  uint64_t version = 0;  // the policy version that sampled it (its oldest token's)
  std::string worker;
  std::string prompt;
  std::string completion;
  double reward = 0;
  bool operator==(const RolloutView&) const = default;
  nlohmann::json ToJson() const;
  static Result<RolloutView> FromJson(const nlohmann::json& value);
};

// What the dashboard serves. Thread-safe.
class DashboardFeed {
 public:
  static constexpr size_t kRollouts = 64;  // the newest rollouts kept
  static constexpr size_t kText = 2000;    // prompt and completion characters kept (UTF-8 safe)

  // `run`: what the page's header says ({"title": ..., "source": "live"|"report", ...}).
  explicit DashboardFeed(nlohmann::json run);

  // `extra`: further numbers of the step (the run's totals then, e.g. samples_ungraded),
  // plotted beside the row's own.
  void AddStep(const StepRow& row, nlohmann::json extra = nlohmann::json::object());
  // Keeps the newest kRollouts; texts longer than kText are cut (at a character boundary).
  void AddRollouts(std::vector<RolloutView> rollouts);
  // The live part of each answer ("status", "fleet", ...), called per request on the HTTP
  // server's thread; null: none (a finished run).
  void SetLive(std::function<nlohmann::json()> live);

  // {"run", "steps": [rows with step > since], "last_step", "rollouts", "live": {...}|null}.
  nlohmann::json Json(uint64_t since) const;
  std::vector<RolloutView> rollouts() const;
  size_t steps() const;

  // A finished (or interrupted) run from its report directory: metrics.csv, summary.json
  // when present, rollouts.jsonl when present. NotFound when metrics.csv is missing;
  // Corruption naming the file and line of a malformed row.
  static Result<std::shared_ptr<DashboardFeed>> FromReport(const std::string& report_dir);

 private:
  mutable std::mutex mutex_;
  nlohmann::json run_;
  std::vector<StepRow> rows_;
  std::vector<nlohmann::json> extras_;  // one per row
  std::deque<RolloutView> rollouts_;
  std::function<nlohmann::json()> live_;
};

// <report>/rollouts.jsonl: one RolloutView a line, written atomically.
Status WriteRollouts(const std::string& report_dir, const std::vector<RolloutView>& rollouts);

// The routes above. REQUIRES: as HttpServer::Route (before requests arrive).
void AddDashboardRoutes(transport::HttpServer& server, std::shared_ptr<DashboardFeed> feed);

// `flywheel report serve DIR`: the dashboard of a finished run from its report directory
// (DashboardFeed::FromReport), on its own I/O thread, behind a read-only token made for
// this server (in memory only). The destructor stops it.
class ReportServer {
 public:
  // `listen`: HOST:PORT (port 0: a free one).
  static Result<std::unique_ptr<ReportServer>> Start(const std::string& report_dir, const std::string& listen);
  ~ReportServer();
  ReportServer(const ReportServer&) = delete;
  ReportServer& operator=(const ReportServer&) = delete;
  uint16_t port() const;
  const std::string& token() const;
  std::string url() const;  // with the token
  const DashboardFeed& feed() const;
  struct Impl;

 private:
  explicit ReportServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The read-only token in `path`, made (32 hex digits from the OS's random source, mode
// 0600, written atomically) when the file does not exist yet, so a restarted trainer keeps
// the URL an open page uses. IOError naming the file when it cannot be read or written;
// InvalidArgument when it holds no token.
Result<std::string> DashboardToken(const std::string& path);

// "http(s)://endpoint/dashboard" with "#token=..." when `token` is not empty. An endpoint
// bound to 0.0.0.0 or [::] is shown as 127.0.0.1 (what a browser on this host opens).
std::string DashboardUrl(const std::string& endpoint, const std::string& token, bool tls);

// The page and the chart library, for the routes and for tests.
const std::string& DashboardPage();
// Chart.js (empty when the build found no libjs-chart.js: the page then shows tables only).
const std::string& ChartJs();

}  // namespace flywheel::pipeline
