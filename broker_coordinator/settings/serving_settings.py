"""The coordinator's `[serving]` section: which model it publishes for the devices to serve.

    [serving]
    publish = "served"      # served (the average it evaluates and vouches for) | last (the last global model) | off
    only_better = true      # publish a version only when it scores at least as well as the one published before
    downlink = "delta"      # delta (a device holding the release before fetches only the change) | full

A device takes a release through its own gate (its held-out data) into its serving store
(edge_agent/serving_store.py); `broker-coordinator model promote N` publishes a kept version by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

PUBLISH = ("served", "last", "off")
DOWNLINK = ("delta", "full")


@dataclass
class ServingSettings:
    publish: str = "served"  # served (the average the coordinator vouches for) | last (the last global model) | off
    only_better: bool = True  # publish a version only when it scores at least as well as the last one published
    downlink: str = "delta"  # delta: a device holding one of the last releases fetches only the changes | full

    def validate(self) -> None:
        if self.publish not in PUBLISH:
            raise ValueError(f"publish must be one of {', '.join(PUBLISH)}, got {self.publish!r}")
        if self.downlink not in DOWNLINK:
            raise ValueError(f"downlink must be one of {', '.join(DOWNLINK)}, got {self.downlink!r}")
