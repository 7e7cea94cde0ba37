"""The block-copy model a paged ONNX artifact carries beside its step model: for every pool, Gather the source
blocks and ScatterND them onto the destinations. The executor binds each pool as both the model's input and its
output, so only the copied blocks move (ScatterND skips its input-to-output copy when they share a buffer), on
the device the pools live on."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ...runtime.executors.onnx_paged import DESTINATIONS, SOURCES
from ...step_io import PRESENT_PREFIX, pool_names

POOL_DIMS = ("num_blocks", "block_size", "kv_heads", "head_dim")
IR_VERSION, OPSET = 8, 18


def copy_blocks_model(layers: int, element_type: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """pools k_pool_<i>, v_pool_<i> [num_blocks, ...], sources [pairs], destinations [pairs, 1] ->
    present_k_pool_<i>, ...: each pool with its source blocks copied onto the destinations."""
    names = [name for layer in range(layers) for name in pool_names(layer)]
    nodes, inputs, outputs = [], [], []
    for name in names:
        nodes.append(helper.make_node("Gather", [name, SOURCES], [f"{name}_blocks"], axis=0))
        nodes.append(helper.make_node("ScatterND", [name, DESTINATIONS, f"{name}_blocks"], [PRESENT_PREFIX + name]))
        inputs.append(helper.make_tensor_value_info(name, element_type, POOL_DIMS))
        outputs.append(helper.make_tensor_value_info(PRESENT_PREFIX + name, element_type, POOL_DIMS))
    inputs += [
        helper.make_tensor_value_info(SOURCES, TensorProto.INT64, ["pairs"]),
        helper.make_tensor_value_info(DESTINATIONS, TensorProto.INT64, ["pairs", 1]),
    ]
    graph = helper.make_graph(nodes, "copy_blocks", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model
