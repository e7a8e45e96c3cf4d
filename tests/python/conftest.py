"""Fixtures of the client tests: the package from python/, a fake publisher, a clean
environment (own cache dir, no flywheel binary unless a test installs the fake one) and a
hard time bound per test."""

import faulthandler
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

from fake_publisher import FakePublisher  # noqa: E402

TEST_TIME_LIMIT_S = 60


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
