"""The values each choice of a federation's settings may take, and the defaults among them.

The settings layer owns these names: the modules that implement a choice (the folds in
`aggregation.robust`, the weightings in `aggregation.trust`, the policies in `engine.selection`,
the staleness weights in `aggregation.staleness`) import them from here, so that validating a
configuration never imports the engine.
"""

# the robust fold (aggregation/robust.py); the streaming ones judge each update as it arrives,
# in memory O(model), and run at sites too
AGGREGATORS = ("centered_clip", "mean", "gated_mean", "trimmed_mean", "median")
STREAMING = ("centered_clip", "mean")
DEFAULT_AGGREGATOR = "centered_clip"
WEIGHTINGS = ("capped", "uniform", "reported")  # what a device's sample count may weigh (aggregation/trust.py)
POLICIES = ("random", "stability")  # cohort selection (engine/selection.py)
STALENESS_WEIGHTS = ("inverse_sqrt", "constant")  # buffered mode (aggregation/staleness.py)
EVALUATE_MODES = ("auto", "central", "devices", "both")
MODES = ("sync", "buffered")
TOPOLOGIES = ("flat", "sites")
