"""`flywheel bench fleet` end to end on a tiny fleet: runs the command given after the JSON
path, then checks that its --json carries the projection (issue 33): projection.streamed_seconds,
.rates, .assumptions, the stage table and this run's prediction by the same stage model.

usage: check_fleet_json.py OUT.json flywheel bench fleet ... --json OUT.json
"""
import json
import math
import subprocess
import sys


def positive(value, what):
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        sys.exit(f"{what}: expected a positive number, got {value!r}")


def main():
    path, command = sys.argv[1], sys.argv[2:]
    run = subprocess.run(command, timeout=150)
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {run.returncode}")
    with open(path) as f:
        result = json.load(f)
    projection = result["projection"]
    positive(projection["streamed_seconds"], "projection.streamed_seconds")
    positive(projection["in_region_seconds"], "projection.in_region_seconds")
    for key in ("encode_words_per_second", "apply_words_per_second", "tls_send_bytes_per_second",
                "tls_receive_bytes_per_second", "relay_forward_bytes_per_second",
                "bits_per_changed_word", "aead_one_core_bytes_per_second"):
        positive(projection["rates"][key], "projection.rates." + key)
    assume = projection["assumptions"]
    if assume["checkpoint_words"] != 2 ** 40 or assume["changed_fraction"] != 0.02 \
            or assume["wan_bits_per_second"] != 10e9 or assume["fan_out"] != 8 \
            or assume["trainer_cores"] != 64 or not assume["lines"]:
        sys.exit(f"projection.assumptions: not the seeds' case: {assume}")
    stages = projection["stages"]
    streamed = [s["seconds"] for s in stages if s["streamed"]]
    after = sum(s["seconds"] for s in stages if not s["streamed"])
    # The streamed pipeline takes at least its slowest stage and what runs after the last piece,
    # and at most every stage one after another.
    if not max(streamed) + after <= projection["streamed_seconds"] <= \
            projection["store_and_forward_seconds"] + 1e-9:
        sys.exit(f"projection.streamed_seconds {projection['streamed_seconds']} is outside "
                 f"[{max(streamed) + after}, {projection['store_and_forward_seconds']}]")
    if projection["wan_floor_seconds"] > projection["streamed_seconds"] + 1e-9:
        sys.exit("projection.streamed_seconds is below the WAN floor of its own delta")
    local = projection["local_check"]
    positive(local["predicted_seconds"], "projection.local_check.predicted_seconds")
    positive(local["measured_seconds"], "projection.local_check.measured_seconds")
    if not any(c.startswith("projected 1 TiB FP8") for c in result["checks"]):
        sys.exit("checks: no line for the projected 1 TiB FP8 figure")
    print("fleet --json projection: streamed %.2f s, in-region %.2f s, this run predicted %.3f s, "
          "measured %.3f s" % (projection["streamed_seconds"], projection["in_region_seconds"],
                               local["predicted_seconds"], local["measured_seconds"]))


if __name__ == "__main__":
    main()
