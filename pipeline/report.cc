// WriteReport (pipeline/launcher.h): plots and the summary table of a finished run.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/env.h"
#include "pipeline/launcher.h"
#include "pipeline/run_record.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;

// metrics.csv columns by number: pipeline/run_record.h (StepRow) lists them.
constexpr const char* kPlots = R"gp(set datafile separator ","
set terminal png size 900,500
set grid
set key top left
set output "reward_accuracy.png"
set title "Reward and held-out accuracy"
set xlabel "wall seconds"
set yrange [0:1.05]
plot "metrics.csv" skip 1 using 3:4 with lines title "mean reward (training samples)", \
     "" skip 1 using 3:($5 == $5 ? $5 : 1/0) with linespoints title "held-out exact-match accuracy"
set output "delta_bytes.png"
set title "Bytes per version: delta vs full checkpoint"
set xlabel "policy version"
set yrange [*:*]
set logscale y
plot "metrics.csv" skip 1 using 2:10 with lines title "delta (compressed, on the wire)", \
     "" skip 1 using 2:11 with lines title "full bf16 checkpoint", \
     "" skip 1 using 2:12 with lines title "WAN bytes this step (all regions)"
unset logscale y
set output "sync_latency.png"
set title "Publish to every worker swapped"
set xlabel "policy version"
set ylabel "ms"
plot "metrics.csv" skip 1 using 14:($13 == $13 ? $13 : 1/0) with linespoints title "sync latency"
set output "staleness.png"
set title "Staleness of trained tokens (trainer version - sampling version)"
set xlabel "step"
set ylabel "versions"
plot "metrics.csv" skip 1 using 1:7 with lines title "mean", "" skip 1 using 1:8 with steps title "max"
)gp";

std::string Fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

// Writes plots.gp into `dir` and runs gnuplot on it; returns what became of the plots.
std::string WritePlots(const fs::path& dir) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    return "no plots: gnuplot is not installed (apt-get install gnuplot-nox)";
  }
  const std::string_view script = kPlots;
  if (Status written = WriteFileAtomically((dir / "plots.gp").string(),
                                           std::as_bytes(std::span(script.data(), script.size())));
      !written.ok()) {
    return "no plots: " + written.message();
  }
  const std::string command = "cd '" + dir.string() + "' && gnuplot plots.gp > plots.log 2>&1";
  return std::system(command.c_str()) == 0
             ? "reward_accuracy.png, delta_bytes.png, sync_latency.png, staleness.png"
             : "gnuplot failed (see plots.log)";
}

}  // namespace

Status WriteReport(const std::string& report_dir, std::ostream& out) {
  const fs::path dir = report_dir;
  Result<RunSummary> read = ReadSummary(report_dir);
  if (read.status().code() == StatusCode::kNotFound) {
    return Status::NotFound("no readable summary.json in " + report_dir + " (did the run finish?)");
  }
  FW_RETURN_IF_ERROR(read.status());
  const RunSummary& s = *read;
  const std::string plots_note = WritePlots(dir);
  out << "\nsummary (" << s.task << ", " << s.algorithm << ", model " << s.model << " with "
      << s.parameters << " parameters)\n";
  const auto row = [&](const std::string& name, const std::string& value) {
    out << "  " << std::left << std::setw(34) << name << value << "\n";
  };
  row("held-out accuracy, untrained", Fixed(s.initial_accuracy, 3));
  row("held-out accuracy, after warm-up", Fixed(s.warmup_accuracy, 3));
  row("held-out accuracy, final", Fixed(s.final_accuracy, 3) + "  (target " +
                                      Fixed(s.target_accuracy, 2) + ": " +
                                      (s.reached_target ? "reached" : "NOT reached") + ")");
  if (s.time_to_target_s >= 0) row("time to target", Fixed(s.time_to_target_s, 1) + " s");
  row("wall time", Fixed(s.wall_seconds, 1) + " s");
  row("RL steps / policy versions", std::to_string(s.steps) + " / " + std::to_string(s.versions));
  row("samples trained", std::to_string(s.samples));
  row("staleness allowed / observed max", std::to_string(s.max_staleness_allowed) + " / " +
                                              std::to_string(s.max_staleness_observed) + "  (mean " +
                                              Fixed(s.mean_staleness, 2) + ")");
  row("samples dropped as stale", std::to_string(s.samples_dropped_stale));
  {
    std::ostringstream k3;
    k3 << std::scientific << std::setprecision(2) << s.mean_k3;
    row("mean k3 KL sampler vs trainer", k3.str());
  }
  const double full = static_cast<double>(s.full_bytes);
  const double delta = s.delta_bytes_mean;
  row("delta bytes per version (mean)", Fixed(delta / 1024, 1) + " KiB vs full " + Fixed(full / 1024, 1) +
                                            " KiB (" + Fixed(full > 0 ? 100 * delta / full : 0, 2) + "%)");
  {
    // The baseline users would otherwise run: every worker fetches every full checkpoint.
    const double baseline = full * static_cast<double>(s.workers) * static_cast<double>(s.versions);
    const double wan = static_cast<double>(s.wan_bytes_total);
    row("WAN bytes, whole run", Fixed(wan / (1024 * 1024), 1) + " MiB vs " +
                                    Fixed(baseline / (1024 * 1024), 1) +
                                    " MiB for full checkpoints to every worker (" +
                                    Fixed(wan > 0 ? baseline / wan : 0, 1) + "x less)");
  }
  row("publish -> all workers swapped",
      s.sync_ms_mean >= 0 ? Fixed(s.sync_ms_mean, 0) + " ms (mean)" : "not measured");
  row("report", report_dir + " (metrics.csv, summary.json; " + plots_note + ")");
  return Status::Ok();
}

}  // namespace flywheel::pipeline
