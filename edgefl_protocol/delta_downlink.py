"""A downlink as small as the uplink: devices that hold the last model get a lossy delta.

Three models live on the server (numpy float32 throughout):

    G_v  the global model of the server rule (`new_global` of the devices'
         updates); the coordinator checkpoints it as `weights`.
    B_v  the broadcast model: DEFINED as exactly what every device reconstructs,
             B_0 = G_0,   B_v = B_{v-1} + decode(encode(G_v - B_{v-1}))
         with `codec` (lossy, e.g. top-k + 4-bit) and the same numpy float32 ops
         on both sides (`apply`), so server and devices hold bit-identical
         weights, checked by the sha256 of their float32 encoding. Devices
         train from B_v; their deltas are relative to B_v; the server rule adds
         their mean to G_v. B is the federation's model: the coordinator
         evaluates and serves it (G, which runs ahead of what devices trained
         from, is scored beside it as `global_score`).
    r_v = G_v - B_v  what the downlink still owes: the server's error feedback.
         It needs no state of its own: the next delta, G_{v+1} - B_v =
         (G_{v+1} - G_v) + r_v, carries whatever the last one left out.

The server rule's broadcast tensors (`extra.*`, e.g. FedSMOO's s) are state,
not increments: every delta carries them whole, in float32.

Each version's delta B_{v-1} -> B_v is one retained message on
`topics.model_delta`; the last `chain` of them stay retained and the manifest
lists them (`ModelRelease.chain`: version and the first 16 hex digits of the
sha256 of the model it applies to: enough to pick a base, since every step and
the result are checked against full sha256s). A device holding any of those bases fetches the few deltas that
lead to the newest version and checks the result against the manifest's
sha256 (which, with the float32 full model, is the sha256 of B's float32
encoding); a device that is new, further behind, or holds anything else
fetches the full model (B_v, float32), retained beside the deltas as before.

`Broadcast` is the server's side (its state goes into the coordinator's
checkpoint, so a restart does not break devices' chains); `plan` and `Chain`
are the device's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import msgpack
import numpy as np

from . import OLDEST_SCHEMA, codec, messages
from .errors import Rejected

EXTRA_PREFIX = "extra."  # the server rule's tensors (algorithms.base.EXTRA_PREFIX)
MODES = ("full", "delta")
# bench/downlink.py (bench/results/downlink_controlled.md, 2 seeds, 20 rounds): no delta codec measured
# stayed within 0.5 points of the float32 downlink (topk0.1: -1.05 final, -0.67 last 3 rounds; topk0.05:
# -2.8, -2.4), so the full model stays the default; the uplink's own codec comes closest
DEFAULT_MODE = "full"
DEFAULT_CODEC = "topk0.1+q4c64+zlib"
DEFAULT_CHAIN = 8  # 8 versions: a device restarted after a typical outage still has a chain
PREFIX = 16  # hex digits of a base's sha256 in the manifest's chain
MAX_CHAIN = messages.MAX_CHAIN
Tensors = dict[str, np.ndarray]


def body_of(tensors: Mapping[str, np.ndarray]) -> bytes:
    """The float32 encoding devices hold and hash (the same bytes as a float32 full release)."""
    return codec.encode(tensors, "float32").body


def tensors_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    return hashlib.sha256(body_of(tensors)).hexdigest()


def check_settings(mode: str, codec_name: str, chain: int, model_codec: str) -> None:
    """Validate [rounds] downlink settings; ValueError names the key."""
    if mode not in MODES:
        raise ValueError(f"downlink must be one of {', '.join(MODES)}, got {mode!r}")
    try:
        codec.parse(codec_name)
    except ValueError as exc:
        raise ValueError(f"downlink_codec: {exc}") from None
    if not 1 <= chain <= MAX_CHAIN:
        raise ValueError(f"downlink_chain must be in [1, {MAX_CHAIN}] (deltas retained for that many versions)")
    if mode == "delta" and model_codec != "float32":
        raise ValueError(f"downlink = \"delta\" needs model_codec = \"float32\", not {model_codec!r}: the full "
                         "model must be exactly the broadcast model devices reconstruct")


def apply(base: Mapping[str, np.ndarray], delta: messages.ModelDelta, max_values: int) -> Tensors:
    """base + decode(delta), float32; the server rule's tensors replaced. The one function both
    sides use, so both hold the same bits. Raises Rejected (shapes, codec, values)."""
    shapes = {name: a.shape for name, a in base.items() if not name.startswith(EXTRA_PREFIX)}
    step = codec.decode(delta.codec, delta.specs, delta.body, shapes, max_values)
    state = codec.decode("float32", delta.state_specs, delta.state, None, max_values)
    if any(not name.startswith(EXTRA_PREFIX) for name in state):
        raise Rejected("schema", f"delta to version {delta.version}: state tensors must be named {EXTRA_PREFIX}*")
    out = {name: np.add(base[name], step[name], dtype=np.float32) for name in shapes}
    out.update(state)
    return out


# --- the server's side ----------------------------------------------------------------

class Broadcast:
    """B (model tensors and the server rule's tensors) at `version`, and the retained deltas."""

    def __init__(self, tensors: Mapping[str, np.ndarray], version: int, codec_name: str = DEFAULT_CODEC,
                 chain: int = DEFAULT_CHAIN, skips: bool = False) -> None:
        self.codec, self.chain = codec_name, chain
        self.skips = skips  # a delta may lead to any newer version (serving releases), not only the next one
        self._reset(tensors, version)

    def _reset(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self.tensors: Tensors = {n: np.asarray(a, dtype=np.float32).copy() for n, a in tensors.items()}
        self.version = version
        self.sha256 = tensors_sha256(self.tensors)
        self.deltas: dict[int, bytes] = {}  # version -> the encoded ModelDelta leading to it (retained)
        self.bases: dict[int, str] = {}  # version -> sha256 of the model its delta applies to

    def advance(self, target: Mapping[str, np.ndarray], version: int) -> Tensors:
        """Move B to `version` towards `target` (G_version and the server rule's tensors); returns B.
        Idempotent per version. A gap of more than one version (unless `skips`), an older version, or
        other tensors start afresh (B = target, no deltas: every device fetches the full model once)."""
        if version == self.version:
            return self.tensors
        model = [n for n in target if not n.startswith(EXTRA_PREFIX)]
        follows = version > self.version if self.skips else version == self.version + 1
        if not follows or [n for n in self.tensors if not n.startswith(EXTRA_PREFIX)] != model \
                or any(self.tensors[n].shape != np.shape(target[n]) for n in model):
            self._reset(target, version)
            return self.tensors
        owed = {n: np.subtract(target[n], self.tensors[n], dtype=np.float32) for n in model}
        # stochastic rounding from a seed the state determines: a coordinator restarted from its
        # checkpoint re-derives the very same delta
        seed = int.from_bytes(hashlib.sha256(f"{version}/{self.sha256}".encode()).digest()[:8], "little")
        encoded = codec.encode(owed, self.codec, rng=np.random.default_rng(seed))
        state = codec.encode({n: a for n, a in target.items() if n.startswith(EXTRA_PREFIX)}, "float32")
        delta = messages.ModelDelta(version, self.sha256, "", encoded.codec, encoded.specs, encoded.body,
                                    state.specs, state.body)
        tensors = apply(self.tensors, delta, sum(a.size for a in self.tensors.values()) + sum(
            np.size(target[n]) for n in target if n.startswith(EXTRA_PREFIX)))
        delta.sha256 = tensors_sha256(tensors)
        self.deltas[version], self.bases[version] = messages.encode("delta", delta, OLDEST_SCHEMA), self.sha256
        self.tensors, self.version, self.sha256 = tensors, version, delta.sha256
        for old in sorted(self.deltas)[:-self.chain]:
            del self.deltas[old], self.bases[old]
        return self.tensors

    def manifest_chain(self) -> list[list]:
        """`ModelRelease.chain`: [[version, sha256 of its base], ...], oldest first."""
        return [[v, self.bases[v][:PREFIX]] for v in sorted(self.deltas)]

    def state(self) -> dict:
        return {"version": self.version, "tensors": self.tensors, "deltas": self.deltas, "bases": self.bases}

    def load(self, state: Mapping, global_version: int) -> bool:
        """Take the checkpointed state if it belongs to `global_version` (B is there or one version
        behind: the next `advance` re-derives the same delta); else keep a fresh start. True if taken."""
        if not state or state.get("version") not in (global_version - 1, global_version):
            return False
        self._reset(state["tensors"], int(state["version"]))
        self.deltas = {int(v): bytes(d) for v, d in state.get("deltas", {}).items()}
        self.bases = {int(v): str(s) for v, s in state.get("bases", {}).items()}
        return True


# --- the device's side ----------------------------------------------------------------

def plan(manifest: messages.ModelRelease, held: Mapping[str, bytes]) -> tuple[int, bytes] | None:
    """(first delta version, base body) for the shortest chain from a model we hold (sha256 -> float32
    body) to `manifest.version`; None if no retained chain starts at one (new, too far behind, or a
    model the server never broadcast): fetch the full model."""
    versions = [entry[0] for entry in manifest.chain]
    if not versions or versions[-1] != manifest.version or versions != sorted(set(versions)):
        return None  # not a run of deltas ending at this version
    prefixes = {sha[:PREFIX]: body for sha, body in held.items()}
    for version, base in reversed(manifest.chain):
        if base in prefixes:
            return version, prefixes[base]
    return None


class Chain:
    """Deltas `first`..`manifest.version` for one device, applied once all have arrived."""

    def __init__(self, manifest: messages.ModelRelease, first: int, base: bytes) -> None:
        self.manifest, self.first, self.base = manifest, first, base
        self.bases = dict(manifest.chain)
        self.got: dict[int, messages.ModelDelta] = {}

    @property
    def versions(self) -> list[int]:
        """The deltas to apply, in order: the manifest's chain from `first` on."""
        return [v for v in self.bases if v >= self.first]

    def add(self, delta: messages.ModelDelta) -> None:
        if delta.version not in self.versions:
            raise Rejected("schema", f"delta to version {delta.version} is not in the chain "
                                     f"{self.first}..{self.manifest.version}")
        if delta.base_sha256[:PREFIX] != self.bases.get(delta.version):
            raise Rejected("integrity", f"delta to version {delta.version} applies to another model than "
                                        "the manifest lists")
        self.got[delta.version] = delta

    @property
    def complete(self) -> bool:
        return len(self.got) == len(self.versions)

    def body(self, max_values: int) -> bytes:
        """The reconstructed float32 body of `manifest.version`, its sha256 checked at every step;
        Rejected("integrity") on any mismatch (the caller fetches the full model)."""
        tensors = _model_tensors(self.base, self.manifest.specs, max_values)
        sha = hashlib.sha256(self.base).hexdigest()
        for version in self.versions:
            delta = self.got[version]
            if delta.base_sha256 != sha:
                raise Rejected("integrity", f"delta to version {version} applies to model {delta.base_sha256[:12]}, "
                                            f"we hold {sha[:12]}")
            tensors = apply(tensors, delta, max_values)
            sha = tensors_sha256(tensors)
            if sha != delta.sha256:
                raise Rejected("integrity", f"delta to version {version} reconstructs {sha[:12]}, "
                                            f"the server has {delta.sha256[:12]}")
        body = body_of(tensors)
        if sha != self.manifest.sha256:
            raise Rejected("integrity", f"deltas reconstruct {sha[:12]}, manifest {self.manifest.version} "
                                        f"says {self.manifest.sha256[:12]}")
        return body


def _model_tensors(body: bytes, specs: list, max_values: int) -> Tensors:
    """The model tensors of a float32 body we hold (sha256-verified), named by the newest manifest's
    specs; its `extra.*` tensors, which every delta replaces, are skipped (their set may change).
    A base whose tensors differ cannot reproduce the manifest's sha256: the device fetches in full."""
    model = [s for s in specs if isinstance(s, list) and s and not str(s[0]).startswith(EXTRA_PREFIX)]
    try:
        entries = msgpack.unpackb(body, raw=False, max_array_len=codec.MAX_TENSORS, max_str_len=0, max_map_len=0)
    except Exception as exc:  # msgpack raises many types for junk
        raise Rejected("malformed", f"the held model is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(entries, list) or len(entries) < len(model):
        raise Rejected("shape", f"the held model has fewer than the manifest's {len(model)} model tensors")
    return codec.decode("float32", model, msgpack.packb(entries[:len(model)], use_bin_type=True), None, max_values)
