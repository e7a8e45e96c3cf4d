#include "rl/run_report.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "delta/delta_file.h"

namespace flywheel::rl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Status WriteText(const std::string& path, const std::string& text) {
  return delta::WriteFileAtomically(path, std::as_bytes(std::span(text)));
}

std::string HumanBytes(double bytes) {
  char text[32];
  if (bytes < 1024) std::snprintf(text, sizeof text, "%.0f B", bytes);
  else if (bytes < 1024 * 1024) std::snprintf(text, sizeof text, "%.1f KB", bytes / 1024);
  else std::snprintf(text, sizeof text, "%.1f MB", bytes / (1024 * 1024));
  return text;
}

}  // namespace

Result<std::optional<RunProgress>> LoadProgress(const std::string& path) {
  if (!fs::exists(path)) return std::optional<RunProgress>();
  std::ifstream in(path);
  const json value = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!value.is_object()) return Status::Corruption(path + " is unreadable");
  // A progress file without a version was never completed: start fresh, as before.
  if (!value.contains("version")) return std::optional<RunProgress>();
  RunProgress progress;
  progress.version = value.value("version", uint64_t{0});
  progress.wall_s = value.value("wall_s", 0.0);
  progress.initial_accuracy = value.value("initial_accuracy", -1.0);
  progress.warmup_accuracy = value.value("warmup_accuracy", -1.0);
  progress.last_accuracy = value.value("last_accuracy", -1.0);
  progress.time_to_target_s = value.value("time_to_target_s", -1.0);
  for (const json& row : value.value("rows", json::array())) {
    Result<pipeline::StepRow> parsed = pipeline::StepRow::FromJson(row);
    if (!parsed.ok()) return parsed.status().WithContext(path);
    progress.rows.push_back(*parsed);
  }
  return std::optional<RunProgress>(std::move(progress));
}

Status SaveProgress(const std::string& path, const RunProgress& progress) {
  json rows = json::array();
  for (const pipeline::StepRow& row : progress.rows) rows.push_back(row.ToJson());
  const json value = {{"version", progress.version},
                      {"wall_s", progress.wall_s},
                      {"initial_accuracy", progress.initial_accuracy},
                      {"warmup_accuracy", progress.warmup_accuracy},
                      {"last_accuracy", progress.last_accuracy},
                      {"time_to_target_s", progress.time_to_target_s},
                      {"rows", std::move(rows)}};
  return WriteText(path, value.dump());
}

std::string StepLine(const pipeline::StepRow& r, int64_t max_staleness, double last_accuracy) {
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
                HumanBytes(static_cast<double>(r.delta_bytes)).c_str(),
                HumanBytes(static_cast<double>(r.wan_bytes)).c_str(), sync);
  return line;
}

pipeline::RunSummary MakeRunSummary(const SummaryInputs& in) {
  const pipeline::RunConfig& config = *in.config;
  const RunProgress& progress = *in.progress;
  pipeline::RunSummary s;
  s.task = config.task.dataset.empty() ? config.task.name + "-" + std::to_string(config.task.digits)
                                       : config.task.dataset;
  s.algorithm = config.algorithm.name;
  s.model = !config.model.dir.empty()      ? config.model.dir
            : config.model.config.empty() ? config.model.preset
                                          : config.model.config;
  s.parameters = in.parameters;
  s.initial_accuracy = progress.initial_accuracy;
  s.warmup_accuracy = progress.warmup_accuracy;
  s.final_accuracy = progress.last_accuracy;
  s.target_accuracy = config.run.target_accuracy;
  s.reached_target = in.reached_target;
  s.time_to_target_s = progress.time_to_target_s;
  s.wall_seconds = in.wall_seconds;
  s.versions = progress.version;
  s.max_staleness_allowed = config.pipeline.max_staleness;
  s.workers = config.fleet.regions.size() * static_cast<uint64_t>(config.fleet.workers_per_region);
  s.regions = config.fleet.regions.size();
  s.samples_dropped_stale = in.stats.samples_dropped_stale;
  s.leases_expired = in.stats.leases_expired;
  s.submissions_refused = in.stats.submissions_refused;
  s.resumed = in.resumed;
  s.samples_graded = in.stats.samples_graded;
  s.samples_ungraded = in.stats.samples_ungraded;
  s.groups_zero_variance = in.stats.groups_zero_variance;
  s.groups_too_few_graded = in.stats.groups_too_few_graded;
  s.episodes = in.stats.episodes;
  s.episode_turns = in.stats.episode_turns;
  s.episode_env_tokens = in.stats.episode_env_tokens;
  s.AddRows(progress.rows);
  return s;
}

Status WriteRunReport(const std::string& report_dir, const std::vector<pipeline::StepRow>& rows,
                      const pipeline::RunSummary& summary) {
  const fs::path dir = report_dir;
  FW_RETURN_IF_ERROR(WriteText((dir / "metrics.csv").string(), pipeline::MetricsCsv(rows)));
  return WriteText((dir / "summary.json").string(), summary.ToJson().dump(2));
}

}  // namespace flywheel::rl
