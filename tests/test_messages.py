import msgpack
import numpy as np
import pytest

from edgefl_protocol import codec, messages, signing
from edgefl_protocol.errors import Rejected

KEY = b"k" * 32

SPECS = {"w": (2, 3), "b": (3,)}


def tensors():
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


def roundtrip(t, expected=SPECS, cap=100):
    e = codec.encode(t)
    return codec.decode(e.codec, e.specs, e.body, expected, cap)


def test_float32_codec_round_trip_is_exact():
    decoded = roundtrip(tensors())
    assert all(np.array_equal(decoded[k], v) for k, v in tensors().items())


@pytest.mark.parametrize("mutate,reason", [
    (lambda t: {**t, "w": np.zeros((3, 2), np.float32)}, "shape"),
    (lambda t: {"w": t["w"]}, "shape"),
    (lambda t: {**t, "b": np.array([1, np.nan, 2], np.float32)}, "non_finite"),
    (lambda t: {**t, "b": np.array([1, np.inf, 2], np.float32)}, "non_finite"),
])
def test_codec_rejects_wrong_shapes_and_non_finite(mutate, reason):
    t = mutate(tensors())  # the encoder refuses NaN, so write the float32 body by hand
    specs = [[k, list(v.shape)] for k, v in t.items()]
    body = msgpack.packb([v.astype("<f4").tobytes() for v in t.values()])
    with pytest.raises(Rejected) as info:
        codec.decode("float32", specs, body, SPECS, 100)
    assert info.value.reason == reason


def test_codec_checks_declared_size_before_allocating():
    with pytest.raises(Rejected) as info:
        codec.decode("float32", [["w", [100000, 100000]]], b"", None, 1000)
    assert info.value.reason == "oversized"


def test_update_round_trip_and_validation():
    e = codec.encode(tensors())
    update = messages.Update("dev-a", 3, 2, 40, {"train_loss": 0.5}, e.body, e.codec, e.specs, "fed")
    back = messages.decode_update(messages.encode_update(update, KEY), 10_000, KEY)
    assert back == update
    with pytest.raises(Rejected, match="oversized"):
        messages.decode_update(messages.encode_update(update, KEY), 10, KEY)
    with pytest.raises(Rejected, match="expected a update"):
        status = messages.encode("status", messages.Status("dev-a", "online"))
        messages.decode_update(signing.sign(status, KEY), 10_000, KEY)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({"schema": 99, "kind": "update"}),
                                     msgpack.packb({"schema": 1, "kind": "update", "device": "a/b"})])
def test_malformed_updates_raise_rejected_only(payload):
    with pytest.raises(Rejected):
        messages.decode_update(signing.sign(payload, KEY), 10_000, KEY)


def test_non_finite_metric_is_rejected():
    update = messages.Update("dev-a", 1, 0, 4, {"train_loss": float("nan")}, b"")
    with pytest.raises(Rejected, match="non_finite"):
        messages.decode_update(messages.encode_update(update, KEY), 10_000, KEY)
