// `flywheel bench startup`: what a command costs before it does anything, and what an idle
// role holds in memory. The torch-free `flywheel` against `flywheel-torch` (the whole CLI as
// it was before the split: libtorch and its ~290 shared objects loaded at start), with
// `/bin/true` and `python3 -c pass` as the floor and a familiar peer, all in one run:
//   * wall time of `--help` and of `checkpoint hash` of a 1 MB checkpoint (median of reps);
//   * resident memory (VmRSS) of an idle publisher, relay and model-less worker, each
//     started by both binaries in turn.
// Checks its results: flywheel's --help and hash within 50 ms (100 ms with --cold), its idle roles within 40 MB
// (issue 13's targets), and flywheel-torch's rows slower/larger (the split is real).
#pragma once

#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct StartupBenchOptions {
  std::string flywheel_binary;  // empty: the flywheel beside this executable (ops::ExecutablePath)
  int reps = 10;                // runs per command (median reported)
  std::string markdown_out;     // write the table as the '## Startup benchmark' section
  bool check = true;            // fail when a target is missed
  // Drop the page cache before each timed run (root only): the first start after a deploy
  // or a reboot, read from disk. The time target is then 100 ms instead of 50.
  bool cold = false;
};

Status RunStartupBench(const StartupBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
