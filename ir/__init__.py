"""The llm op set shared by passes, backends and the cost model, and the Program they operate on."""

from .attention import ATTENTION
from .program import Program, TensorSpec
from .registry import OPS, Cost, OpDef, op_of, register_op

__all__ = ["ATTENTION", "OPS", "Cost", "OpDef", "Program", "TensorSpec", "op_of", "register_op"]
