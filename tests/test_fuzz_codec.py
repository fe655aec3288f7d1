"""Fuzzing the receive path with hypothesis: random and mutated update envelopes.

The receive path is exactly the coordinator's: size cap, signature, header,
codec decode against the expected shapes and the value cap. Whatever arrives,
it returns a valid update or raises `Rejected`; never another exception, and
never an allocation anywhere near a declared (hostile) size.

Profiles (environment variable EDGEFL_FUZZ_PROFILE):
    ci    (default) 5 tests x 500 examples = 2,500 cases, a few seconds
    long  5 tests x 20,000 examples = 100,000 cases, for a manual run:
          EDGEFL_FUZZ_PROFILE=long .venv/bin/python -m pytest -q tests/test_fuzz_codec.py
"""

import math
import os
import tracemalloc
import zlib

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefl_protocol import SCHEMA_VERSION, codec, messages, signing
from edgefl_protocol.errors import Rejected

settings.register_profile("edgefl-ci", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("edgefl-long", max_examples=20_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile("edgefl-" + os.environ.get("EDGEFL_FUZZ_PROFILE", "ci"))

KEY = b"fuzz-key-0123456789abcdef0123456"
SPECS = {"w": (6, 5), "b": (5,), "extra.mu": (3,)}
CAP = sum(math.prod(s) for s in SPECS.values())
MAX_BYTES = 4 * CAP + 64 * 1024
BOMB = zlib.compress(b"\0" * 1_000_000)  # inflates far past any limit the specs allow
CODECS = [f"{s}{v}{c}" for s in ("", "topk0.2+", "topk1+") for v in ("float32", "float16", "q8", "q4", "q4c4")
          for c in ("", "+zlib")]


def receive(data: bytes, expected=SPECS) -> dict:
    update = messages.decode_update(data, MAX_BYTES, KEY, "dev-a")
    return codec.decode(update.codec, update.specs, update.body, expected, CAP)


def accept_or_reject(data: bytes, expected=SPECS) -> None:
    try:
        out = receive(data, expected)
    except Rejected as exc:
        assert exc.reason and exc.detail
        return
    assert sum(a.size for a in out.values()) <= CAP
    for name, array in out.items():
        assert array.dtype == np.float32 and np.isfinite(array).all()
        if expected is not None:
            assert array.shape == expected[name]
    if expected is not None:
        assert set(out) == set(expected)


floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=20)


@st.composite
def valid_payload(draw) -> dict:
    """A genuine update header map: random codec, random values, random metrics."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    scale = draw(st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e30]))
    tensors = {name: (rng.standard_t(2, shape) * scale).astype(np.float32) for name, shape in SPECS.items()}
    encoded = codec.encode(tensors, draw(st.sampled_from(CODECS)), rng=np.random.default_rng(draw(st.integers(0, 9))))
    update = messages.Update("dev-a", draw(st.integers(0, 2**31)), draw(st.integers(0, 99)), draw(st.integers(1, 999)),
                             {"train_loss": draw(floats)}, encoded.body, encoded.codec, encoded.specs, "test")
    return {"schema": SCHEMA_VERSION, "kind": "update", **update.__dict__}


def mutate(data: bytes, draw) -> bytes:
    """Truncate, flip bits, insert or delete bytes."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "truncate":
            del data[pos:]
        elif kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
    return bytes(data)


@PROFILE
@given(st.binary(max_size=2048) | st.builds(lambda b: signing.MAGIC + b, st.binary(max_size=256)))
def test_random_bytes_are_rejected(data):
    accept_or_reject(data)
    accept_or_reject(data, None)


@PROFILE
@given(valid_payload(), st.data())
def test_mutated_envelopes_signed_or_not(payload, data):
    packed = msgpack.packb(payload, use_bin_type=True)
    accept_or_reject(signing.sign(packed, KEY))  # the genuine one
    mutated = mutate(packed, data.draw)
    accept_or_reject(signing.sign(mutated, KEY))  # a device with the key sending junk
    accept_or_reject(mutate(signing.sign(packed, KEY), data.draw))  # damage in transit: signature fails
    body = mutate(payload["body"], data.draw)  # damage inside the (re-signed) tensor body
    accept_or_reject(signing.sign(msgpack.packb({**payload, "body": body}, use_bin_type=True), KEY), None)


@PROFILE
@given(valid_payload(), st.sampled_from(["schema", "kind", "device", "round", "model_version", "num_samples",
                                         "metrics", "body", "codec", "specs", "federation", "extra"]), junk)
def test_wrong_types_and_nested_junk_in_any_field(payload, field, value):
    payload = {**payload, field: value}
    accept_or_reject(signing.sign(msgpack.packb(payload, use_bin_type=True), KEY))


dims = st.lists(st.integers(0, 2**31 - 1) | st.integers(2**31, 2**64 - 1) | st.integers(-5, -1), max_size=9)


@PROFILE
@given(valid_payload(), st.lists(st.tuples(st.sampled_from(["w", "b", "extra.mu", "x"]), dims), max_size=5),
       junk, st.booleans())
def test_huge_declared_sizes_never_allocate(payload, specs, entries, compress):
    """Declared sizes up to 2^64 and bodies of nested junk (optionally a zlib bomb): memory stays small."""
    body = BOMB if compress else msgpack.packb(entries, use_bin_type=True)
    payload = {**payload, "specs": [[n, d] for n, d in specs], "body": body,
               "codec": payload["codec"].replace("+zlib", "") + ("+zlib" if compress else "")}
    wire = signing.sign(msgpack.packb(payload, use_bin_type=True), KEY)
    tracemalloc.start()
    try:
        accept_or_reject(wire, None)
        accept_or_reject(wire)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_BYTES + 1_000_000  # the message itself and small change, never a declared size


nonfinite = st.sampled_from([float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38])


@PROFILE
@given(valid_payload(), nonfinite, st.integers(0, 1000), st.sampled_from(["values", "lo", "step"]))
def test_nan_and_inf_anywhere_are_rejected(payload, bad, where, part):
    """Poison one float of the body (a value, a quantization minimum or step) and re-sign."""
    spec = codec.parse(payload["codec"])
    entries = msgpack.unpackb(zlib.decompress(payload["body"]) if spec.compressor else payload["body"])
    i = where % len(entries)
    entry = entries[i]
    target = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int) else entry
    if isinstance(target, list):  # quantized: [lo, step, packed]
        slot = {"lo": 0, "step": 1}.get(part, 0)
        raw = bytearray(target[slot])
        if raw:
            raw[:4] = np.float32(bad).tobytes()
        target[slot] = bytes(raw)
    elif isinstance(target, bytes) and target:
        width = 2 if spec.values == "float16" and not payload["specs"][i][0].startswith("extra.exact.") else 4
        raw = bytearray(target)
        pos = (where // 7) % (len(raw) // width) * width
        with np.errstate(over="ignore"):  # a huge value overflowing float16 to infinity is the point
            raw[pos:pos + width] = np.array(bad, dtype="<f2" if width == 2 else "<f4").tobytes()
        if entry is target:
            entries[i] = bytes(raw)
        else:
            entry[2] = bytes(raw)
    body = msgpack.packb(entries, use_bin_type=True)
    payload = {**payload, "body": zlib.compress(body) if spec.compressor else body}
    accept_or_reject(signing.sign(msgpack.packb(payload, use_bin_type=True), KEY))
