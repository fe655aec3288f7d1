"""The fold pipeline, as pure computation: trusted weights and the norm bound (`trust`), the robust
step (`robust`), the streaming weighted sum (`streaming`), the centre's sum of site partials (`tree_sum`),
buffered mode's staleness factor (`staleness`), FLTrust's trusted direction (`reference`) and
the served moving average (`serving`). May import `settings`; knows nothing of MQTT, rounds or
files.
"""
