"""Round trips of every uplink codec and combination, against their analytical bounds."""

import zlib

import msgpack
import numpy as np
import pytest

from edgefl_protocol import bitpack, codec, compression, downlink, signing
from edgefl_protocol.errors import Rejected

VALUES = ["float32", "float16", "q8", "q4", "q8c16", "q4c64"]
SPARSE = ["", "topk0.1+", "topk0.5+", "topk1+"]
COMPRESSORS = ["", "+zlib"]
ALL = [f"{s}{v}{c}" for s in SPARSE for v in VALUES for c in COMPRESSORS]


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"conv.weight": rng.normal(0, 0.05, (4, 3, 5, 5)).astype(np.float32),
            "conv.bias": rng.normal(0, 1, (4,)).astype(np.float32),
            "fc.weight": (rng.standard_t(2, (10, 33)) * 0.01).astype(np.float32),  # heavy tails, odd size
            "scalar": np.array(0.5, np.float32), "empty": np.zeros((0, 3), np.float32),
            "extra.mu": rng.normal(0, 1, (70,)).astype(np.float32),
            "extra.exact.h": rng.normal(0, 1, (7,)).astype(np.float32)}


def roundtrip(t, name, residual=None, seed=0):
    e = codec.encode(t, name, residual, np.random.default_rng(seed))
    return codec.decode(e.codec, e.specs, e.body, codec.specs_of(t), 10_000), e


def step_bound(flat, spec):
    """Per-element bound |x_hat - x| <= (max - min) / (2^B - 1) of the element's chunk."""
    n = flat.size
    chunk = spec.chunk or max(n, 1)
    bound = np.empty(n, np.float32)
    for start in range(0, n, chunk):
        part = flat[start:start + chunk]
        bound[start:start + chunk] = (part.max() - part.min()) / ((1 << spec.bits) - 1)
    return bound * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("name", ALL)
def test_every_codec_round_trips_within_its_bound(name):
    spec = codec.parse(name)
    t = tensors()
    back, encoded = roundtrip(t, name)
    assert list(back) == list(t) and all(back[k].shape == t[k].shape and back[k].dtype == np.float32 for k in t)
    np.testing.assert_array_equal(back["extra.exact.h"], t["extra.exact.h"])  # always exact
    if spec.topk:  # algorithm state: lossy like the delta, but no error feedback is kept for it
        assert not any(k.startswith("extra.") for k in encoded.residual)
        assert np.count_nonzero(back["extra.mu"]) <= codec.kept(spec, 70)
    elif spec.lossless:
        np.testing.assert_array_equal(back["extra.mu"], t["extra.mu"])
    for k, x in t.items():
        if k.startswith("extra.") or x.size == 0:
            continue
        flat, got = x.ravel(), back[k].ravel()
        if spec.topk:  # what was sent plus the residual is exactly what was there
            np.testing.assert_allclose(got + encoded.residual[k].ravel(), flat, rtol=0, atol=1e-6)
            kept = np.flatnonzero(got)
            assert len(kept) <= codec.kept(spec, flat.size)
            assert spec.topk < 1 or np.count_nonzero(encoded.residual[k]) <= flat.size  # noqa: PLR2004
            if spec.values == "float32" and spec.topk < 1:  # the kept entries are the largest ones
                threshold = np.sort(np.abs(flat))[-codec.kept(spec, flat.size)]
                assert np.all(np.abs(flat[kept]) >= threshold)
            continue
        if spec.values == "float32":
            np.testing.assert_array_equal(got, flat)
        elif spec.values == "float16":
            np.testing.assert_allclose(got, flat, rtol=2 ** -11, atol=2 ** -24)
        else:
            assert np.all(np.abs(got - flat) <= step_bound(flat, spec)), name


@pytest.mark.parametrize("name", ["q8", "q4", "q4c16"])
def test_stochastic_quantization_is_unbiased(name):
    x = {"w": np.linspace(-1, 1, 64, dtype=np.float32) ** 3}
    mean = np.mean([roundtrip(x, name, seed=s)[0]["w"] for s in range(400)], axis=0)
    step = 2 / ((1 << codec.parse(name).bits) - 1)
    assert np.max(np.abs(mean - x["w"])) < 4 * step / np.sqrt(400)  # ~4 standard errors of a uniform step


def test_four_bit_values_are_packed_two_per_byte():
    x = {"w": np.random.default_rng(0).normal(size=1001).astype(np.float32)}
    e = codec.encode(x, "q4")
    lo, step, packed = msgpack.unpackb(e.body)[0]
    assert len(packed) == 501 and len(lo) == len(step) == 4
    e8 = codec.encode(x, "q8c100")
    assert [len(b) for b in msgpack.unpackb(e8.body)[0]] == [44, 44, 1001]


def test_top_k_indices_are_delta_coded_varints():
    x = np.zeros(10_000, np.float32)
    x[[3, 200, 201, 9999]] = [1, 2, 3, 4]
    e = codec.encode({"w": x}, "topk0.0004+float32")
    k, index, _ = msgpack.unpackb(e.body)[0]
    assert k == 4 and index == bytes([3, 0xC4, 0x01, 0, 0xC5, 0x4C])  # gaps 3, 196, 0, 9797


def test_error_feedback_carries_the_residual_forward():
    rng = np.random.default_rng(1)
    deltas = [{"w": rng.normal(0, 1, 500).astype(np.float32)} for _ in range(6)]
    residual, sent_total = None, np.zeros(500, np.float32)
    for d in deltas:
        back, e = roundtrip(d, "topk0.1+q8", residual)
        residual = e.residual
        sent_total += back["w"]
    # what reached the server plus what the device still holds is everything the device produced
    np.testing.assert_allclose(sent_total + residual["w"], sum(d["w"] for d in deltas), atol=1e-4)
    # without feedback the small entries would never be sent; with it they are, eventually
    assert np.count_nonzero(sent_total) > 3 * 50


def test_residual_of_another_shape_is_ignored_and_dense_codecs_return_none():
    back, e = roundtrip({"w": np.ones(4, np.float32)}, "topk0.5+float32", {"w": np.ones(3, np.float32)})
    assert np.count_nonzero(back["w"]) == 2 and e.residual["w"].shape == (4,)
    assert codec.encode({"w": np.ones(4, np.float32)}, "q8").residual is None


def test_varint_round_trip_and_limits():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**21, 2**28, 2**32 - 1])
    np.testing.assert_array_equal(bitpack.varint_decode(bitpack.varint_encode(values), len(values)), values)
    with pytest.raises(Rejected):
        bitpack.varint_decode(b"\xff\xff\xff\xff\xff\x01", 1)  # six bytes
    with pytest.raises(Rejected):
        bitpack.varint_decode(b"\xff\xff\xff\xff\x7f", 1)  # 2^35 - 1
    with pytest.raises(Rejected):
        bitpack.varint_decode(b"\x01\x80", 1)  # dangling continuation
    with pytest.raises(ValueError):
        bitpack.varint_encode(np.array([2**32]))


@pytest.mark.parametrize("name", ["", "float64", "q3", "float32c8", "topk0+q8", "topk2+q8", "q8+gzip", "q8+zlib+zlib",
                                  "topk0.1", "x" * 100])
def test_bad_codec_names_are_explained(name):
    with pytest.raises(ValueError):
        codec.parse(name)
    with pytest.raises(Rejected) as info:
        codec.decode(name, [], b"", None, 10)
    assert info.value.reason == "codec"


def test_canonical_names():
    assert codec.parse("topk0.050+q4c64+zlib").name == "topk0.05+q4c64+zlib"
    assert codec.parse("float32").lossless and not codec.parse("float16").lossless


def test_decompression_stops_at_the_limit():
    bomb = zlib.compress(b"\0" * 10_000_000)
    with pytest.raises(Rejected) as info:
        compression.decompress(bomb, "zlib", 1000)
    assert info.value.reason == "oversized"
    for junk in (bomb[:20], bomb + b"x", b"not zlib"):
        with pytest.raises(Rejected):
            compression.decompress(junk, "zlib", 10**8)


def test_declared_sizes_are_capped_before_anything_is_read():
    with pytest.raises(Rejected) as info:
        codec.decode("float32+zlib", [["w", [2**30, 2**30]]], b"junk", None, 1000)
    assert info.value.reason == "oversized"


def test_model_download_chunks_reassemble_and_are_verified():
    weights = tensors()
    for model_codec in ("float32", "float16+zlib"):
        manifest, chunks = downlink.release(3, "arch", weights, model_codec, chunk_bytes=1024)
        assert manifest.chunks == len(chunks) > 1 and all(len(c) <= 1024 for c in chunks)
        assembly = downlink.Assembly(manifest)
        for i in reversed(range(len(chunks))):
            assembly.add(i, chunks[i])
        got = downlink.decode_weights(manifest, assembly.body(), codec.specs_of(weights), 10_000)
        tol = 0 if model_codec == "float32" else 1e-3
        assert all(np.allclose(got[k], weights[k], atol=tol, rtol=tol) for k in weights)
    broken = downlink.Assembly(manifest)
    for i, c in enumerate(chunks):
        broken.add(i, c if i else bytes([c[0] ^ 1]) + c[1:])
    with pytest.raises(Rejected, match="sha256"):
        broken.body()
    with pytest.raises(Rejected):
        broken.add(len(chunks), b"x")
    with pytest.raises(ValueError):
        downlink.release(1, "arch", weights, "q8")


def test_signature_is_checked_before_the_payload_is_read():
    key = signing.new_key()
    wire = signing.sign(b"\xc1 not msgpack", key)
    assert signing.verify(wire, key) == b"\xc1 not msgpack"
    for bad in (wire[:-1], wire[:4] + bytes([wire[4] ^ 1]) + wire[5:], b"", b"EFS1"):
        with pytest.raises(Rejected) as info:
            signing.verify(bad, key)
        assert info.value.reason == "signature"
    with pytest.raises(Rejected) as info:
        signing.verify(wire, signing.new_key())
    assert info.value.reason == "signature"
    with pytest.raises(Rejected) as info:
        signing.verify(wire, None, "dev-x")
    assert info.value.reason == "unknown_key"
    with pytest.raises(ValueError):
        signing.key_from_hex("abcd")


@pytest.mark.parametrize("name", ["topk0.1+q4c64+zlib", "topk0.01+q8c16", "topk0.3+float16", "topk0.5+q4"])
def test_top_k_tensors_decoded_together_are_bit_for_bit_those_decoded_alone(name):
    """sparse_decode.py decodes an update's top-k tensors in one pass; each alone must agree exactly,
    sparse gaps of one byte and of several (topk0.01: gaps beyond 127) alike."""
    rng = np.random.default_rng(7)
    t = tensors() | {"big": rng.standard_t(3, (40, 250)).astype(np.float32), "odd": rng.normal(size=(3, 3)).astype(np.float32)}
    e = codec.encode(t, name, None, rng)
    together = codec.decode(e.codec, e.specs, e.body, codec.specs_of(t), 100_000)
    spec = codec.parse(name)
    entries = msgpack.unpackb(compression.decompress(e.body, spec.compressor, 10**7))
    for (tensor, shape), entry in zip(e.specs, entries):
        body = compression.compress(msgpack.packb([entry], use_bin_type=True), spec.compressor)
        alone = codec.decode(e.codec, [[tensor, shape]], body, {tensor: tuple(shape)}, 100_000)[tensor]
        assert alone.dtype == together[tensor].dtype and alone.shape == together[tensor].shape
        np.testing.assert_array_equal(alone, together[tensor])


def test_a_malformed_tensor_among_good_ones_is_named():
    t = {"a": np.ones(100, np.float32), "b": np.arange(100, dtype=np.float32), "c": np.ones(50, np.float32)}
    e = codec.encode(t, "topk0.1+q4c64")
    entries = msgpack.unpackb(e.body)
    bad_minima = [entries[0], [entries[1][0], entries[1][1], [b"\x00\x00\xc0\x7f", *entries[1][2][1:]]], entries[2]]
    with pytest.raises(Rejected, match="tensor 'b': quantization minima") as nan:
        codec.decode(e.codec, e.specs, msgpack.packb(bad_minima), codec.specs_of(t), 10_000)
    assert nan.value.reason == "non_finite"
    far = [entries[0], entries[1], [entries[2][0], bytes([0x7F] * 5), entries[2][2]]]  # 5 x 128 > 50 values
    with pytest.raises(Rejected, match="tensor 'c': index .* is outside 50 values"):
        codec.decode(e.codec, e.specs, msgpack.packb(far), codec.specs_of(t), 10_000)
    short = [entries[0], [entries[1][0], entries[1][1][:-1] + b"\x80", entries[1][2]], entries[2]]
    with pytest.raises(Rejected, match="index block does not hold exactly 10 varints"):
        codec.decode(e.codec, e.specs, msgpack.packb(short), codec.specs_of(t), 10_000)


def test_auto_names_top_k_only_for_models_large_enough_to_gain_from_it():
    assert codec.resolve(codec.AUTO, codec.TOPK_MIN_VALUES) == codec.DEFAULT
    assert codec.resolve(codec.AUTO, codec.TOPK_MIN_VALUES - 1) == codec.DENSE
    assert codec.resolve("topk0.050+q8", 610) == "topk0.05+q8"  # a named codec is kept, on any model
    assert codec.check(codec.AUTO) == codec.AUTO
    with pytest.raises(ValueError, match="once the model is known"):
        codec.parse(codec.AUTO)  # it never travels: a task or an update naming it is refused
    with pytest.raises(Rejected):
        codec.decode(codec.AUTO, [], b"", None, 10)
