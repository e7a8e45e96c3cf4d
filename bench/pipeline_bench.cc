#include "bench/pipeline_bench.h"

#include <sched.h>

#include <filesystem>
#include <iomanip>
#include <sstream>
#include <vector>

#include "bench/util.h"
#include "pipeline/demo.h"
#include "pipeline/run_record.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;

struct Mode {
  std::string name;
  int64_t staleness = 0;
  bool pinned = false;
  pipeline::RunSummary summary;
};

// The CPUs this process may run on, in order.
std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

struct Comparison {
  std::string title;
  Table table;
  std::vector<std::string> notes;
};

// RL samples per second over the whole run, and time to the accuracy target, per mode.
Comparison Compare(const pipeline::RunConfig& config, const std::vector<Mode>& modes) {
  Comparison c;
  c.title = "Async vs sync pipeline RL (" + config.task.name + "-" + std::to_string(config.task.digits) +
            ", " + config.model.preset + ", " +
            std::to_string(config.fleet.regions.size() * config.fleet.workers_per_region) +
            " workers, one machine)";
  c.table.header = {"mode", "max_staleness", "RL samples/s", "steps", "time to target (s)",
                    "final accuracy", "max staleness seen", "dropped stale", "mean k3"};
  double rate[4] = {0, 0, 0, 0}, to_target[4] = {-1, -1, -1, -1};
  for (size_t i = 0; i < modes.size() && i < 4; ++i) {
    const pipeline::RunSummary& s = modes[i].summary;
    rate[i] = s.wall_seconds > 0 ? static_cast<double>(s.samples) / s.wall_seconds : 0;
    to_target[i] = s.time_to_target_s;
    std::ostringstream k3;
    k3 << std::scientific << std::setprecision(2) << s.mean_k3;
    c.table.rows.push_back({modes[i].name, std::to_string(modes[i].staleness), Fixed(rate[i], 1),
                            std::to_string(s.steps),
                            to_target[i] >= 0 ? Fixed(to_target[i], 1) : "not reached",
                            Fixed(s.final_accuracy, 3), std::to_string(s.max_staleness_observed),
                            std::to_string(s.samples_dropped_stale), k3.str()});
  }
  for (size_t pair = 0; pair + 1 < modes.size() && pair < 4; pair += 2) {
    const std::string where = modes[pair].pinned ? " (pinned roles)" : " (shared cores)";
    c.notes.push_back("async / sync samples/s" + where + ": " +
                      Fixed(rate[pair + 1] > 0 ? rate[pair] / rate[pair + 1] : 0, 2) + "x");
    if (to_target[pair] > 0 && to_target[pair + 1] > 0) {
      c.notes.push_back("sync / async time to target" + where + ": " +
                        Fixed(to_target[pair + 1] / to_target[pair], 2) + "x");
    }
  }
  c.notes.push_back("samples/s counts RL samples trained over the whole wall time (warm-up included)");
  return c;
}

// Both runs trained and stayed inside their staleness bounds.
Status CheckModes(const std::vector<Mode>& modes) {
  for (const Mode& mode : modes) {
    if (static_cast<int64_t>(mode.summary.max_staleness_observed) > mode.staleness) {
      return Status::Internal(mode.name + " run exceeded its staleness bound");
    }
    if (mode.summary.steps == 0) return Status::Internal(mode.name + " run took no step");
  }
  return Status::Ok();
}

}  // namespace

Status RunPipelineBench(const PipelineBenchOptions& options, std::ostream& out) {
  pipeline::RunConfig config = options.config;
  if (config.pipeline.max_staleness == 0) config.pipeline.max_staleness = 2;
  const std::string run_dir =
      options.run_dir.empty() ? pipeline::DefaultRunDir("bench-pipeline") : options.run_dir;
  out << "flywheel bench pipeline: the same run asynchronous (max_staleness "
      << config.pipeline.max_staleness << ") and synchronous (generate, then train), "
      << "each until accuracy " << config.run.target_accuracy << " or " << config.run.time_limit_s
      << " s\n";
  std::vector<Mode> modes = {{"async", config.pipeline.max_staleness, false, {}},
                             {"sync", 0, false, {}}};
  const std::vector<int> cpus = AllowedCpus();
  if (options.pinned && cpus.size() >= 2) {
    modes.push_back({"async-pinned", config.pipeline.max_staleness, true, {}});
    modes.push_back({"sync-pinned", 0, true, {}});
    out << "pinned runs: the trainer on CPU " << cpus.front() << ", relays and workers on the "
        << cpus.size() - 1 << " other(s)\n";
  } else if (options.pinned) {
    out << "pinned runs skipped: this process may use only one CPU\n";
  }
  for (Mode& mode : modes) {
    pipeline::FleetRunOptions run;
    run.config = config;
    if (mode.pinned) {
      run.trainer_cpus = {cpus.front()};
      run.rollout_cpus.assign(cpus.begin() + 1, cpus.end());
    }
    run.config.pipeline.max_staleness = mode.staleness;
    run.program = options.program;
    run.run_dir = (fs::path(run_dir) / mode.name).string();
    run.echo = !options.quiet;
    run.warn = options.warn;
    out << "\n== " << mode.name << " ==\n";
    FW_RETURN_IF_ERROR(pipeline::RunFleetToEnd(run, out));
    FW_ASSIGN_OR_RETURN(mode.summary, pipeline::ReadSummary((fs::path(run.run_dir) / "report").string()));
  }
  const Comparison c = Compare(config, modes);
  out << "\n" << c.title << "\n" << RenderText(c.table);
  std::string notes_text;
  for (const std::string& note : c.notes) notes_text += "- " + note + "\n";
  out << notes_text;
  if (!options.markdown.empty()) {
    const std::string section = "## Pipeline benchmark\n\n" + c.title + ", `flywheel bench pipeline`.\n\n" +
                                RenderMarkdown(c.table) + "\n" + notes_text;
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown, "## Pipeline benchmark", section));
  }
  return CheckModes(modes);
}

}  // namespace flywheel::bench
