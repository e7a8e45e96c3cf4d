"""Fixtures of the client tests: the package from python/, a fake publisher, a clean
environment (own cache dir, no flywheel binary unless a test installs the fake one) and a
hard time bound per test.

Skips are visible: every skip is printed as "pytest: SKIPPED <nodeid>: <reason>", which
tests/check_skips.py finds in ctest's output (under CI=true a reason outside
tests/ALLOWED_SKIPS.md fails the run). The suites that need the flywheel binary
(test_training_service.py, test_training_fleet.py) are not collected without
FLYWHEEL_TEST_BIN: ctest runs them as their own tests (python.training_service,
python.training_fleet), so python.client_unit_tests does not list them as skipped."""

import faulthandler
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

from fake_publisher import FakePublisher  # noqa: E402

TEST_TIME_LIMIT_S = 60

if not os.environ.get("FLYWHEEL_TEST_BIN"):
    collect_ignore = ["test_training_service.py", "test_training_fleet.py"]


def pytest_terminal_summary(terminalreporter):
    """One line per skip with its reason, for tests/check_skips.py."""
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        terminalreporter.write_line(f"pytest: SKIPPED {report.nodeid}: {reason}")


@pytest.fixture(autouse=True)
def time_bound():
    """Aborts the whole run with every thread's stack if one test hangs."""
    faulthandler.dump_traceback_later(TEST_TIME_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    """The push cache under tmp_path, and no flywheel binary (PATH without one)."""
    monkeypatch.setenv("FLYWHEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLYWHEEL_BIN", raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def fake():
    publisher = FakePublisher().start()
    yield publisher
    publisher.stop()
