// WriteReport (pipeline/launcher.h): plots and the summary table of a finished run.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "pipeline/launcher.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// metrics.csv columns (rl/rl_loop.cc StepRow): 1 step, 2 version, 3 wall_s,
// 4 mean_reward, 5 eval_accuracy, 6 k3, 7 staleness_mean, 8 staleness_max, 9 delta_density,
// 10 delta_bytes, 11 full_bytes, 12 wan_bytes, 13 sync_ms, 14 sync_version.
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

}  // namespace

Status WriteReport(const std::string& report_dir, std::ostream& out) {
  const fs::path dir = report_dir;
  std::ifstream in(dir / "summary.json");
  const json summary = json::parse(in, nullptr, false);
  if (!summary.is_object()) {
    return Status::NotFound("no readable summary.json in " + report_dir + " (did the run finish?)");
  }
  // Plots: gnuplot reads metrics.csv in the report directory.
  std::string plots_note;
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    {
      std::ofstream script(dir / "plots.gp", std::ios::trunc);
      script << kPlots;
    }
    const std::string command = "cd '" + dir.string() + "' && gnuplot plots.gp > plots.log 2>&1";
    plots_note = std::system(command.c_str()) == 0
                     ? "reward_accuracy.png, delta_bytes.png, sync_latency.png, staleness.png"
                     : "gnuplot failed (see plots.log)";
  } else {
    plots_note = "no plots: gnuplot is not installed (apt-get install gnuplot-nox)";
  }
  const auto number = [&](const char* key) { return summary.value(key, -1.0); };
  const double full = number("full_bytes");
  const double delta = number("delta_bytes_mean");
  out << "\nsummary (" << summary.value("task", "") << ", " << summary.value("algorithm", "")
      << ", model " << summary.value("model", "") << " with " << summary.value("parameters", 0)
      << " parameters)\n";
  const auto row = [&](const std::string& name, const std::string& value) {
    out << "  " << std::left << std::setw(34) << name << value << "\n";
  };
  row("held-out accuracy, untrained", Fixed(number("initial_accuracy"), 3));
  row("held-out accuracy, after warm-up", Fixed(number("warmup_accuracy"), 3));
  row("held-out accuracy, final", Fixed(number("final_accuracy"), 3) + "  (target " +
                                      Fixed(number("target_accuracy"), 2) + ": " +
                                      (summary.value("reached_target", false) ? "reached" : "NOT reached") + ")");
  if (number("time_to_target_s") >= 0) row("time to target", Fixed(number("time_to_target_s"), 1) + " s");
  row("wall time", Fixed(number("wall_seconds"), 1) + " s");
  row("RL steps / policy versions", std::to_string(summary.value("steps", 0)) + " / " +
                                         std::to_string(summary.value("versions", 0)));
  row("samples trained", std::to_string(summary.value("samples", 0)));
  row("staleness allowed / observed max", std::to_string(summary.value("max_staleness_allowed", 0)) +
                                              " / " + std::to_string(summary.value("max_staleness_observed", 0)) +
                                              "  (mean " + Fixed(number("mean_staleness"), 2) + ")");
  row("samples dropped as stale", std::to_string(summary.value("samples_dropped_stale", 0)));
  {
    std::ostringstream k3;
    k3 << std::scientific << std::setprecision(2) << number("mean_k3");
    row("mean k3 KL sampler vs trainer", k3.str());
  }
  row("delta bytes per version (mean)", Fixed(delta / 1024, 1) + " KiB vs full " + Fixed(full / 1024, 1) +
                                            " KiB (" + Fixed(full > 0 ? 100 * delta / full : 0, 2) + "%)");
  {
    // The baseline users would otherwise run: every worker fetches every full checkpoint.
    const double baseline = full * number("workers") * number("versions");
    const double wan = number("wan_bytes_total");
    row("WAN bytes, whole run", Fixed(wan / (1024 * 1024), 1) + " MiB vs " +
                                    Fixed(baseline / (1024 * 1024), 1) +
                                    " MiB for full checkpoints to every worker (" +
                                    Fixed(wan > 0 ? baseline / wan : 0, 1) + "x less)");
  }
  row("publish -> all workers swapped", number("sync_ms_mean") >= 0 ? Fixed(number("sync_ms_mean"), 0) + " ms (mean)" : "not measured");
  row("report", report_dir + " (metrics.csv, summary.json; " + plots_note + ")");
  return Status::Ok();
}

}  // namespace flywheel::pipeline
