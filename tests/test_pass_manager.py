"""The pass manager: pipelines by name, stats, graph dumps, and verification that catches a wrong pass."""

from __future__ import annotations

import pytest
import torch

from llmlower.errors import PassError
from llmlower.ir.program import ASSERT_TARGETS
from llmlower.passes import PASSES, Pass, register_pass, run_pipeline


@pytest.fixture()
def captured(captures):
    """The tiny Llama's captured program, a fresh copy per test."""
    return captures("llama")


def test_pipeline_records_stats_and_dumps_graphs(captured, tmp_path):
    program = run_pipeline(captured, ["canonicalize", "kv_cache"], verify=True, dump_dir=tmp_path)
    assert [r.name for r in program.history] == ["canonicalize", "kv_cache"]
    canon = program.history[0]
    assert canon.stats["asserts_removed"] > 0
    assert canon.stats["nodes"] < canon.stats["nodes_before"]
    assert canon.max_error == 0.0
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps == ["00-captured.py", "01-canonicalize.py", "02-kv_cache.py"]
    assert "llmlower.attention" in (tmp_path / "02-kv_cache.py").read_text()
    targets = {n.target for n in program.graph_module.graph.nodes}
    assert not targets & ASSERT_TARGETS


def test_verification_catches_a_pass_that_changes_results(captured):
    def scale_lm_head(program):
        gm = program.graph_module
        last_linear = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default][-1]
        weight = gm.get_parameter(last_linear.args[1].target)
        weight.data.mul_(1.01)
        return program, {}

    if "test_scale_lm_head" not in PASSES:
        register_pass(Pass("test_scale_lm_head", "wrong on purpose", "", scale_lm_head))
    with pytest.raises(PassError, match="test_scale_lm_head changed the program's outputs"):
        run_pipeline(captured, ["canonicalize", "test_scale_lm_head"], verify=True)


def test_unknown_pass_is_named(captured):
    with pytest.raises(PassError, match="unknown pass 'fuse_everything'"):
        run_pipeline(captured, ["fuse_everything"])


def test_kv_cache_twice_is_refused(captured):
    with pytest.raises(PassError, match="already has a KV cache"):
        run_pipeline(captured, ["kv_cache", "kv_cache"])
