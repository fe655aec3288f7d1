"""What the fold made of each accepted update: its verdict, which the device's receipt carries.

    folded    in the aggregate as sent (scale 1)
    clipped   in the aggregate, shortened by the norm bound and/or pulled towards the centre by
              centered clipping; `scale` is what the device commits (see below)
    left_out  accepted (valid, signed, in time) but not in the aggregate: the direction gate
              dropped it, or its round was abandoned; scale 0
    pending   not decided yet: a cold start holds it until the flush, a non-streaming fold
              (gated_mean, trimmed_mean, median, geomed) until the round closes. A second receipt with
              the final verdict follows when the fold decides.

The verdicts are read off `RobustRound`'s own records (`clipped`, `centered`, `gated`, `held`),
never recomputed: what the receipt says is what the fold did.

The scale of a clipped update. Norm clipping multiplies the delta d by s1 = bound / ||d||: the
device commits s1 d exactly. Centered clipping folds c + k (s1 d - c), k = tau / ||s1 d - c||,
around a centre c the device does not hold. The receipt carries the effective scale, the
projection of what was folded on what was sent,
    s = <folded, d> / ||d||^2 = k s1 + (1 - k) <c, d> / ||d||^2,
clamped to [0, 1]: the multiple of its own delta closest (in L2) to its contribution, and never
more than it sent. The coordinator computes <c, d> once per update that the centre may clip
(O(model), at intake).

An identical resend of an accepted update (its receipt was lost) is answered with the same
verdict, as long as the replay guard remembers the round (`REPLAY_ROUNDS`); `not_folded` on a
rejection says the coordinator vouches that it never accepted that update (it ran the round and
still remembers it), so the device may owe the delta again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker_coordinator.aggregation.fold import MEDIAN, Fold

log = logging.getLogger("broker_coordinator")
FOLDED, CLIPPED, LEFT_OUT, PENDING = "folded", "clipped", "left_out", "pending"
NOT_FOLDED = "not_folded"  # on a rejection: the coordinator vouches that it never accepted it
Key = tuple[str, int, int]  # (device, round, attempt)
REPLAY_ROUNDS = 10  # rounds whose accepted answers (and their verdicts) the replay guard remembers


@dataclass(frozen=True)
class Verdict:
    kind: str
    scale: float = 1.0
    detail: str = ""
    weight: float = 1.0  # the share of its claimed weight the fold gave it (standing from earlier rounds)

    @property
    def counted(self) -> bool:
        """Whether the update is in the aggregate (at some scale)."""
        return self.kind in (FOLDED, CLIPPED)


def _dot_ratio(center: Mapping[str, np.ndarray] | None, delta: Mapping[str, np.ndarray]) -> float | None:
    """<c, d> / ||d||^2 over the centre's tensors (None without a centre or for a zero delta)."""
    if center is None:
        return None
    dot = sq = 0.0
    for name, c in center.items():
        d = np.asarray(delta[name], dtype=np.float64).ravel()
        dot += float(np.einsum("i,i->", np.asarray(c, dtype=np.float64).ravel(), d))
        sq += float(np.einsum("i,i->", d, d))
    return dot / sq if sq > 0 else None


def judge(aggregate: Any, device: str, ratio: float | None) -> Verdict:
    """The verdict on `device`'s update once the fold has decided it (see the module's docstring)."""
    if device in aggregate.gated:
        return Verdict(LEFT_OUT, 0.0, f"direction: cosine {aggregate.gated[device]:.2f} with "
                                      f"{getattr(aggregate, 'gated_by', MEDIAN)}")
    share, why = aggregate.discounted.get(device, (1.0, ""))
    weighed = f"weighed at {share:.2f} of its claim: {why}" if share < 1 else ""
    scale, parts = 1.0, []
    if device in aggregate.clipped:
        norm, bound = aggregate.clipped[device]
        scale = bound / norm if norm > 0 else 0.0
        parts.append(f"norm {norm:.4g} -> {bound:.4g}")
    if device in aggregate.centered:
        distance, radius = aggregate.centered[device]
        k = radius / distance if distance > 0 else 1.0
        scale = min(1.0, max(0.0, k * scale + (1 - k) * (ratio or 0.0)))
        parts.append(f"distance from the centre {distance:.4g} -> {radius:.4g}")
    if not parts:
        return Verdict(FOLDED, 1.0, weighed, share)
    detail = f"{'; '.join(parts)}; effective scale {scale:.4g}" + (f"; {weighed}" if weighed else "")
    return Verdict(CLIPPED, scale, detail, share)


class Verdicts:
    """The verdicts of one coordinator or site worker: decided ones for the replay guard's window,
    and the pending ones of the open round (with what the centre needs of their delta)."""

    def __init__(self) -> None:
        self.decided: dict[Key, Verdict] = {}
        self.pending: dict[Key, tuple[Any, float | None]] = {}  # key -> (its aggregate, <c,d>/||d||^2)

    @staticmethod
    def mark(aggregate: Any, device: str) -> tuple[Any, Any]:
        """Taken just before `add`: the entries (if any) an earlier update of the device left."""
        return aggregate.clipped.get(device), aggregate.centered.get(device)

    def on_fold(self, aggregate: Fold, key: Key, delta: Mapping[str, np.ndarray], streaming: bool,
                mark: tuple[Any, Any] = (None, None)) -> Verdict:
        """Right after `aggregate.add`: the verdict if the fold decided at once, else pending."""
        device = key[0]
        center = aggregate.center
        if aggregate.undecided(device):
            self.pending[key] = (aggregate, _dot_ratio(center, delta))
            return Verdict(PENDING, 1.0, "the fold decides at " + ("the cold start's flush" if streaming
                                                                   else "the round's close"))
        centered = aggregate.centered.get(device)
        ratio = _dot_ratio(center, delta) if centered is not None and centered is not mark[1] else None
        verdict = judge(_Fresh(aggregate, device, mark), device, ratio)
        self.decided[key] = verdict
        return verdict

    def settle(self, aggregate: Fold) -> list[tuple[Key, Verdict]]:
        """The pending updates of `aggregate` the fold has decided since: after a flush, or at the
        close (after `mean()` or `streamed()`)."""
        out = []
        for key, (agg, ratio) in list(self.pending.items()):
            if agg is aggregate and not aggregate.undecided(key[0]):
                del self.pending[key]
                self.decided[key] = judge(agg, key[0], ratio)
                out.append((key, self.decided[key]))
        return out

    def abandon(self, round_no: int, attempt: int, reason: str) -> list[tuple[Key, Verdict]]:
        """Every update accepted into an attempt that was abandoned: none of them is in any
        aggregate, whatever its first receipt said."""
        keys = [k for k in [*self.pending, *self.decided] if k[1:] == (round_no, attempt)]
        out = []
        for key in keys:
            self.pending.pop(key, None)
            if key not in self.decided or self.decided[key].counted:
                self.decided[key] = Verdict(LEFT_OUT, 0.0, f"round {round_no} abandoned: {reason}")
                out.append((key, self.decided[key]))
        return out

    def of(self, key: Key) -> Verdict | None:
        if key in self.pending:
            return Verdict(PENDING, 1.0, "the fold has not decided yet")
        return self.decided.get(key)

    def forget(self, before_round: int) -> None:
        """Keep what the replay guard keeps: rounds from `before_round` on."""
        self.decided = {k: v for k, v in self.decided.items() if k[1] >= before_round}

    def double_counted(self, device: str, metrics: Mapping[str, Any]) -> list[str]:
        """The earlier updates (round.attempt) a new update says it still carries as owed, of those
        this coordinator folded: an agent that owes a folded update counts it twice."""
        claimed = metrics.get("owed")
        if not isinstance(claimed, str) or not claimed:
            return []
        found = []
        for item in claimed.split()[:16]:
            parts = item.split(".")
            if len(parts) == 2 and all(p.isdigit() for p in parts):
                verdict = self.decided.get((device, int(parts[0]), int(parts[1])))
                if verdict is not None and verdict.counted:
                    found.append(item)
        return found


class _Fresh:
    """The aggregate's records as this one `add` left them: an entry an earlier update of the same
    device left (buffered mode: two tasks in one buffer) is not this update's."""

    def __init__(self, aggregate: Any, device: str, mark: tuple[Any, Any]) -> None:
        self.gated, self.discounted = aggregate.gated, aggregate.discounted
        self.clipped = {device: v} if (v := aggregate.clipped.get(device)) is not None and v is not mark[0] else {}
        self.centered = ({device: v} if (v := aggregate.centered.get(device)) is not None and v is not mark[1]
                         else {})
