"""A stand-in for the `flywheel` binary in client tests: only `delta encode`.

Appends its arguments as one JSON line to $FAKE_FLYWHEEL_LOG and writes a small fake
delta to --out: b"FAKEDELTA", then JSON {base_version, target_version, target_sha256}.
With $FAKE_FLYWHEEL_FAIL set it prints an error and exits 1 instead.
"""

import argparse
import hashlib
import json
import os
import sys


def main() -> int:
    with open(os.environ["FAKE_FLYWHEEL_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(sys.argv[1:]) + "\n")
    if sys.argv[1:3] != ["delta", "encode"]:
        print(f"fake flywheel: unexpected command {sys.argv[1:]}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser()
    for flag in ("--base", "--target", "--out", "--base-version", "--target-version"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args(sys.argv[3:])
    if os.environ.get("FAKE_FLYWHEEL_FAIL"):
        print("error: tensor 'x': shape differs between base and target", file=sys.stderr)
        return 1
    digest = ""
    if os.path.isfile(args.target):
        with open(args.target, "rb") as target:
            digest = hashlib.sha256(target.read()).hexdigest()
    with open(args.out, "wb") as out:
        out.write(b"FAKEDELTA" + json.dumps({"base_version": int(args.base_version),
                                             "target_version": int(args.target_version),
                                             "target_sha256": digest}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
