// StartHttpGrader: the grader protocol over HTTP POST, on a few threads of blocking calls.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "base/json.h"
#include "grading/grader.h"
#include "grading/internal.h"
#include "grading/protocol.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::grading {
namespace {

using nlohmann::json;

struct Request {
  Sample sample;
  OutcomeCallback done;
};

using Finished = std::vector<std::pair<OutcomeCallback, Outcome>>;

class HttpGrader final : public AsyncGrader {
 public:
  HttpGrader(std::string url, transport::Endpoint endpoint, std::string target,
             ExternalGraderOptions options)
      : url_(std::move(url)),
        endpoint_(std::move(endpoint)),
        target_(std::move(target)),
        options_(options),
        streak_(options.max_grader_failures) {
    const size_t batch = std::max<size_t>(options_.max_batch, 1);
    const size_t threads = std::max<size_t>(std::max<size_t>(options_.max_in_flight, 1) / batch, 1);
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  }
  ~HttpGrader() override {
    std::deque<Request> left;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      left.swap(pending_);
    }
    wake_.notify_all();
    for (std::thread& thread : threads_) thread.join();
    for (Request& request : left) request.done(Outcome::Ungraded("grader stopped"));
  }

  using AsyncGrader::Submit;
  void Submit(Sample sample, OutcomeCallback done) override {
    {
      std::lock_guard lock(mu_);
      ++counters_.submitted;
      pending_.push_back(Request{std::move(sample), std::move(done)});
    }
    wake_.notify_one();
  }
  Status status() const override {
    std::lock_guard lock(mu_);
    return status_;
  }
  GraderCounters counters() const override {
    std::lock_guard lock(mu_);
    return counters_;
  }
  std::string name() const override { return url_; }

 private:
  void Work();
  void Post(std::vector<Request>& batch, Finished& finished);
  void Answer(std::vector<Request>& batch, const transport::HttpResponse& response,
              Finished& finished);
  // Under mu_:
  void Complete(Request& request, Outcome outcome, Finished& finished);
  void FailAll(Finished& finished);

  const std::string url_;
  const transport::Endpoint endpoint_;
  const std::string target_;
  const ExternalGraderOptions options_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Request> pending_;  // GUARDED_BY(mu_)
  GraderCounters counters_;      // GUARDED_BY(mu_)
  Status status_;                // GUARDED_BY(mu_)
  FailureStreak streak_;         // GUARDED_BY(mu_)
  std::string last_response_;    // GUARDED_BY(mu_): for the failure's message
  bool stopping_ = false;        // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;
};

void HttpGrader::Complete(Request& request, Outcome outcome, Finished& finished) {
  CountOutcome(counters_, outcome);
  if (outcome.kind == OutcomeKind::kReward || outcome.kind == OutcomeKind::kContinue) {
    streak_.Succeed();
  } else if (outcome.kind == OutcomeKind::kUngraded && streak_.Fail() && status_.ok()) {
    status_ = Status::Unavailable("grader '" + url_ + "' failed: more than " +
                                  std::to_string(options_.max_grader_failures) +
                                  " ungraded answers in a row (the last: " + outcome.reason +
                                  "); its last response: " + last_response_);
  }
  finished.emplace_back(std::move(request.done), std::move(outcome));
}

void HttpGrader::FailAll(Finished& finished) {
  Outcome failed;
  failed.kind = OutcomeKind::kFailed;
  failed.reason = status_.message();
  for (Request& request : pending_) Complete(request, failed, finished);
  pending_.clear();
}

void HttpGrader::Work() {
  const size_t batch_size = std::max<size_t>(options_.max_batch, 1);
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
    if (stopping_) return;
    Finished finished;
    std::vector<Request> batch;
    if (!status_.ok()) {
      FailAll(finished);
    } else {
      while (!pending_.empty() && batch.size() < batch_size) {
        batch.push_back(std::move(pending_.front()));
        pending_.pop_front();
      }
    }
    lock.unlock();
    if (!batch.empty()) Post(batch, finished);
    for (auto& [done, outcome] : finished) done(std::move(outcome));
    lock.lock();
  }
}

void HttpGrader::Post(std::vector<Request>& batch, Finished& finished) {
  std::string body;
  if (batch.size() == 1) {
    body = protocol::RequestText(batch[0].sample);
  } else {
    json array = json::array();
    for (const Request& request : batch) array.push_back(protocol::RequestJson(request.sample));
    body = array.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  transport::HttpGetOptions http;
  http.timeout = options_.timeout;
  auto response = transport::HttpPost(endpoint_, target_, body, http);
  if (!response.ok()) {
    std::lock_guard lock(mu_);
    last_response_ = response.status().message();
    for (Request& request : batch) {
      ++counters_.ungraded_crash;
      Complete(request, Outcome::Ungraded("HTTP call failed: " + response.status().message()),
               finished);
    }
    return;
  }
  Answer(batch, *response, finished);
}

void HttpGrader::Answer(std::vector<Request>& batch, const transport::HttpResponse& response,
                        Finished& finished) {
  std::lock_guard lock(mu_);
  last_response_ = "HTTP " + std::to_string(response.status) + " " + response.body.substr(0, 500);
  auto parsed = ParseJson(response.body, "grader answer");
  std::string bad;
  if (response.status != 200)
    bad = "HTTP status " + std::to_string(response.status);
  else if (!parsed.ok())
    bad = "bad answer: not JSON";
  if (!bad.empty()) {
    for (Request& request : batch) {
      ++counters_.ungraded_bad_answer;
      Complete(request, Outcome::Ungraded(bad), finished);
    }
    return;
  }
  const json answers = parsed->is_array() ? *parsed : json::array({*parsed});
  std::map<std::string, Request*> waiting;
  for (Request& request : batch) waiting[request.sample.id] = &request;
  for (const json& element : answers) {
    protocol::Answer answer = protocol::AnswerFromJson(element);
    if (answer.id.empty() && batch.size() == 1) answer.id = batch[0].sample.id;
    auto found = waiting.find(answer.id);
    if (found == waiting.end()) {
      ++counters_.unknown_ids;
      continue;
    }
    if (answer.outcome.kind == OutcomeKind::kUngraded) ++counters_.ungraded_bad_answer;
    Complete(*found->second, std::move(answer.outcome), finished);
    waiting.erase(found);
  }
  for (auto& [id, request] : waiting) {
    ++counters_.ungraded_no_answer;
    Complete(*request, Outcome::Ungraded("no answer for this id in the response"), finished);
  }
}

}  // namespace

Result<std::unique_ptr<AsyncGrader>> StartHttpGrader(const std::string& url,
                                                     const ExternalGraderOptions& options) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) {
    return Status::InvalidArgument("grader URL '" + url +
                                   "' is not http://HOST:PORT[/PATH] (https is not supported)");
  }
  const size_t slash = url.find('/', scheme.size());
  std::string authority = url.substr(
      scheme.size(), slash == std::string::npos ? std::string::npos : slash - scheme.size());
  const std::string target = slash == std::string::npos ? "/" : url.substr(slash);
  if (authority.find(':') == std::string::npos || authority.back() == ']') authority += ":80";
  auto endpoint = transport::ParseEndpoint(authority);
  if (!endpoint.ok() || authority.front() == ':') {
    return Status::InvalidArgument("grader URL '" + url + "' has no usable HOST:PORT");
  }
  if (options.timeout.count() <= 0 || options.max_grader_failures < 0) {
    return Status::InvalidArgument("grader '" + url +
                                   "': timeout must be > 0 and max_grader_failures >= 0");
  }
  return std::unique_ptr<AsyncGrader>(
      std::make_unique<HttpGrader>(url, *endpoint, target, options));
}

}  // namespace flywheel::grading
