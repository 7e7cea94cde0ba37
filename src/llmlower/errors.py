"""Errors llmlower raises for bad input: each names the file, field, op or parameter at fault."""


class LlmlowerError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class CheckpointError(LlmlowerError):
    """A checkpoint directory or GGUF file is missing, malformed or unsupported."""


class CaptureError(LlmlowerError):
    """torch.export could not capture the model."""


class PassError(LlmlowerError):
    """A pass could not rewrite the program, or its verification failed."""


class GenerationError(LlmlowerError):
    """A generation request cannot be served (e.g. the prompt is longer than the context). `field`: the request
    field at fault where there is one (`top_p`, `n`, `structured_output.json`); the message starts with it, so a
    server can name its own field instead."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestFailed(GenerationError):
    """The engine failed while serving a request (its model step, or choosing its tokens): that request alone ends;
    the details are in the log, the message says only what was being done."""


class ArgumentError(LlmlowerError, ValueError):
    """An argument (a command-line flag, an API parameter) has a value outside its range; the message names the
    flag and the value (`--stride 128: ...`)."""


class BackendError(LlmlowerError):
    """A backend's toolkit (torch.onnx, TVM, torch-mlir) failed to build an artifact; the message names the
    backend and, where it can be found, the node and op it could not lower."""


class VerificationError(LlmlowerError):
    """compile --verify: the built artifact's logits differ from the torch reference's beyond its backend's
    tolerance; the message names the backend, the step and the error measured against the tolerance."""
