// `flywheel bench churn` (tools/bench_commands.h). Registration point; the benchmark is being
// built for issue 33 and registers nothing until it lands.
#include <CLI/CLI.hpp>

#include "tools/bench_commands.h"

namespace flywheel::tools {

void AddChurnBenchCommand(CLI::App& bench_app, Action& action) {
  (void)bench_app;
  (void)action;
}

}  // namespace flywheel::tools
