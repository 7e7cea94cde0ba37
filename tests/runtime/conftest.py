"""Fixtures of the runtime's tests: artifacts compiled beforehand, so that these tests run in an environment
without torch or the compiler (make test-runtime), as a deployment host runs them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.runtime.prepare import prepare

PREBUILT_ENV = "LLMLOWER_TEST_ARTIFACTS"


@pytest.fixture(scope="session")
def prebuilt(run_dir) -> Callable[[str], Path]:
    """prebuilt(name) -> the artifact prepare.ARTIFACTS names: from $LLMLOWER_TEST_ARTIFACTS, where make
    test-runtime's main environment wrote them, else compiled now, once per run. Read-only, like `compiled`."""
    given = os.environ.get(PREBUILT_ENV)

    def artifact(name: str) -> Path:
        if not given:
            return prepare(run_dir / "prebuilt", name)
        path = Path(given) / name
        if not path.is_dir():
            pytest.fail(f"{path}: not prepared; run `python tests/runtime/prepare.py {given}` where torch is")
        return path

    return artifact
