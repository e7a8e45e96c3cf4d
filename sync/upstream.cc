#include "sync/upstream.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace flywheel::sync {

using namespace std::chrono_literals;
using transport::Clock;
using transport::Frame;
using transport::FrameKindName;
using transport::MakeFrame;

Download::Download(ArtifactInfo artifact)
    : info(std::move(artifact)), have(info.piece_hashes.size(), false) {
  Result<std::shared_ptr<GrowableBytes>> buffer =
      GrowableBytes::Create(info.streaming ? info.size_bound : info.size_bytes);
  if (!buffer.ok()) throw std::bad_alloc();
  bytes = std::move(*buffer);
  (void)bytes->Resize(info.size_bytes);
}

std::span<const std::byte> Download::piece(uint32_t index) const {
  const uint64_t begin = static_cast<uint64_t>(index) * info.piece_bytes;
  const uint64_t end = std::min(info.size_bytes, begin + info.piece_bytes);
  return std::span<const std::byte>(bytes->data() + begin, end - begin);
}

bool Download::Extend(const ArtifactInfo& newer) {
  if (!info.streaming || KeyOf(newer) != KeyOf(info) || newer.piece_bytes != info.piece_bytes ||
      newer.base_version != info.base_version || newer.base_hash != info.base_hash ||
      newer.piece_hashes.size() < info.piece_hashes.size() ||
      newer.size_bytes > bytes->capacity() || newer.size_bytes < info.size_bytes) {
    return false;
  }
  // Pieces verified against the streaming list must be the same pieces in the new one.
  if (!std::equal(info.piece_hashes.begin(), info.piece_hashes.end(), newer.piece_hashes.begin())) {
    return false;
  }
  if (!bytes->Resize(newer.size_bytes).ok()) return false;
  have.resize(newer.piece_hashes.size(), false);
  info = newer;
  return true;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{1} << 40;  // unknown: 1 TiB
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

std::vector<std::string> DropOversized(Catalog* catalog, uint64_t max_bytes) {
  std::vector<std::string> dropped;
  std::erase_if(catalog->artifacts, [&](const ArtifactInfo& info) {
    const uint64_t reserved = info.streaming ? info.size_bound : info.size_bytes;
    if (reserved <= max_bytes) return false;
    dropped.push_back("catalog entry " + Describe(KeyOf(info)) + " announces " +
                      std::to_string(reserved) + " bytes, over this node's limit of " +
                      std::to_string(max_bytes) + " (max_artifact_bytes); not fetched");
    catalog->signatures.erase(KeyOf(info));
    return true;
  });
  return dropped;
}

Upstream::Upstream(asio::any_io_executor executor, UpstreamOptions options, LinkRegistry* links)
    : executor_(std::move(executor)), options_(std::move(options)), links_(links) {
  if (options_.max_artifact_bytes == 0) options_.max_artifact_bytes = PhysicalMemoryBytes();
  data_.resize(static_cast<size_t>(std::max(1, options_.streams)));
  data_index_.resize(data_.size(), 0);
}

Upstream::~Upstream() {
  Stop();
}

void Upstream::Stop() {
  stopped_ = true;
  if (control_) control_->Close(Status::Unavailable("stopping"));
  for (auto& connection : data_) {
    if (connection) connection->Close(Status::Unavailable("stopping"));
  }
}

void Upstream::ReportNow() {
  report_now_ = true;
  if (auto timer = report_timer_.lock()) timer->cancel();
}

std::string Upstream::current() const {
  return control_ ? options_.endpoints[control_index_].ToString() : std::string();
}

awaitable<Result<std::shared_ptr<Connection>>> Upstream::DialAny(wire::Channel channel,
                                                                 size_t* index) {
  Status last = Status::Unavailable("no upstream configured");
  for (size_t i = 0; i < options_.endpoints.size() && !stopped_; ++i) {
    transport::DialOptions dial;
    dial.endpoint = options_.endpoints[i];
    dial.tls = options_.tls;
    dial.timeout = options_.dial_timeout;
    dial.connection = options_.connection;
    wire::Hello hello;
    hello.set_token(options_.token);
    hello.set_role(options_.identity.role);
    hello.set_region(options_.identity.region);
    hello.set_node_id(options_.identity.node_id);
    hello.set_channel(channel);
    Result<std::shared_ptr<Connection>> connection = co_await transport::Dial(dial, hello);
    if (connection.ok()) {
      *index = i;
      links_->Add(*connection, /*upstream=*/true);
      co_return connection;
    }
    spdlog::debug("upstream {}: {}", dial.endpoint.ToString(), connection.status().message());
    last = connection.status();
  }
  co_return stopped_ ? Status::Unavailable("stopping") : last;
}

awaitable<void> Upstream::ReportLoop(std::shared_ptr<Connection> connection,
                                     std::shared_ptr<bool> reporting,
                                     std::shared_ptr<size_t> index_ptr) {
  const size_t index = *index_ptr;
  auto next_prefer = Clock::now() + options_.prefer_retry;
  auto timer = std::make_shared<asio::steady_timer>(executor_);
  report_timer_ = timer;
  // Half the header limit: a report never cuts its own control channel.
  const size_t max_report_bytes = options_.connection.limits.max_header_bytes / 2;
  uint64_t last_omitted = 0;
  while (*reporting && !connection->closed()) {
    report_now_ = false;
    wire::Header header;
    wire::Report* report = header.mutable_report();
    *report = report_();
    BoundReport(report, max_report_bytes);
    if (last_omitted == 0 && report->omitted_nodes() > 0) {
      spdlog::warn("report to {} lists {} node(s) below this one and counts {} more",
                   connection->peer(), report->nodes_size() - 1, report->omitted_nodes());
    }
    last_omitted = report->omitted_nodes();
    if (!(co_await connection->Send(MakeFrame(std::move(header)))).ok()) co_return;
    // ReportNow cuts the wait short; 50 ms at least between reports all the same.
    timer->expires_after(report_now_ ? 50ms : 1000ms);
    transport::error_code ignored;
    co_await timer->async_wait(asio::redirect_error(transport::use_awaitable, ignored));
    if (report_now_) {
      timer->expires_after(50ms);
      co_await timer->async_wait(asio::redirect_error(transport::use_awaitable, ignored));
    }
    if (index != 0 && Clock::now() >= next_prefer && *reporting) {
      next_prefer = Clock::now() + options_.prefer_retry;
      transport::DialOptions probe;
      probe.endpoint = options_.endpoints[0];
      probe.tls = options_.tls;
      probe.timeout = options_.dial_timeout;
      wire::Hello hello;
      hello.set_token(options_.token);
      hello.set_role(wire::CLIENT);
      hello.set_region(options_.identity.region);
      hello.set_node_id(options_.identity.node_id + "-probe");
      hello.set_channel(wire::DATA);
      auto probed = co_await transport::Dial(probe, hello);
      if (probed.ok()) {
        (*probed)->Close(Status::Unavailable("probe done"));
        spdlog::info("preferred upstream {} is back; switching", probe.endpoint.ToString());
        connection->Close(Status::Unavailable("switching to the preferred upstream"));
      }
    }
  }
}

awaitable<void> Upstream::RunControl(std::function<void(Catalog)> on_catalog,
                                     std::function<wire::Report()> make_report) {
  Status last_error;
  while (!stopped_) {
    size_t index = 0;
    Result<std::shared_ptr<Connection>> dialed = co_await DialAny(wire::CONTROL, &index);
    if (!dialed.ok()) {
      if (last_error.message() != dialed.status().message()) {
        spdlog::warn("no upstream reachable: {}", dialed.status().message());
      }
      last_error = dialed.status();
      co_await transport::SleepFor(options_.retry_delay);
      continue;
    }
    last_error = Status::Ok();
    control_ = *dialed;
    control_index_ = index;
    auto connection = control_;
    spdlog::info("subscribed to {} {} at {}", RoleName(connection->welcome.role()),
                 connection->welcome.node_id(), connection->peer());
    // Reports go out every second; while failed over, the preferred upstream is retried.
    auto reporting = std::make_shared<bool>(true);
    report_ = make_report;
    asio::co_spawn(executor_, ReportLoop(connection, reporting, std::make_shared<size_t>(index)),
                   asio::detached);
    while (true) {
      Result<Frame> frame = co_await connection->Receive();
      if (!frame.ok()) {
        if (!stopped_) spdlog::warn("control channel: {}", frame.status().message());
        break;
      }
      if (!frame->header.has_catalog()) {
        connection->Close(Status::Corruption(std::string("unexpected ") +
                                             FrameKindName(frame->header) +
                                             " frame on the control channel"));
        continue;
      }
      Result<Catalog> catalog = FromWire(frame->header.catalog(), options_.max_piece_bytes);
      if (!catalog.ok()) {
        spdlog::warn("ignoring a bad catalog from {}: {}", connection->peer(),
                     catalog.status().message());
        continue;
      }
      // Nothing a peer announces reserves more than this node allows (Download).
      std::vector<std::string> dropped = DropOversized(&*catalog, options_.max_artifact_bytes);
      std::set<std::string> logged;
      for (std::string& message : dropped) {
        if (!logged_oversized_.count(message)) spdlog::error("{}: {}", connection->peer(), message);
        logged.insert(std::move(message));
      }
      last_catalog_error_ = logged.empty() ? std::string() : *logged.begin();
      logged_oversized_ = std::move(logged);
      on_catalog(std::move(*catalog));
    }
    *reporting = false;
    links_->Remove(connection);
    if (control_ == connection) control_.reset();
    if (!stopped_) co_await transport::SleepFor(options_.retry_delay);
  }
}

awaitable<void> Upstream::StreamTask(std::shared_ptr<FetchState> state,
                                     std::shared_ptr<int> stream) {
  state->results[*stream] = co_await RunStream(*stream, *state->download, *state->pending,
                                               *state->requeued, *state->on_piece);
  --state->running;
  state->requeued->Notify();
  state->finished->Notify();
}

awaitable<Status> Upstream::Fetch(Download& download, std::function<void(uint32_t)> on_piece) {
  if (download.all_known()) co_return Status::Ok();
  // The pieces listed now: a streaming entry may list more while this runs (Extend), and
  // those are for the next Fetch.
  const size_t known = download.have.size();
  std::vector<uint32_t> pending;  // a stack: the lowest index on top
  for (size_t i = known; i-- > 0;) {
    if (!download.have[i]) pending.push_back(static_cast<uint32_t>(i));
  }
  transport::Signal requeued(executor_);
  last_progress_ = Clock::now();
  const int streams = static_cast<int>(data_.size());
  transport::Signal finished(executor_);
  auto state = std::make_shared<FetchState>(FetchState{
      &download, &pending, &requeued, &on_piece, std::vector<Status>(streams), streams, &finished});
  for (int s = 0; s < streams; ++s) {
    asio::co_spawn(executor_, StreamTask(state, std::make_shared<int>(s)), asio::detached);
  }
  while (state->running > 0) co_await finished.Wait();
  if (std::find(download.have.begin(), download.have.begin() + known, false) ==
      download.have.begin() + known) {
    co_return Status::Ok();
  }
  for (const Status& status : state->results) {
    if (!status.ok()) co_return status;
  }
  co_return Status::Unavailable("fetch of " + Describe(KeyOf(download.info)) + " did not complete");
}

// One data stream's part of a Fetch: the pieces it asked for and has not received yet.
struct Upstream::StreamRun {
  int stream;
  Download& download;
  std::vector<uint32_t>& pending;
  transport::Signal& requeued;
  const std::function<void(uint32_t)>& on_piece;
  ArtifactKey key;
  std::vector<uint32_t> in_flight;
  int unavailable_strikes = 0;  // PieceUnavailable answers since the last verified piece

  // Gives the requests in flight (those not answered meanwhile) back to `pending`, for
  // any stream to ask again.
  void RequeueInFlight() {
    for (uint32_t index : in_flight) {
      if (!download.have[index]) pending.push_back(index);
    }
    in_flight.clear();
    requeued.Notify();
  }
};

awaitable<Status> Upstream::RunStream(int stream, Download& download,
                                      std::vector<uint32_t>& pending, transport::Signal& requeued,
                                      const std::function<void(uint32_t)>& on_piece) {
  StreamRun run{stream, download, pending, requeued, on_piece, KeyOf(download.info)};
  // Until nothing is left to ask for: a stream with nothing pending and nothing in
  // flight is done (requests another stream gives back are its own to redo).
  while (!pending.empty() || !run.in_flight.empty()) {
    if (stopped_) co_return Status::Unavailable("stopping");
    if (Clock::now() - last_progress_ > options_.give_up) {
      run.RequeueInFlight();
      co_return Status::Unavailable("no progress fetching " + Describe(run.key) + " for " +
                                    std::to_string(options_.give_up.count() / 1000) + " s");
    }
    std::shared_ptr<Connection>& connection = data_[stream];
    if (!connection || connection->closed()) {
      const bool connected = co_await Redial(run);
      if (!connected) continue;
    }
    const Status sent = co_await FillWindow(run, *connection);
    if (!sent.ok()) {
      run.RequeueInFlight();
      continue;
    }
    if (run.in_flight.empty()) break;  // everything pending was here already
    // Answers come in order; a connection that keeps sending heartbeats but no piece for
    // this long is closed, and its requests go elsewhere.
    Result<Frame> frame = co_await connection->Receive(options_.give_up, "a piece");
    if (!frame.ok()) {
      spdlog::info("data stream {} to {}: {}; resuming {} with {}/{} pieces verified", stream,
                   connection->peer(), frame.status().message(), Describe(run.key),
                   download.have_count, download.have.size());
      run.RequeueInFlight();
      continue;
    }
    const Status taken = TakeAnswer(run, *connection, *frame);
    if (!taken.ok()) co_return taken;
  }
  requeued.Notify();
  co_return Status::Ok();
}

awaitable<bool> Upstream::Redial(StreamRun& run) {
  std::shared_ptr<Connection>& connection = data_[run.stream];
  // Requests still in flight died with the connection (frames already received were
  // handled): another stream, or this one after a redial, asks again.
  if (!run.in_flight.empty()) run.RequeueInFlight();
  if (connection) links_->Remove(connection);
  connection.reset();
  if (run.pending.empty()) co_return false;  // nothing left for this stream
  size_t index = 0;
  Result<std::shared_ptr<Connection>> dialed = co_await DialAny(wire::DATA, &index);
  if (!dialed.ok()) {
    co_await transport::SleepFor(options_.retry_delay);
    co_return false;
  }
  connection = *dialed;
  data_index_[run.stream] = index;
  spdlog::debug("data stream {} connected to {} (pending {}, in flight {})", run.stream,
                connection->peer(), run.pending.size(), run.in_flight.size());
  co_return true;
}

awaitable<Status> Upstream::FillWindow(StreamRun& run, Connection& connection) {
  const wire::ArtifactKind kind =
      run.key.kind == ArtifactKind::kKeyframe ? wire::KEYFRAME : wire::DELTA;
  Status sent;
  while (static_cast<int>(run.in_flight.size()) < options_.window && !run.pending.empty() &&
         sent.ok()) {
    const uint32_t index = run.pending.back();
    run.pending.pop_back();
    if (run.download.have[index]) continue;
    wire::Header header;
    wire::PieceRequest* request = header.mutable_piece_request();
    request->set_kind(kind);
    request->set_target_version(run.key.target_version);
    request->set_index(index);
    run.in_flight.push_back(index);
    ++counters_.piece_requests;
    sent = co_await connection.Send(MakeFrame(std::move(header)));
  }
  co_return sent;
}

Status Upstream::TakeAnswer(StreamRun& run, Connection& connection, const Frame& frame) {
  const wire::Header& header = frame.header;
  if (!header.has_piece() && !header.has_piece_unavailable()) {
    connection.Close(Status::Corruption(std::string("unexpected ") + FrameKindName(header) +
                                        " frame on a data channel"));
    run.RequeueInFlight();
    return Status::Ok();
  }
  const uint32_t index =
      header.has_piece() ? header.piece().index() : header.piece_unavailable().index();
  const uint64_t version = header.has_piece() ? header.piece().target_version()
                                              : header.piece_unavailable().target_version();
  auto it = std::find(run.in_flight.begin(), run.in_flight.end(), index);
  if (it == run.in_flight.end() || version != run.key.target_version) {
    connection.Close(Status::Corruption("upstream " + connection.peer() +
                                        " sent a piece that was not requested"));
    run.RequeueInFlight();
    return Status::Ok();
  }
  run.in_flight.erase(it);
  if (header.has_piece_unavailable()) {
    // The upstream does not serve it (any more): another upstream may.
    const std::string& reason = header.piece_unavailable().reason();
    spdlog::warn("{} does not serve {} piece {}: {}", connection.peer(), Describe(run.key), index,
                 reason);
    run.pending.push_back(index);
    run.RequeueInFlight();
    connection.Close(Status::Unavailable("artifact not served"));
    if (++run.unavailable_strikes >= 3) {
      return Status::NotFound("upstream does not serve " + Describe(run.key) + ": " + reason);
    }
    return Status::Ok();
  }
  StorePiece(run, connection, index, frame.payload);
  return Status::Ok();
}

void Upstream::StorePiece(StreamRun& run, const Connection& connection, uint32_t index,
                          std::span<const std::byte> payload) {
  Download& download = run.download;
  std::span<const std::byte> expected = download.piece(index);
  if (download.have[index]) return;  // a duplicate after a requeue
  if (payload.size() != expected.size() ||
      HashBytes64(payload) != download.info.piece_hashes[index]) {
    ++counters_.pieces_rejected;
    spdlog::warn("{} piece {} from {} failed its checksum; fetching it again", Describe(run.key),
                 index, connection.peer());
    run.pending.push_back(index);
    run.requeued.Notify();
    return;
  }
  std::memcpy(const_cast<std::byte*>(expected.data()), payload.data(), expected.size());
  download.have[index] = true;
  ++download.have_count;
  ++counters_.pieces_verified;
  counters_.piece_bytes += expected.size();
  last_progress_ = Clock::now();
  run.unavailable_strikes = 0;
  if (run.on_piece) run.on_piece(index);
}

}  // namespace flywheel::sync
