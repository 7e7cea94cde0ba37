"""Ray Serve replicas (`llmlower serve --replicas N`): the scenarios of tests/replicas_scenarios.py run in a network
namespace of their own whose only interface is loopback. Ray's processes (its GCS, raylet, workers) listen on every
interface and cannot be told otherwise; inside that namespace nothing outside this machine's loopback reaches them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).with_name("replicas_scenarios.py")
ARTIFACT_VARIABLE = "LLMLOWER_TEST_REPLICAS_ARTIFACT"  # read by the scenarios' `artifact` fixture


@pytest.mark.slow
def test_replica_scenarios_in_a_loopback_only_network_namespace(tiny_llama, compiled):
    pytest.importorskip("ray.serve", reason="--replicas needs the replicas extra (pip install 'llmlower[replicas]')")
    if shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and ip as root, to keep Ray's listening sockets off every network")
    pytest_run = f"{sys.executable} -m pytest -q -p no:cacheprovider {SCENARIOS}"
    command = ["unshare", "--net", "sh", "-c", f"ip link set lo up && exec {pytest_run}"]
    env = {**os.environ, ARTIFACT_VARIABLE: str(compiled(tiny_llama))}  # this run's artifact: not compiled again
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=SCENARIOS.parent.parent, env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]
