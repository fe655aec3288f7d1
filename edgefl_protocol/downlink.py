"""The global model on its way down: encode once per version, chunk, reassemble, verify.

The coordinator encodes the weights with a lossless codec (float32, optionally
+zlib) or float16, and publishes a small retained manifest plus the body cut
into raw chunks of at most `chunk_bytes`, each retained on its own topic. A
device subscribes to a version's chunks only when it does not already hold
that version's bytes (same sha256), reassembles them, and verifies the sha256
before decoding anything.
"""

from __future__ import annotations

import hashlib

from . import codec
from .errors import Rejected
from .messages import ModelRelease

DEFAULT_CHUNK_BYTES = 256 * 1024


def check_model_codec(name: str) -> None:
    spec = codec.parse(name)
    if spec.topk or spec.quantized:
        raise ValueError(f"model codec {name!r} must be lossless (float32) or float16, optionally +zlib")


def release(version: int, arch: str, weights, codec_name: str = "float32",
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, fingerprint: str = "") -> tuple[ModelRelease, list[bytes]]:
    check_model_codec(codec_name)
    encoded = codec.encode(weights, codec_name)
    body = encoded.body
    chunks = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)] or [b""]
    manifest = ModelRelease(version, arch, encoded.codec, encoded.specs, len(body),
                            hashlib.sha256(body).hexdigest(), len(chunks), chunk_bytes, fingerprint)
    return manifest, chunks


class Assembly:
    """Collects one version's chunks (from paho's thread); `body()` once complete and verified."""

    def __init__(self, manifest: ModelRelease) -> None:
        self.manifest = manifest
        self.parts: dict[int, bytes] = {}

    def expected_length(self, index: int) -> int:
        m = self.manifest
        return min(m.chunk_bytes, m.size - index * m.chunk_bytes)

    def add(self, index: int, data: bytes) -> None:
        if not 0 <= index < self.manifest.chunks:
            raise Rejected("schema", f"chunk {index} of a model in {self.manifest.chunks} chunks")
        if len(data) != self.expected_length(index):
            raise Rejected("malformed", f"chunk {index} has {len(data)} bytes, expected {self.expected_length(index)}")
        self.parts[index] = bytes(data)

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.manifest.chunks

    def body(self) -> bytes:
        body = b"".join(self.parts[i] for i in range(self.manifest.chunks))
        if hashlib.sha256(body).hexdigest() != self.manifest.sha256:
            self.parts.clear()
            raise Rejected("integrity", f"model version {self.manifest.version} fails its sha256 check")
        return body


def decode_weights(manifest: ModelRelease, body: bytes, expected, max_values: int):
    return codec.decode(manifest.codec, manifest.specs, body, expected, max_values)
