"""A model as an ONNX file, for applications in any language (onnxruntime and others): what the
coordinator's `model export --format onnx` writes and what a device's serving store keeps beside
`model.pt` when the `onnx` package is installed there (`pip install edgefl[onnx]`)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

HINT = "ONNX export needs the onnx package on this machine: pip install edgefl[onnx]"


class OnnxUnavailable(Exception):
    """This machine cannot write the model as ONNX; the message says why."""


def available() -> bool:
    return importlib.util.find_spec("onnx") is not None


def write_onnx(model: Any, input_shape: tuple[int, ...], path: Path | str) -> None:
    """`model` (a torch module in eval mode) to `path`, with a dynamic batch dimension: input "input",
    output "output". Importing this module does not import torch (the CLI's model commands start
    without it)."""
    import torch
    if not available():
        raise OnnxUnavailable(HINT)
    sample = torch.zeros((1, *input_shape))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation notes on the TorchScript-based exporter
            torch.onnx.export(model, (sample,), str(path), input_names=["input"], output_names=["output"],
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False)
    except Exception as exc:  # an architecture's operator the exporter does not know
        Path(path).unlink(missing_ok=True)
        raise OnnxUnavailable(f"model {model.__class__.__name__} does not export to ONNX: {exc}") from None
