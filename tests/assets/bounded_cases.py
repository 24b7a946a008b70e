"""Cases for the bounded per-test runner's own test (tests/test_gpu_checks.py): collected only when named."""

import time


def test_fails() -> None:
    print("what the driver printed before failing")
    raise AssertionError("a failure the runner must report with its cause")


def test_hangs() -> None:
    time.sleep(600)


def test_passes() -> None:
    pass
