#include "service/training_service.h"

#include <spdlog/spdlog.h>

#include <boost/asio/thread_pool.hpp>
#include <algorithm>
#include <bit>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <cstring>
#include <thread>

#include "base/env.h"
#include "checkpoint/hash.h"
#include "model/fp8.h"
#include "model/weights.h"
#include "ops/metrics.h"
#include "service/training_wire.h"
#include "pipeline/dashboard.h"
#include "sync/publisher.h"
#include "sync/role_status.h"
#include "sync/role.h"
#include "sync/signing.h"
#include "transport/api.h"
#include "transport/connection.h"

namespace flywheel::service {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

using transport::HttpResponse;

// The answers of the API (transport/api.h: one error shape, one Status -> HTTP table).
HttpResponse Error(int status, std::string code, std::string message) {
  return transport::ErrorResponse(transport::ApiError{status, std::move(code), std::move(message)});
}

HttpResponse Json(const json& body, int status = 200) {
  return transport::JsonResponse(status, body);
}

// A Status from the trainer as an answer, by the table.
HttpResponse FromStatus(const Status& status) {
  return transport::ErrorResponse(status);
}

bool ValidName(const std::string& name) {
  static const std::regex pattern("[A-Za-z0-9._-]{1,64}");
  return std::regex_match(name, pattern) && name != "." && name != "..";
}

std::string NewSessionId() {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  char text[20];
  std::snprintf(text, sizeof(text), "s-%012llx",
                static_cast<unsigned long long>(rng() & 0xffffffffffffull));
  return text;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

Status TrainingServiceOptions::Validate() const {
  if (state_dir.empty()) return Status::InvalidArgument("the training service needs a state directory");
  if (session_idle_timeout.count() <= 0)
    return Status::InvalidArgument("the session idle timeout must be > 0");
  if (seq_wait.count() <= 0) return Status::InvalidArgument("the seq wait must be > 0");
  if (max_batch_tokens < 1) return Status::InvalidArgument("max batch tokens must be >= 1");
  if (max_body_bytes < 1024) return Status::InvalidArgument("the body limit must be >= 1 KiB");
  if (answers_kept < 1) return Status::InvalidArgument("answers kept must be >= 1");
  if (http_threads < 2) return Status::InvalidArgument("http threads must be >= 2");
  if (max_sessions_per_identity < 1)
    return Status::InvalidArgument("--max-sessions-per-token must be >= 1, got " +
                                   std::to_string(max_sessions_per_identity));
  if (max_sessions < 1)
    return Status::InvalidArgument("--max-sessions must be >= 1, got " + std::to_string(max_sessions));
  return Status::Ok();
}

std::string TokenIdentity(std::string_view token) {
  return transport::TokenIdentity(token);
}

std::string IdentityOf(const transport::HttpRequest& request) {
  if (request.scopes == ~0u || request.identity.empty()) return std::string(kAnonymousIdentity);
  return request.identity;
}

struct CallState {
  uint64_t seq = 0;
  std::string name;  // the call ("forward_backward", ...), for the dashboard
  std::function<HttpResponse()> run;  // on the trainer thread, the session active
  bool queued = false;                 // in the ready queue (its turn came)
  bool started = false;
  bool done = false;
  HttpResponse answer;
  Clock::time_point arrived = Clock::now();
};

struct Session {
  std::string id, name;
  std::string owner;  // the identity that opened it (TokenIdentity), never a token
  bool closed = false;
  // Ordering: the next seq to queue; floating after a restore (the first call sets it).
  uint64_t next_seq = 1;
  bool seq_floating = false;
  uint64_t max_seq = 0;
  std::map<uint64_t, std::shared_ptr<CallState>> waiting;  // seq > next_seq
  std::map<uint64_t, std::shared_ptr<CallState>> recent;   // queued, running or answered
  int inflight = 0;                                         // submitted, not answered
  Clock::time_point last_activity = Clock::now();
  uint64_t calls = 0;
  // The trainable state while another session is active (empty while this one is).
  trainer::TrainableState state;
  // What the trainer thread last saw (read by GETs without touching the client).
  uint64_t step = 0, last_version = 0;
  int64_t pending_tokens = 0;
  std::vector<std::string> saved_states;  // relative paths, oldest first
  // LoRA: the adapter of the last save_weights_for_sampler, named for serving, and hashes.
  OwnedCheckpoint adapter;
  std::vector<Hash128> adapter_hashes;
};

struct TrainingService::Impl {
  TrainingServiceOptions options;
  sync::Publisher* publisher = nullptr;
  std::unique_ptr<trainer::TrainingClient> client;
  bool lora = false;
  trainer::TrainableState initial;
  OwnedCheckpoint base;  // LoRA: the frozen base in the serving dtype
  std::vector<Hash128> base_hashes;
  std::atomic<uint64_t> version{0};
  int64_t parameters_total = 0, parameters_trainable = 0;

  std::mutex mutex;
  std::condition_variable wake;  // the trainer thread: a call is ready, or stop
  std::condition_variable done;  // handlers: a call was answered
  bool stopping = false;
  // LoRA: a session with a served adapter went away; the next version drops its adapter.
  bool republish = false;
  std::map<std::string, std::shared_ptr<Session>> sessions;  // open ones, by id
  struct Gone {
    std::string why, owner;
  };
  std::map<std::string, Gone> gone;  // closed or expired, by id
  struct Job {
    std::shared_ptr<Session> session;  // null: a job of the service itself
    std::shared_ptr<CallState> call;
  };
  std::deque<Job> ready;
  std::thread thread;
  std::shared_ptr<Session> active;  // whose state the client holds (trainer thread only)
  uint64_t calls_total = 0, calls_failed = 0;
  size_t waiting_total = 0;  // calls of all sessions waiting for an earlier seq
  static constexpr uint64_t kSeqWindow = 256;  // how far ahead of the next seq a call may be
  std::unique_ptr<boost::asio::thread_pool> pool;
  // The dashboard (pipeline/dashboard.h): a step row per optim_step, with the metrics of
  // the forward_backward before it; the newest calls of every session. GUARDED_BY(mutex)
  // but for `dashboard`, which locks itself.
  std::shared_ptr<pipeline::DashboardFeed> dashboard;
  std::deque<json> recent_calls;  // newest last, at most kRecentCalls
  static constexpr size_t kRecentCalls = 64;
  uint64_t optim_steps = 0, sequences_since_step = 0;
  json last_batch_metrics;
  Clock::time_point started = Clock::now();

  // The trainer thread.
  void Run();
  HttpResponse Execute(const Job& job);
  void Activate(const std::shared_ptr<Session>& session);
  void NoteClient(Session& session);
  void ExpireIdle();  // REQUIRES: mutex
  // REQUIRES: mutex. What the dashboard shows of a call that ran for `took`.
  void NoteCall(const Session& session, const CallState& call, const HttpResponse& answer,
                Clock::duration took);
  json DashboardLive();  // the dashboard's live part (takes the mutex)
  // sessions/<id>/session.json: the session's owner, name and saved states.
  [[nodiscard]] Status WriteSessionFile(const Session& session, bool closed, const std::string& why);

  // Requests (`identity`: who sends it, see IdentityOf).
  HttpResponse Info(std::string_view identity);
  json SessionInfo(const Session& s);  // REQUIRES: mutex
  json SessionList(std::string_view identity);  // REQUIRES: mutex. The caller's open sessions.
  HttpResponse CreateSession(const std::string& body, std::string_view identity);
  HttpResponse CloseSession(const std::string& id, std::string_view identity);
  HttpResponse Call(const std::string& id, const std::string& call, const std::string& body,
                     std::string_view identity);
  // REQUIRES: mutex. 409 too_many_sessions when `identity` may open no further session.
  std::optional<HttpResponse> CheckSessionCaps(std::string_view identity);
  // What a call runs on the trainer thread (the session active), from its decoded request.
  std::function<HttpResponse()> BatchRun(const std::string& call, std::shared_ptr<WireBatch> batch);
  std::function<HttpResponse()> JsonRun(const std::string& call, Session* s,
                                         std::shared_ptr<json> body_json);
  // REQUIRES: mutex. NotFound, with the same message as an id never seen, for another
  // identity's session.
  Result<std::shared_ptr<Session>> Find(const std::string& id, std::string_view identity);
  // Submits `run` as call `seq` (0: next) of `session` and waits for its answer.
  HttpResponse SubmitAndWait(const std::shared_ptr<Session>& session, const std::string& name, uint64_t seq,
                              std::function<HttpResponse()> run);
  // REQUIRES: mutex. Records the call (or finds the one a retry repeats) and queues it when
  // its turn has come. Mismatch: an old seq whose answer is gone.
  Result<std::shared_ptr<CallState>> Enqueue(const std::shared_ptr<Session>& session, uint64_t seq,
                                             std::function<HttpResponse()> run);
  // Runs `run` on the trainer thread (no session) and waits.
  HttpResponse RunOnTrainer(std::function<HttpResponse()> run);

  // The calls (trainer thread, session active).
  HttpResponse SaveWeights(Session& s);
  HttpResponse SaveState(Session& s, const json& body);
  HttpResponse LoadState(Session& s, const json& body);
  // The directory of saved state `relative` (sessions/<id>/<name>). InvalidArgument: not of
  // that form; NotFound: no such state, or session <id> is not `owner`'s (the same message).
  Result<std::string> StatePath(const std::string& relative, std::string_view owner);
  // The owner session.json records for session `id` (kAnonymousIdentity when it records none:
  // saved before owners were recorded). NotFound: no readable session.json.
  Result<std::string> SavedOwner(const std::string& id);
  // Publishes base + every open session's adapter (LoRA) as `v`.
  Result<json> PublishLora(uint64_t v);
  Status RestoreSessions();
  Status PublishStart();
};

// ---- the trainer thread ----

void TrainingService::Impl::Run() {
  std::unique_lock lock(mutex);
  while (true) {
    wake.wait_for(lock, std::chrono::seconds(1), [&] { return stopping || republish || !ready.empty(); });
    if (stopping) break;
    ExpireIdle();
    if (republish) {
      republish = false;
      lock.unlock();
      auto published = PublishLora(version.load() + 1);
      if (!published.ok()) spdlog::error("training service: {}", published.status().ToString());
      lock.lock();
      continue;
    }
    if (ready.empty()) continue;
    Job job = std::move(ready.front());
    ready.pop_front();
    job.call->started = true;
    lock.unlock();
    const Clock::time_point began = Clock::now();
    HttpResponse answer = Execute(job);
    lock.lock();
    if (job.session) NoteCall(*job.session, *job.call, answer, Clock::now() - began);
    job.call->answer = std::move(answer);
    job.call->done = true;
    job.call->run = nullptr;
    ++calls_total;
    if (job.call->answer.status >= 400) ++calls_failed;
    if (job.session) {
      ++job.session->calls;
      job.session->last_activity = Clock::now();
      --job.session->inflight;
    }
    done.notify_all();
  }
  // Stopping: whoever waits is answered 503 (their calls never ran).
  for (Job& job : ready) {
    job.call->answer = Error(503, "unavailable", "the training service is stopping");
    job.call->done = true;
  }
  ready.clear();
  done.notify_all();
}

HttpResponse TrainingService::Impl::Execute(const Job& job) {
  try {
    if (job.session) {
      {
        std::lock_guard lock(mutex);
        if (job.session->closed)
          return Error(404, "not_found", "session " + job.session->id + " was closed");
      }
      Activate(job.session);
    }
    HttpResponse answer = job.call->run();
    if (job.session) NoteClient(*job.session);
    return answer;
  } catch (const std::exception& e) {
    spdlog::error("training service: call failed: {}", e.what());
    return Error(500, "internal", std::string("the trainer failed: ") + e.what());
  }
}

void TrainingService::Impl::Activate(const std::shared_ptr<Session>& session) {
  if (active == session) return;
  bool active_open = false;
  if (active) {
    std::lock_guard lock(mutex);
    active_open = !active->closed;
  }
  if (active_open) active->state = client->ExportTrainable();
  Status imported = client->ImportTrainable(session->state);
  if (!imported.ok()) throw std::runtime_error(imported.ToString());
  session->state = {};
  active = session;
}

void TrainingService::Impl::NoteClient(Session& s) {
  std::lock_guard lock(mutex);
  s.step = client->step();
  s.last_version = client->last_sampler_version();
  s.pending_tokens = client->pending_tokens();
}

void TrainingService::Impl::ExpireIdle() {
  const Clock::time_point now = Clock::now();
  for (auto it = sessions.begin(); it != sessions.end();) {
    Session& s = *it->second;
    if (s.inflight == 0 && s.waiting.empty() && now - s.last_activity > options.session_idle_timeout) {
      const std::string why = "session " + s.id + " expired after " +
                              std::to_string(static_cast<int64_t>(Seconds(now - s.last_activity))) +
                              " s idle" +
                              (s.saved_states.empty()
                                   ? std::string(" (it saved no state)")
                                   : "; create a session with from_state \"" +
                                         s.saved_states.back() + "\" to go on");
      spdlog::info("training service: {}", why);
      s.closed = true;
      gone[s.id] = {why, s.owner};
      republish |= lora && !s.adapter.tensors.empty();
      if (!s.saved_states.empty()) {
        Status written = WriteSessionFile(s, true, "expired");
        if (!written.ok()) spdlog::error("training service: {}", written.ToString());
      }
      it = sessions.erase(it);
    } else {
      ++it;
    }
  }
}

Status TrainingService::Impl::WriteSessionFile(const Session& s, bool closed, const std::string& why) {
  const json meta = {{"id", s.id},
                     {"name", s.name},
                     {"owner", s.owner},
                     {"closed", closed},
                     {"why", why},
                     {"saved_states", s.saved_states},
                     {"latest", s.saved_states.empty() ? "" : s.saved_states.back()}};
  const std::string text = meta.dump(2) + "\n";
  const fs::path path = fs::path(options.state_dir) / "sessions" / s.id / "session.json";
  return WriteFileAtomically(path.string(), std::as_bytes(std::span(text)));
}

// ---- requests ----

Result<std::shared_ptr<Session>> TrainingService::Impl::Find(const std::string& id,
                                                              std::string_view identity) {
  if (auto it = sessions.find(id); it != sessions.end() && it->second->owner == identity)
    return it->second;
  if (auto it = gone.find(id); it != gone.end() && it->second.owner == identity)
    return Status::NotFound(it->second.why);
  return Status::NotFound("unknown session " + id);
}

json TrainingService::Impl::SessionList(std::string_view identity) {
  json list = json::array();
  for (const auto& [id, s] : sessions) {
    if (s->owner == identity) list.push_back(SessionInfo(*s));
  }
  return list;
}

std::optional<HttpResponse> TrainingService::Impl::CheckSessionCaps(std::string_view identity) {
  const auto mine = std::count_if(sessions.begin(), sessions.end(),
                                  [&](const auto& entry) { return entry.second->owner == identity; });
  if (mine >= options.max_sessions_per_identity) {
    return Error(409, "too_many_sessions",
                 "this token already has " + std::to_string(mine) + " open sessions, the most " +
                     "--max-sessions-per-token (" + std::to_string(options.max_sessions_per_identity) +
                     ") allows; close one (DELETE /v1/train/sessions/{id}) or start serve-trainer "
                     "with a larger --max-sessions-per-token");
  }
  if (sessions.size() >= static_cast<size_t>(options.max_sessions)) {
    return Error(409, "too_many_sessions",
                 "the server already has " + std::to_string(sessions.size()) +
                     " open sessions, the most --max-sessions (" + std::to_string(options.max_sessions) +
                     ") allows; close one (DELETE /v1/train/sessions/{id}) or start serve-trainer "
                     "with a larger --max-sessions");
  }
  return std::nullopt;
}

json TrainingService::Impl::SessionInfo(const Session& s) {
  return {{"id", s.id},
          {"name", s.name},
          {"mode", lora ? "lora" : "full"},
          {"step", s.step},
          {"last_version", s.last_version},
          {"pending", {{"tokens", s.pending_tokens}}},
          {"idle_s", Seconds(Clock::now() - s.last_activity)},
          {"calls", s.calls},
          {"next_seq", s.seq_floating ? json(nullptr) : json(s.next_seq)},
          {"saved_states", s.saved_states},
          {"adapter", lora ? json(s.name) : json(nullptr)},
          {"model_type", client->options().config.model_type},
          {"parameters", {{"total", parameters_total}, {"trainable", parameters_trainable}}}};
}

HttpResponse TrainingService::Impl::Info(std::string_view identity) {
  const model::ModelConfig& config = client->options().config;
  json lora_json = nullptr;
  if (lora) {
    const auto& l = *client->options().lora;
    lora_json = {{"rank", l.rank},
                 {"alpha", l.alpha},
                 {"targets", l.targets},
                 {"packed_experts", model::PackFormatName(client->options().pack_frozen_experts)}};
  }
  std::lock_guard lock(mutex);
  return Json({{"mode", lora ? "lora" : "full"},
               {"model", config.ToJson()},
               {"parameters",
                {{"total", parameters_total}, {"trainable", parameters_trainable}}},
               {"lora", lora_json},
               {"serving_dtype", client->options().fp8_serving
                                     ? std::string("F8_E4M3")
                                     : std::string(DTypeName(client->options().serving_dtype))},
               {"version", version.load()},
               {"identity", std::string(identity)},
               {"sessions", SessionList(identity)},
               {"limits",
                {{"max_batch_tokens", options.max_batch_tokens},
                 {"max_body_bytes", options.max_body_bytes},
                 {"session_idle_timeout_s", Seconds(options.session_idle_timeout)},
                 {"max_sessions_per_token", options.max_sessions_per_identity},
                 {"max_sessions", options.max_sessions}}}});
}

HttpResponse TrainingService::Impl::RunOnTrainer(std::function<HttpResponse()> run) {
  auto call = std::make_shared<CallState>();
  call->run = std::move(run);
  std::unique_lock lock(mutex);
  if (stopping) return Error(503, "unavailable", "the training service is stopping");
  call->queued = true;
  ready.push_back({nullptr, call});
  wake.notify_all();
  done.wait(lock, [&] { return call->done; });
  return call->answer;
}

HttpResponse TrainingService::Impl::CreateSession(const std::string& body, std::string_view identity) {
  json request = body.empty() ? json::object() : ParseShallowJson(body);
  if (request.is_discarded() || !request.is_object())
    return Error(400, "bad_request", "the body must be a JSON object (nested at most 16 deep)");
  for (const auto& [key, value] : request.items()) {
    if (key != "name" && key != "from_state")
      return Error(400, "bad_request", "unknown key '" + key + "' (known: name, from_state)");
    if (!value.is_string()) return Error(400, "bad_request", key + " must be a string");
  }
  auto session = std::make_shared<Session>();
  session->id = NewSessionId();
  session->owner = std::string(identity);
  session->name = request.value("name", session->id);
  if (!ValidName(session->name))
    return Error(400, "bad_request", "session name '" + session->name +
                                         "' must be 1-64 of A-Z a-z 0-9 . _ -");
  const std::string from = request.value("from_state", "");
  // Who else holds the weights or the name, told without another identity's session id.
  auto full_conflict = [&](const char* when) {
    const Session& holder = *sessions.begin()->second;
    return Error(409, "session_conflict",
                 std::string("full fine-tuning: ") +
                     (holder.owner == identity ? "session " + holder.id : std::string("another token's session")) +
                     " owns the weights" + when +
                     "; close it first (or start the server with --lora-rank for sessions that "
                     "share the base)");
  };
  auto name_taken = [&](const Session& holder, const char* when) {
    return Error(409, "name_taken",
                 (holder.owner == identity ? "session " + holder.id : std::string("another token's session")) +
                     " is already named " + session->name + when +
                     " (a name is the adapter workers serve, one namespace for every token)");
  };
  {
    std::lock_guard lock(mutex);
    if (stopping) return Error(503, "unavailable", "the training service is stopping");
    if (!lora && !sessions.empty()) return full_conflict("");
    if (auto refused = CheckSessionCaps(identity)) return *refused;
    for (const auto& [id, s] : sessions) {
      if (s->name == session->name) return name_taken(*s, "");
    }
    session->state = initial;
  }
  if (!from.empty()) {
    HttpResponse loaded = RunOnTrainer([&]() -> HttpResponse {
      Activate(session);
      HttpResponse answer = LoadState(*session, json{{"path", from}});
      NoteClient(*session);
      return answer;
    });
    if (loaded.status != 200) return loaded;
  }
  std::lock_guard lock(mutex);
  if (!lora && !sessions.empty()) return full_conflict(" (it opened meanwhile)");
  if (auto refused = CheckSessionCaps(identity)) return *refused;
  for (const auto& [id, other] : sessions) {
    if (other->name == session->name) return name_taken(*other, " (it opened meanwhile)");
  }
  sessions[session->id] = session;
  session->last_activity = Clock::now();
  spdlog::info("training service: session {} ({}) opened by {}{}", session->id, session->name,
               session->owner, from.empty() ? "" : " from " + from);
  return Json(SessionInfo(*session), 201);
}

HttpResponse TrainingService::Impl::CloseSession(const std::string& id, std::string_view identity) {
  std::lock_guard lock(mutex);
  auto found = Find(id, identity);
  if (!found.ok()) return FromStatus(found.status());
  std::shared_ptr<Session> s = *found;
  s->closed = true;
  gone[id] = {"session " + id + " was closed", s->owner};
  sessions.erase(id);
  for (auto& [seq, call] : s->waiting) {  // calls waiting for an earlier seq never run
    call->answer = Error(404, "not_found", "session " + id + " was closed");
    call->done = true;
    --s->inflight;
    --waiting_total;
  }
  s->waiting.clear();
  done.notify_all();
  if (lora && !s->adapter.tensors.empty()) {
    republish = true;  // workers stop serving its adapter at the next version
    wake.notify_all();
  }
  if (!s->saved_states.empty()) {
    Status written = WriteSessionFile(*s, true, "closed");
    if (!written.ok()) spdlog::error("training service: {}", written.ToString());
  }
  spdlog::info("training service: session {} closed", id);
  return Json({{"closed", id}});
}

Result<std::shared_ptr<CallState>> TrainingService::Impl::Enqueue(
    const std::shared_ptr<Session>& session, uint64_t seq, std::function<HttpResponse()> run) {
  Session& s = *session;
  if (seq == 0) seq = std::max(s.max_seq, s.next_seq - 1) + 1;
  if (s.seq_floating) {
    s.next_seq = seq;
    s.seq_floating = false;
  }
  if (auto it = s.recent.find(seq); it != s.recent.end()) return it->second;  // a retry
  if (seq < s.next_seq) {
    return Status(StatusCode::kMismatch, "call seq " + std::to_string(seq) + " of session " + s.id +
                                             " ran long ago; its answer is no longer kept (next seq: " +
                                             std::to_string(s.next_seq) + ")");
  }
  if (seq > s.next_seq + kSeqWindow) {
    return Status::InvalidArgument("call seq " + std::to_string(seq) + " is more than " +
                                   std::to_string(kSeqWindow) + " ahead of session " + s.id +
                                   "'s next seq " + std::to_string(s.next_seq));
  }
  if (seq != s.next_seq && waiting_total >= static_cast<size_t>(options.http_threads / 2)) {
    return Status::Unavailable("too many calls wait for earlier seqs (" +
                               std::to_string(waiting_total) + "); send the missing ones first");
  }
  auto call = std::make_shared<CallState>();
  call->seq = seq;
  call->run = std::move(run);
  s.max_seq = std::max(s.max_seq, seq);
  s.recent[seq] = call;
  ++s.inflight;
  s.last_activity = Clock::now();
  if (seq == s.next_seq) {
    auto queue = [&](const std::shared_ptr<CallState>& c) {
      c->queued = true;
      ready.push_back({session, c});
      ++s.next_seq;
    };
    queue(call);
    while (!s.waiting.empty() && s.waiting.begin()->first == s.next_seq) {
      queue(s.waiting.begin()->second);
      s.waiting.erase(s.waiting.begin());
      --waiting_total;
    }
    wake.notify_all();
  } else {
    s.waiting[seq] = call;
    ++waiting_total;
  }
  // Keep the last answers_kept answered calls for retries, and at most 64 MiB of them
  // (forward answers with MoE routing are large).
  size_t kept_bytes = 0;
  for (const auto& [kept_seq, kept] : s.recent) kept_bytes += kept->done ? kept->answer.body.size() : 0;
  while (!s.recent.empty() && s.recent.begin()->second->done &&
         (s.recent.size() > options.answers_kept || kept_bytes > (64u << 20))) {
    kept_bytes -= s.recent.begin()->second->answer.body.size();
    s.recent.erase(s.recent.begin());
  }
  return call;
}

HttpResponse TrainingService::Impl::SubmitAndWait(const std::shared_ptr<Session>& session,
                                                   const std::string& name, uint64_t seq,
                                                   std::function<HttpResponse()> run) {
  std::unique_lock lock(mutex);
  if (stopping) return Error(503, "unavailable", "the training service is stopping");
  if (session->closed) return Error(404, "not_found", "session " + session->id + " was closed");
  Session& s = *session;
  auto enqueued = Enqueue(session, seq, std::move(run));
  if (!enqueued.ok()) {
    if (enqueued.status().code() == StatusCode::kMismatch)
      return Error(409, "seq_replayed", enqueued.status().message());
    return FromStatus(enqueued.status());
  }
  std::shared_ptr<CallState> call = *enqueued;
  if (call->name.empty()) call->name = name;
  const Clock::time_point deadline = call->arrived + options.seq_wait;
  while (!call->done) {
    if (!call->queued && Clock::now() >= deadline) {
      // Its turn never came: an earlier seq never arrived.
      if (auto it = s.waiting.find(call->seq); it != s.waiting.end() && it->second == call) {
        s.waiting.erase(it);
        --waiting_total;
        s.recent.erase(call->seq);
        --s.inflight;
        // Later calls without a seq go after what is still known, not after this one.
        s.max_seq = std::max(s.next_seq - 1, s.waiting.empty() ? 0 : s.waiting.rbegin()->first);
        // A retry waiting on the same call gets the same answer.
        call->answer = Error(408, "seq_timeout",
                             "call seq " + std::to_string(call->seq) + " of session " + s.id +
                                 " waited " + std::to_string(Seconds(options.seq_wait)) +
                                 " s for seq " + std::to_string(s.next_seq) +
                                 ", which never arrived; send it (next seq: " +
                                 std::to_string(s.next_seq) + ")");
        call->done = true;
        done.notify_all();
        return call->answer;
      }
    }
    if (stopping && !call->started) return Error(503, "unavailable", "the training service is stopping");
    done.wait_for(lock, std::chrono::milliseconds(200));
  }
  return call->answer;
}

namespace {

// The seq of a call: in the JSON body / batch header, else 0 (the next one).
Result<uint64_t> ReadSeq(const json& header) {
  if (!header.contains("seq")) return uint64_t{0};
  const json& seq = header["seq"];
  if (!seq.is_number_unsigned() || seq.get<uint64_t>() < 1)
    return Status::InvalidArgument("seq must be an integer >= 1, got " + seq.dump());
  return seq.get<uint64_t>();
}

bool IsBatchCall(const std::string& call) {
  return call == "forward" || call == "forward_backward" || call == "forward_backward_custom";
}

}  // namespace

std::function<HttpResponse()> TrainingService::Impl::BatchRun(const std::string& call,
                                                             std::shared_ptr<WireBatch> batch) {
  trainer::TrainingClient* c = client.get();
  std::function<HttpResponse()> run;
  if (call == "forward") {
    run = [c, batch]() -> HttpResponse {
      for (const auto& [key, value] : batch->header.items())
        return Error(400, "bad_request", "forward: unknown header key '" + key + "'");
      auto out = c->Forward(batch->datums);
      if (!out.ok()) return FromStatus(out.status());
      return {200, kBatchContentType, EncodeForwardOutput(*out)};
    };
  } else if (call == "forward_backward") {
    run = [c, batch]() -> HttpResponse {
      const json& h = batch->header;
      for (const auto& [key, value] : h.items()) {
        if (key != "loss" && key != "loss_config")
          return Error(400, "bad_request",
                       "forward_backward: unknown header key '" + key + "' (known: loss, loss_config)");
      }
      if (!h.contains("loss") || !h["loss"].is_string())
        return Error(400, "bad_request", "forward_backward: header \"loss\" (a loss name) is missing");
      auto config = LossConfigFromJson(h.value("loss_config", json()));
      if (!config.ok()) return FromStatus(config.status());
      if (!batch->grads.empty())
        return Error(400, "bad_request", "forward_backward: grads belong to forward_backward_custom");
      auto metrics = c->ForwardBackward(batch->datums, h["loss"].get<std::string>(), *config);
      if (!metrics.ok()) return FromStatus(metrics.status());
      return Json({{"metrics", ToJson(*metrics)}});
    };
  } else {
    run = [c, batch]() -> HttpResponse {
      const json& h = batch->header;
      for (const auto& [key, value] : h.items()) {
        if (key != "loss_value")
          return Error(400, "bad_request", "forward_backward_custom: unknown header key '" + key +
                                               "' (known: loss_value)");
      }
      if (batch->grads.empty())
        return Error(400, "bad_request", "forward_backward_custom: the grads array is missing");
      const json lv = h.value("loss_value", json(0.0));
      if (!lv.is_number())
        return Error(400, "bad_request", "forward_backward_custom: loss_value must be a number");
      auto metrics = c->ForwardBackwardFromGrads(batch->datums, batch->grads, lv.get<double>());
      if (!metrics.ok()) return FromStatus(metrics.status());
      return Json({{"metrics", ToJson(*metrics)}});
    };
  }
  return run;
}

std::function<HttpResponse()> TrainingService::Impl::JsonRun(const std::string& call, Session* s,
                                                            std::shared_ptr<json> body_json) {
  trainer::TrainingClient* c = client.get();
  std::function<HttpResponse()> run;
  if (call == "optim_step") {
    run = [c, body_json]() -> HttpResponse {
      for (const auto& [key, value] : body_json->items()) {
        if (key != "adam")
          return Error(400, "bad_request", "optim_step: unknown key '" + key + "' (known: adam)");
      }
      auto adam = AdamFromJson(body_json->value("adam", json()));
      if (!adam.ok()) return FromStatus(adam.status());
      auto metrics = c->OptimStep(*adam);
      if (!metrics.ok()) return FromStatus(metrics.status());
      return Json({{"metrics", ToJson(*metrics)}});
    };
  } else if (call == "save_weights_for_sampler") {
    run = [this, s, body_json]() -> HttpResponse {
      if (!body_json->empty())
        return Error(400, "bad_request", "save_weights_for_sampler takes no parameters");
      return SaveWeights(*s);
    };
  } else if (call == "save_state") {
    run = [this, s, body_json] { return SaveState(*s, *body_json); };
  } else if (call == "load_state") {
    run = [this, s, body_json] { return LoadState(*s, *body_json); };
  } else {  // get_info
    run = [this, s]() -> HttpResponse {
      NoteClient(*s);
      std::lock_guard lock(mutex);
      return Json(SessionInfo(*s));
    };
  }
  return run;
}

HttpResponse TrainingService::Impl::Call(const std::string& id, const std::string& call,
                                          const std::string& body, std::string_view identity) {
  std::shared_ptr<Session> session;
  {
    std::lock_guard lock(mutex);
    auto found = Find(id, identity);
    if (!found.ok()) return FromStatus(found.status());
    session = *found;
  }
  static const std::set<std::string> kCalls = {
      "forward",    "forward_backward", "forward_backward_custom", "optim_step",
      "save_weights_for_sampler", "save_state", "load_state", "get_info"};
  if (!kCalls.count(call)) {
    return Error(404, "not_found",
                 "unknown call '" + call +
                     "' (known: forward, forward_backward, forward_backward_custom, optim_step, "
                     "save_weights_for_sampler, save_state, load_state, get_info)");
  }
  trainer::TrainingClient* c = client.get();
  // Decode here, on the pool; a refused request still takes its turn (its seq), so the calls
  // after it are not held up, and its answer is what a retry gets.
  if (IsBatchCall(call)) {
    WireLimits limits;
    limits.max_tokens = options.max_batch_tokens;
    const model::ModelConfig& config = c->options().config;
    limits.routing_per_token = config.NumMoeLayers() * config.num_experts_per_tok;
    auto decoded = DecodeBatch(body, limits);
    if (!decoded.ok()) {
      // Without a readable header there is no seq: answer at once.
      if (body.size() < 8 || body.compare(0, 4, "FWB1") != 0) return FromStatus(decoded.status());
      uint32_t n = 0;
      std::memcpy(&n, body.data() + 4, 4);
      json header = n <= body.size() - 8 && n <= (16u << 20) ? ParseShallowJson(body.substr(8, n)) : json();
      auto seq = header.is_object() ? ReadSeq(header) : Result<uint64_t>(Status::InvalidArgument(""));
      if (!seq.ok()) return FromStatus(decoded.status());
      Status why = decoded.status();
      return SubmitAndWait(session, call, *seq, [why] { return FromStatus(why); });
    }
    auto batch = std::make_shared<WireBatch>(std::move(*decoded));
    auto seq = ReadSeq(batch->header);
    if (!seq.ok()) return FromStatus(seq.status());
    batch->header.erase("seq");
    return SubmitAndWait(session, call, *seq, BatchRun(call, std::move(batch)));
  }
  json request = body.empty() ? json::object() : ParseShallowJson(body);
  if (request.is_discarded() || !request.is_object())
    return Error(400, "bad_request", call + ": the body must be a JSON object (nested at most 16 deep)");
  auto seq = ReadSeq(request);
  if (!seq.ok()) return FromStatus(seq.status());
  request.erase("seq");
  auto body_json = std::make_shared<json>(std::move(request));
  return SubmitAndWait(session, call, *seq, JsonRun(call, session.get(), std::move(body_json)));
}

// ---- the calls that touch more than the client ----

Result<json> TrainingService::Impl::PublishLora(uint64_t v) {
  CheckpointView view = base.view();
  std::vector<Hash128> hashes = base_hashes;
  // The views point into the sessions' adapters: hold the sessions until Publish returns
  // (a session closed meanwhile is dropped from `sessions`, not freed under the views).
  std::vector<std::shared_ptr<Session>> held;
  {
    std::lock_guard lock(mutex);
    for (const auto& [id, s] : sessions) {
      held.push_back(s);
      const CheckpointView adapter = s->adapter.view();
      view.insert(view.end(), adapter.begin(), adapter.end());
      hashes.insert(hashes.end(), s->adapter_hashes.begin(), s->adapter_hashes.end());
    }
  }
  FW_ASSIGN_OR_RETURN(Hash128 hash, CheckpointHashFromTensorHashes(view, hashes));
  json out = {{"version", v}, {"weights_hash", hash.ToHex()}, {"delta_bytes", 0}, {"keyframe_bytes", 0}};
  uint64_t bytes = 0;
  for (const TensorView& t : view) bytes += t.data.size();
  out["bytes"] = bytes;
  if (publisher) {
    sync::AppendOptions known;
    known.tensor_hashes = hashes;
    known.checkpoint_hash = hash;
    FW_ASSIGN_OR_RETURN(sync::AppendResult published, publisher->Publish(v, view, known));
    uint64_t delta = 0, keyframe = 0;
    for (const sync::ArtifactInfo& info : published.artifacts)
      (info.kind == sync::ArtifactKind::kDelta ? delta : keyframe) += info.size_bytes;
    out["delta_bytes"] = delta;
    out["keyframe_bytes"] = keyframe;
  }
  version = v;
  return out;
}

HttpResponse TrainingService::Impl::SaveWeights(Session& s) {
  const uint64_t v = version.load() + 1;
  if (!lora) {
    auto snapshot = client->SaveWeightsForSampler(v);
    if (!snapshot.ok()) return FromStatus(snapshot.status());
    version = v;
    return Json({{"version", v},
                 {"adapter", nullptr},
                 {"weights_hash", snapshot->weights_hash},
                 {"bytes", snapshot->bytes},
                 {"delta_bytes", snapshot->published_delta_bytes},
                 {"keyframe_bytes", snapshot->published_keyframe_bytes}});
  }
  auto snapshot = client->SaveWeightsForSampler(v);
  if (!snapshot.ok()) return FromStatus(snapshot.status());
  OwnedCheckpoint adapter = std::move(snapshot->checkpoint);
  const std::string prefix = std::string(model::kServedAdapterPrefix) + s.name + "/";
  for (OwnedTensor& t : adapter.tensors) t.name = prefix + t.name;
  OwnedCheckpoint previous;
  std::vector<Hash128> previous_hashes;
  {
    std::lock_guard lock(mutex);
    previous = std::exchange(s.adapter, std::move(adapter));
    previous_hashes = std::exchange(s.adapter_hashes, snapshot->tensor_hashes);
  }
  auto published = PublishLora(v);
  if (!published.ok()) {
    std::lock_guard lock(mutex);
    s.adapter = std::move(previous);
    s.adapter_hashes = std::move(previous_hashes);
    return FromStatus(published.status());
  }
  (*published)["adapter"] = s.name;
  (*published)["adapter_hash"] = snapshot->weights_hash;
  return Json(*published);
}

Result<std::string> TrainingService::Impl::SavedOwner(const std::string& id) {
  const fs::path meta_path = fs::path(options.state_dir) / "sessions" / id / "session.json";
  auto bytes = Env::Default()->ReadFile(meta_path.string());
  if (!bytes.ok()) return Status::NotFound(meta_path.string() + ": " + bytes.status().message());
  json meta = ParseShallowJson(
      std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()));
  if (meta.is_discarded() || !meta.is_object())
    return Status::NotFound(meta_path.string() + " is not a JSON object");
  if (!meta.contains("owner")) return std::string(kAnonymousIdentity);
  if (!meta["owner"].is_string() || meta["owner"].get<std::string>().empty())
    return Status::NotFound(meta_path.string() + ": owner is not a non-empty string");
  return meta["owner"].get<std::string>();
}

Result<std::string> TrainingService::Impl::StatePath(const std::string& relative,
                                                      std::string_view owner) {
  static const std::regex pattern("sessions/[A-Za-z0-9._-]{1,64}/[A-Za-z0-9._-]{1,64}");
  if (!std::regex_match(relative, pattern) || relative.find("/./") != std::string::npos ||
      relative.find("/../") != std::string::npos || relative.ends_with("/..") ||
      relative.ends_with("/.")) {
    return Status::InvalidArgument("state path '" + relative +
                                   "' is not one save_state returned (sessions/<id>/<name>)");
  }
  const fs::path path = fs::path(options.state_dir) / relative;
  if (!fs::exists(path / "trainer.json"))
    return Status::NotFound("no saved state " + relative);
  // Another identity's state is one that does not exist.
  const std::string id = fs::path(relative).parent_path().filename().string();
  Result<std::string> saved_by = SavedOwner(id);
  if (!saved_by.ok() || *saved_by != owner) {
    if (!saved_by.ok()) spdlog::warn("training service: state {} has no owner: {}", relative,
                                     saved_by.status().ToString());
    return Status::NotFound("no saved state " + relative);
  }
  return path.string();
}

HttpResponse TrainingService::Impl::SaveState(Session& s, const json& body) {
  for (const auto& [key, value] : body.items()) {
    if (key != "name") return Error(400, "bad_request", "save_state: unknown key '" + key + "' (known: name)");
    if (!value.is_string()) return Error(400, "bad_request", "save_state: name must be a string");
  }
  const std::string name = body.value("name", "step-" + std::to_string(client->step()));
  if (!ValidName(name) || name == "session.json" || name.find(".tmp.") != std::string::npos ||
      name.find(".old.") != std::string::npos) {
    return Error(400, "bad_request", "save_state: name '" + name +
                                         "' must be 1-64 of A-Z a-z 0-9 . _ - (not session.json, "
                                         "nor containing .tmp. or .old.)");
  }
  const std::string relative = "sessions/" + s.id + "/" + name;
  const fs::path dir = fs::path(options.state_dir) / relative;
  std::error_code ec;
  fs::create_directories(dir.parent_path(), ec);
  Status saved = client->SaveState(dir.string(), /*include_frozen=*/!lora);
  if (!saved.ok()) return FromStatus(saved);
  {
    std::lock_guard lock(mutex);
    auto& list = s.saved_states;
    list.erase(std::remove(list.begin(), list.end(), relative), list.end());
    list.push_back(relative);
    // Without session.json the state has no recorded owner, and no one may load it.
    Status written = WriteSessionFile(s, s.closed, s.closed ? "closed" : "");
    if (!written.ok()) return FromStatus(written.WithContext("save_state: recording its owner"));
  }
  return Json({{"path", relative}, {"step", client->step()}});
}

HttpResponse TrainingService::Impl::LoadState(Session& s, const json& body) {
  for (const auto& [key, value] : body.items()) {
    if (key != "path") return Error(400, "bad_request", "load_state: unknown key '" + key + "' (known: path)");
  }
  if (!body.contains("path") || !body["path"].is_string())
    return Error(400, "bad_request", "load_state: path (what save_state returned) is missing");
  auto path = StatePath(body["path"].get<std::string>(), s.owner);
  if (!path.ok()) return FromStatus(path.status());
  Status loaded = client->LoadState(*path, /*include_frozen=*/!lora);
  if (!loaded.ok()) return FromStatus(loaded);
  NoteClient(s);
  std::lock_guard lock(mutex);
  return Json(SessionInfo(s));
}

Status TrainingService::Impl::RestoreSessions() {
  const fs::path root = fs::path(options.state_dir) / "sessions";
  std::error_code ec;
  if (!fs::exists(root, ec)) return Status::Ok();
  std::vector<std::pair<fs::file_time_type, std::shared_ptr<Session>>> found;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const fs::path meta_path = entry.path() / "session.json";
    if (!fs::exists(meta_path, ec)) continue;
    auto bytes = Env::Default()->ReadFile(meta_path.string());
    if (!bytes.ok()) continue;
    json meta = ParseShallowJson(
        std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()));
    auto s = std::make_shared<Session>();
    bool closed = true;
    try {
      if (meta.is_discarded() || !meta.is_object()) throw std::runtime_error("not a JSON object");
      closed = meta.value("closed", true);
      s->id = meta.value("id", "");
      s->name = meta.value("name", s->id);
      // Saved before owners were recorded: the identity of a server without tokens.
      s->owner = meta.value("owner", std::string(kAnonymousIdentity));
      if (s->owner.empty()) throw std::runtime_error("its owner is empty");
      s->saved_states = meta.value("saved_states", std::vector<std::string>{});
    } catch (const std::exception& e) {
      spdlog::error("training service: {} is malformed ({}); that session is not restored",
                    meta_path.string(), e.what());
      continue;
    }
    if (closed || s->saved_states.empty()) continue;
    bool duplicate = false;
    for (const auto& [when, other] : found) duplicate |= other->name == s->name;
    if (s->id != entry.path().filename().string() || !ValidName(s->name) || duplicate) {
      spdlog::error("training service: {} names another session, or a name already restored; "
                    "not restored", meta_path.string());
      continue;
    }
    found.emplace_back(fs::last_write_time(meta_path, ec), s);
  }
  // Full mode restores the session saved last (one owns the weights).
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto& [when, s] : found) {
    if (!lora && !sessions.empty()) {
      spdlog::warn("training service: full mode restores one session; {} is left closed", s->id);
      continue;
    }
    const std::string latest = s->saved_states.back();
    auto path = StatePath(latest, s->owner);
    Status loaded = path.ok() ? client->ImportTrainable(initial) : path.status();
    if (loaded.ok()) loaded = client->LoadState(*path, !lora);
    if (!loaded.ok()) {
      spdlog::error("training service: session {} not restored: {}", s->id, loaded.ToString());
      continue;
    }
    s->step = client->step();
    s->last_version = client->last_sampler_version();
    s->seq_floating = true;
    if (lora) {
      FW_ASSIGN_OR_RETURN(s->adapter, model::SnapshotWeights(client->model(),
                                                             client->options().serving_dtype, true));
      const std::string prefix = std::string(model::kServedAdapterPrefix) + s->name + "/";
      for (OwnedTensor& t : s->adapter.tensors) {
        t.name = prefix + t.name;
        s->adapter_hashes.push_back(HashBytes(std::span<const std::byte>(t.data)));
      }
    }
    s->state = client->ExportTrainable();
    sessions[s->id] = s;
    spdlog::info("training service: session {} ({}) of {} restored from {} at step {}", s->id,
                 s->name, s->owner, latest, s->step);
  }
  if (!sessions.empty() && !lora) {
    // Full mode: the client holds the restored weights (what is published first).
    active = sessions.begin()->second;
    FW_RETURN_IF_ERROR(client->ImportTrainable(active->state));
    active->state = {};
  }
  return Status::Ok();
}

Status TrainingService::Impl::PublishStart() {
  const uint64_t head = publisher ? publisher->version() : 0;
  version = head;
  if (lora) {
    FW_ASSIGN_OR_RETURN(json published, PublishLora(head + 1));
    spdlog::info("training service: published the base{} as version {}",
                 sessions.empty() ? "" : " and the restored adapters", head + 1);
    return Status::Ok();
  }
  // Full mode: the weights the first (or restored) session starts from, without moving the
  // client's own last version (a session's state keeps its own).
  const trainer::TrainerOptions& t = client->options();
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint weights,
                      t.fp8_serving
                          ? model::SnapshotWeightsFp8(client->model(),
                                                      {.block = t.fp8_block,
                                                       .other_dtype = t.serving_dtype})
                          : model::SnapshotWeights(client->model(), t.serving_dtype));
  if (publisher) FW_RETURN_IF_ERROR(publisher->Publish(head + 1, weights.view()).status());
  version = head + 1;
  spdlog::info("training service: published the starting weights as version {}", head + 1);
  return Status::Ok();
}

// ---- the public face ----

TrainingService::TrainingService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TrainingService::~TrainingService() {
  impl_->dashboard->SetLive(nullptr);  // its routes may outlive the service
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  impl_->done.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->pool) impl_->pool->join();
}

Result<std::unique_ptr<TrainingService>> TrainingService::Create(TrainingServiceOptions options,
                                                                 sync::Publisher* publisher) {
  FW_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->publisher = publisher;
  impl->lora = options.trainer.lora.has_value();
  impl->dashboard = std::make_shared<pipeline::DashboardFeed>(
      json{{"title", "training service · " + options.trainer.config.model_type + " · " + (impl->lora ? "LoRA" : "full")},
           {"source", "service"}});
  std::error_code ec;
  fs::create_directories(fs::path(options.state_dir) / "sessions", ec);
  if (ec) return Status::IOError("cannot create " + options.state_dir + "/sessions: " + ec.message());
  FW_ASSIGN_OR_RETURN(impl->client, trainer::TrainingClient::Create(options.trainer));
  if (!impl->lora && publisher) impl->client->AttachPublisher(publisher);
  impl->parameters_total = impl->client->parameter_count();
  impl->parameters_trainable = impl->client->trainable_count();
  impl->initial = impl->client->ExportTrainable();
  for (auto& m : impl->initial.exp_avg) m = torch::Tensor();  // zeros, not held twice
  for (auto& m : impl->initial.exp_avg_sq) m = torch::Tensor();
  if (impl->lora) {
    FW_ASSIGN_OR_RETURN(impl->base, model::SnapshotWeights(impl->client->model(),
                                                           options.trainer.serving_dtype, false));
    for (const OwnedTensor& t : impl->base.tensors) impl->base_hashes.push_back(HashBytes(std::span<const std::byte>(t.data)));
  }
  FW_RETURN_IF_ERROR(impl->RestoreSessions());
  FW_RETURN_IF_ERROR(impl->PublishStart());
  impl->pool = std::make_unique<boost::asio::thread_pool>(options.http_threads);
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<TrainingService>(new TrainingService(std::move(impl)));
}

uint64_t TrainingService::version() const { return impl_->version.load(); }
bool TrainingService::lora() const { return impl_->lora; }

HttpResponse TrainingService::Handle(const std::string& method, const std::string& path,
                                      const std::string& body, std::string_view identity) {
  Impl& s = *impl_;
  const std::string prefix = "/v1/train";
  if (path.rfind(prefix, 0) != 0) return Error(404, "not_found", "no route " + path);
  std::string rest = path.substr(prefix.size());
  while (rest.size() > 1 && rest.back() == '/') rest.pop_back();
  std::vector<std::string> parts;
  for (size_t begin = 1; begin <= rest.size();) {
    const size_t end = std::min(rest.find('/', begin), rest.size());
    parts.push_back(rest.substr(begin, end - begin));
    begin = end + 1;
  }
  auto wrong_method = [&] {
    return Error(405, "method_not_allowed", method + " is not allowed on " + path);
  };
  if (parts.size() == 1 && parts[0] == "info") {
    return method == "GET" ? s.Info(identity) : wrong_method();
  }
  if (!parts.empty() && parts[0] == "sessions") {
    if (parts.size() == 1) {
      if (method == "POST") return s.CreateSession(body, identity);
      if (method == "GET") {
        std::lock_guard lock(s.mutex);
        return Json({{"sessions", s.SessionList(identity)}});
      }
      return wrong_method();
    }
    if (parts.size() == 2) {
      if (method == "DELETE") return s.CloseSession(parts[1], identity);
      if (method == "GET") {
        std::lock_guard lock(s.mutex);
        auto found = s.Find(parts[1], identity);
        if (!found.ok()) return FromStatus(found.status());
        return Json(s.SessionInfo(**found));
      }
      return wrong_method();
    }
    if (parts.size() == 3) {
      if (method != "POST") return wrong_method();
      return s.Call(parts[1], parts[2], body, identity);
    }
  }
  return Error(404, "not_found",
               "no route " + path + " (see docs/TRAINING_API.md: /v1/train/info, /v1/train/sessions, "
               "/v1/train/sessions/{id}/{call})");
}

void TrainingService::Impl::NoteCall(const Session& session, const CallState& call,
                                     const HttpResponse& answer, Clock::duration took) {
  recent_calls.push_back({{"session", session.name.empty() ? session.id : session.name},
                          {"call", call.name},
                          {"seq", call.seq},
                          {"status", answer.status},
                          {"ms", std::chrono::duration<double, std::milli>(took).count()},
                          {"version", version.load()},
                          {"step", session.step}});
  if (recent_calls.size() > kRecentCalls) recent_calls.pop_front();
  if (answer.status != 200) return;
  const bool batch = call.name == "forward_backward" || call.name == "forward_backward_custom";
  if (!batch && call.name != "optim_step") return;
  const json doc = json::parse(answer.body, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("metrics") || !doc["metrics"].is_object()) return;
  const json& metrics = doc["metrics"];
  if (batch) {
    last_batch_metrics = metrics;
    sequences_since_step += metrics.value("sequences", uint64_t{0});
    return;
  }
  pipeline::StepRow row;
  row.step = ++optim_steps;
  row.version = version.load();
  row.wall_s = std::chrono::duration<double>(Clock::now() - started).count();
  row.loss = last_batch_metrics.value("loss", 0.0);
  row.k3 = last_batch_metrics.value("kl_sampler_k3", 0.0);
  row.clip_fraction = last_batch_metrics.value("clip_fraction", 0.0);
  row.grad_norm = metrics.value("grad_norm", last_batch_metrics.value("grad_norm", 0.0));
  row.samples = sequences_since_step;
  sequences_since_step = 0;
  dashboard->AddStep(row, json{{"session", session.name.empty() ? session.id : session.name}});
}

json TrainingService::Impl::DashboardLive() {
  json sessions_json = json::array();
  json calls = json::array();
  {
    std::lock_guard lock(mutex);
    for (const auto& [id, session] : sessions) sessions_json.push_back(SessionInfo(*session));
    for (auto it = recent_calls.rbegin(); it != recent_calls.rend(); ++it) calls.push_back(*it);
  }
  json live = {{"sessions", std::move(sessions_json)}, {"calls", std::move(calls)}};
  // On the I/O thread, the publisher's own (Register's routes run there).
  if (publisher) live["publisher"] = sync::ToJson(publisher->CurrentStatus());
  return live;
}

json TrainingService::StatusJson() {
  Impl& s = *impl_;
  std::lock_guard lock(s.mutex);
  return {{"role", "trainer-service"},
          {"mode", s.lora ? "lora" : "full"},
          {"version", s.version.load()},
          {"sessions", s.sessions.size()},
          {"calls", s.calls_total},
          {"calls_failed", s.calls_failed},
          {"queued_calls", s.ready.size()}};
}

namespace {

// One request of the API routes (a coroutine on the server's executor; the work on `pool`).
transport::awaitable<HttpResponse> ServeApi(TrainingService* self, boost::asio::thread_pool* pool,
                                            transport::HttpRequest request) {
  const bool read = request.method == "GET" || request.method == "HEAD";
  const uint32_t need = transport::kScopeTrain | (read ? uint32_t{transport::kScopeRead} : 0u);
  if ((request.scopes & need) == 0) {
    const bool anonymous = request.scopes == 0;
    co_return anonymous ? Error(401, "unauthorized", "a bearer token with the train scope is required")
                        : Error(403, "forbidden", "this token lacks the train scope");
  }
  auto work = [self, method = request.method, path = request.path,
               identity = IdentityOf(request), body = std::move(request.body)] {
    return self->Handle(method, path, body, identity);
  };
  std::optional<HttpResponse> answer = co_await transport::RunOn(*pool, std::move(work));
  if (!answer) co_return Error(503, "unavailable", "the training service is stopping");
  co_return std::move(*answer);
}

}  // namespace

void TrainingService::Register(transport::HttpServer& server) {
  TrainingService* self = this;
  boost::asio::thread_pool* pool = impl_->pool.get();
  server.RouteApi(
      "/v1/train",
      [self, pool](transport::HttpRequest request) {
        return ServeApi(self, pool, std::move(request));
      },
      impl_->options.max_body_bytes);
  transport::AddStatusRoutes(server, [self] { return self->StatusJson(); }, ops::MetricsText);
  Impl* impl = impl_.get();
  impl->dashboard->SetLive([self, impl] {
    json live = impl->DashboardLive();
    live["status"] = self->StatusJson();
    return live;
  });
  pipeline::AddDashboardRoutes(server, impl->dashboard);
}

}  // namespace flywheel::service
