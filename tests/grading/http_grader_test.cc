// The grader protocol over HTTP POST against a grader served on a loopback port (port 0):
// one object per request, batches as JSON arrays answered in any order, bad answers, a
// server that is gone (failing the grader with the URL in the message).
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

#include "grading/grader.h"
#include "tests/grading/grading_test_util.h"
#include "transport/http.h"

namespace flywheel::grading {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;
using testing::Await;
using testing::MakeSample;
using transport::HttpResponse;

// An HTTP grader at http://127.0.0.1:<port>/grade on its own thread: reward = the
// completion's length; a batch is answered reversed; "bad" gets a NaN-free but non-number
// reward, "drop" no answer at all, and each body's size in requests is counted.
class HttpGraderServer {
 public:
  HttpGraderServer() {
    auto server = transport::HttpServer::Start(io_.get_executor(), {"127.0.0.1", 0}, {});
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    if (!server.ok()) return;
    server_ = std::move(server).value();
    server_->RoutePost(
        "/grade",
        [this](std::string, std::string body) -> transport::awaitable<HttpResponse> {
          co_return Answer(body);
        },
        1 << 20, transport::kScopeSubmit);
    thread_ = std::thread([this] { io_.run(); });
  }
  ~HttpGraderServer() { Stop(); }
  void Stop() {
    if (!thread_.joinable()) return;
    transport::asio::post(io_, [this] { server_->Stop(); });
    thread_.join();
  }
  std::string url() const {
    return "http://127.0.0.1:" + std::to_string(server_->port()) + "/grade";
  }
  int largest_batch() const { return largest_batch_; }

 private:
  HttpResponse Answer(const std::string& body) {
    json requests = json::parse(body);
    const bool batch = requests.is_array();
    if (!batch) requests = json::array({requests});
    largest_batch_ = std::max<int>(largest_batch_, static_cast<int>(requests.size()));
    json answers = json::array();
    for (auto it = requests.rbegin(); it != requests.rend(); ++it) {
      const std::string completion = (*it)["completion"];
      if (completion == "drop") continue;
      if (completion == "status500") return HttpResponse{500, "text/plain", "grader bug"};
      json reward = completion == "bad" ? json("high") : json(completion.size());
      answers.push_back({{"id", (*it)["id"]}, {"reward", reward}});
    }
    if (!batch)
      return HttpResponse{200, "application/json", answers.empty() ? "{}" : answers[0].dump()};
    return HttpResponse{200, "application/json", answers.dump()};
  }

  transport::asio::io_context io_;
  std::unique_ptr<transport::HttpServer> server_;
  std::thread thread_;
  std::atomic<int> largest_batch_{0};
};

TEST(HttpGraderTest, OneRequestPerPost) {
  HttpGraderServer server;
  auto grader = StartHttpGrader(server.url());
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  std::vector<std::future<Outcome>> futures;
  for (int i = 0; i < 10; ++i)
    futures.push_back((*grader)->Submit(MakeSample("s" + std::to_string(i), std::string(i, 'y'))));
  for (int i = 0; i < 10; ++i) {
    Outcome outcome = Await(futures[i]);
    ASSERT_EQ(outcome.kind, OutcomeKind::kReward) << outcome.reason;
    EXPECT_EQ(outcome.reward, i);
  }
  EXPECT_EQ(server.largest_batch(), 1);
  EXPECT_EQ((*grader)->name(), server.url());
}

TEST(HttpGraderTest, BatchesAsArraysAnsweredInAnyOrder) {
  HttpGraderServer server;
  ExternalGraderOptions options;
  options.max_batch = 4;
  options.max_in_flight = 4;  // one POST at a time: the rest queue into batches
  auto grader = StartHttpGrader(server.url(), options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  std::vector<std::future<Outcome>> futures;
  for (int i = 0; i < 21; ++i)
    futures.push_back((*grader)->Submit(MakeSample("s" + std::to_string(i), std::string(i, 'z'))));
  futures.push_back((*grader)->Submit(MakeSample("bad", "bad")));
  futures.push_back((*grader)->Submit(MakeSample("drop", "drop")));
  for (int i = 0; i < 21; ++i) {
    Outcome outcome = Await(futures[i]);
    ASSERT_EQ(outcome.kind, OutcomeKind::kReward) << outcome.reason;
    EXPECT_EQ(outcome.reward, i);
  }
  EXPECT_EQ(Await(futures[21]).kind, OutcomeKind::kUngraded);
  Outcome dropped = Await(futures[22]);
  EXPECT_EQ(dropped.kind, OutcomeKind::kUngraded);
  EXPECT_NE(dropped.reason.find("no answer for this id"), std::string::npos) << dropped.reason;
  EXPECT_GT(server.largest_batch(), 1);
  EXPECT_LE(server.largest_batch(), 4);
  GraderCounters counters = (*grader)->counters();
  EXPECT_EQ(counters.ungraded_bad_answer, 1u);
  EXPECT_EQ(counters.ungraded_no_answer, 1u);
}

TEST(HttpGraderTest, ServerErrorsAreUngradedAndAGoneServerFailsTheGrader) {
  HttpGraderServer server;
  ExternalGraderOptions options;
  options.max_grader_failures = 2;
  options.timeout = milliseconds(2000);
  options.max_in_flight = 1;
  auto grader = StartHttpGrader(server.url(), options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  auto error = (*grader)->Submit(MakeSample("e", "status500"));
  Outcome outcome = Await(error);
  EXPECT_EQ(outcome.kind, OutcomeKind::kUngraded);
  EXPECT_NE(outcome.reason.find("HTTP status 500"), std::string::npos) << outcome.reason;
  server.Stop();
  for (int i = 0; i < 3; ++i) {
    auto gone = (*grader)->Submit(MakeSample("g" + std::to_string(i), "x"));
    Await(gone);
  }
  ASSERT_FALSE((*grader)->status().ok());
  EXPECT_NE((*grader)->status().message().find(server.url()), std::string::npos)
      << (*grader)->status().message();
  auto after = (*grader)->Submit(MakeSample("after", "x"));
  EXPECT_EQ(Await(after).kind, OutcomeKind::kFailed);
}

TEST(HttpGraderTest, BadUrlsAreRefused) {
  for (const char* url :
       {"https://127.0.0.1:9/grade", "127.0.0.1:9", "http://:9/x", "http://host:port/x"}) {
    auto grader = StartHttpGrader(url);
    EXPECT_FALSE(grader.ok()) << url;
    if (!grader.ok()) {
      EXPECT_NE(grader.status().message().find(url), std::string::npos);
    }
  }
  EXPECT_TRUE(StartHttpGrader("http://localhost/grade").ok());  // port 80 by default
}

}  // namespace
}  // namespace flywheel::grading
