"""The torch backend: a Program's graph run eagerly; the reference for every other backend."""

from .executor import TorchExecutor

__all__ = ["TorchExecutor"]
