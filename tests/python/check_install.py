#!/usr/bin/env python3
"""`pip install ./python` works offline: installs into a temporary --target with
--no-index (no network, no build dependencies) and imports the package from there."""

import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="flywheel-pip-") as target:
        install = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-index", "--no-cache-dir", "--quiet",
             "--target", target, os.path.join(REPO, "python")],
            capture_output=True, text=True, timeout=120)
        if install.returncode != 0:
            if "No module named pip" in install.stderr:
                print("skipped: this Python has no pip (apt install python3-pip)")
                return 77
            print("pip install ./python failed:\n" + install.stdout + install.stderr)
            return 1
        check = subprocess.run(
            [sys.executable, "-c",
             "import flywheel, sys; assert flywheel.__file__.startswith(sys.argv[1]), "
             "flywheel.__file__; print(flywheel.Client)", target],
            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": target},
            cwd=target)
        if check.returncode != 0:
            print("the installed package does not import:\n" + check.stdout + check.stderr)
            return 1
        print("installed and imported from", target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
