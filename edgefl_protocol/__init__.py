"""The contract between devices and the coordinator.

Everything both sides must agree on lives here and nowhere else: topic names
(`topics`), message schemas (`messages`), how tensors travel (`codec`), and the
federated algorithms, each one module holding its client rule and its server
rule side by side (`algorithms`).
"""

SCHEMA_VERSION = 2  # the newest protocol version this release speaks (`protocol`: what changed, the policy)
OLDEST_SCHEMA = 1  # the oldest one it still speaks: the previous release's
