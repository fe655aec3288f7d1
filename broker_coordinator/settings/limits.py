"""Size limits that the coordinator and the broker must agree on.

The coordinator refuses an update larger than `update_cap` (4 bytes per value
of the model and the algorithm's extra tensors, plus room for the header); the
largest message it sends itself is one model chunk (`model_chunk_bytes`). The
broker's `max_packet_size` is the larger of the two plus `PACKET_SLACK` for
the MQTT header, topic and v5 properties, so the broker drops anything the
coordinator would reject anyway, and nothing it would accept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

UPDATE_HEADER_BYTES = 64 * 1024  # an update's msgpack map beside the tensors: specs, metrics, signature
PACKET_SLACK = 4 * 1024  # MQTT fixed header, topic name (at most ~200 bytes) and v5 properties


def update_cap(specs: Mapping[str, Sequence[int]], extra_specs: Mapping[str, Sequence[int]] | None = None) -> int:
    """Bytes: the largest update the coordinator accepts for a model with these tensor shapes
    (and the algorithm's extra tensors, e.g. FedSMOO's mu), encoded as float32."""
    values = sum(math.prod(shape) for shape in {**specs, **(extra_specs or {})}.values())
    return 4 * values + UPDATE_HEADER_BYTES


def federation_update_cap(arch: str, rounds: Any = None) -> int:
    """`update_cap` for an architecture and the coordinator's RoundSettings (None = defaults),
    without a running coordinator. Imports torch (it builds the model to learn its shapes)."""
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol import algorithms, codec
    from edgefl_models.architectures import build_model, get_weights
    settings = rounds if rounds is not None else RoundSettings()
    specs = codec.specs_of(get_weights(build_model(arch)))
    extra = algorithms.get(settings.algorithm).server(settings.task_hparams(1)).extra_specs(specs)
    return update_cap(specs, extra)


def packet_limit(update_bytes: int, model_chunk_bytes: int) -> int:
    """Bytes: the broker's max_packet_size for the largest legitimate message either way."""
    return max(update_bytes, model_chunk_bytes) + PACKET_SLACK


def federation_packet_limit(arch: str, rounds: Any = None) -> int:
    from edgefl_protocol.downlink import DEFAULT_CHUNK_BYTES
    chunk = rounds.model_chunk_bytes if rounds is not None else DEFAULT_CHUNK_BYTES
    return packet_limit(federation_update_cap(arch, rounds), chunk)
