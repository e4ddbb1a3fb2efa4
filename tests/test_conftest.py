"""The suite's own machinery (tests/conftest.py): a test that runs past its deadline fails, and names it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
def test_a_test_past_its_deadline_fails_and_the_next_one_runs(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    timeout(seconds): the deadline\n")
    (tmp_path / "test_sleepy.py").write_text(
        "import time, pytest\n\n"
        "@pytest.mark.timeout(2)\n"
        "def test_sleeps():\n    time.sleep(60)\n\n"
        "def test_after():\n    assert True\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                        "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path / "test_sleepy.py")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-3000:]
    assert "test_sleeps ran over its 2 s deadline" in r.stdout
