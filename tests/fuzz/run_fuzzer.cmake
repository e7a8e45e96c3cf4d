# Runs one libFuzzer target for a bounded time on a fresh scratch copy of its seed corpus
# (the source tree is never written). Fails when libFuzzer exits non-zero: a crash, a
# sanitizer report, a timeout or an out-of-memory input; the input is kept under
# SCRATCH/artifacts/.
#   cmake -DFUZZER=path -DSEEDS=dir -DSCRATCH=dir [-DSECONDS=20] -P run_fuzzer.cmake
foreach(var FUZZER SEEDS SCRATCH)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzzer.cmake: -D${var}= is required")
  endif()
endforeach()
if(NOT DEFINED SECONDS)
  set(SECONDS 20)
endif()
if(NOT EXISTS "${FUZZER}")
  message(FATAL_ERROR "fuzzer not built: ${FUZZER} (build the flywheel_fuzzers target)")
endif()

file(REMOVE_RECURSE "${SCRATCH}")
file(MAKE_DIRECTORY "${SCRATCH}/corpus" "${SCRATCH}/artifacts")
file(GLOB seeds LIST_DIRECTORIES false "${SEEDS}/*")
if(seeds)
  file(COPY ${seeds} DESTINATION "${SCRATCH}/corpus")
endif()
list(LENGTH seeds seed_count)
message(STATUS "fuzzing ${FUZZER} for ${SECONDS} s from ${seed_count} seeds in ${SEEDS}")

execute_process(
  COMMAND "${FUZZER}"
    -max_total_time=${SECONDS} -rss_limit_mb=2048 -timeout=10 -max_len=65536
    -print_final_stats=1 -artifact_prefix=${SCRATCH}/artifacts/
    "${SCRATCH}/corpus"
  WORKING_DIRECTORY "${SCRATCH}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(GLOB artifacts "${SCRATCH}/artifacts/*")
  message(FATAL_ERROR "libFuzzer exited with ${rc}; reproducer(s): ${artifacts}")
endif()
