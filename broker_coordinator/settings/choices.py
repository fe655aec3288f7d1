"""The values each choice of a federation's settings may take, and the defaults among them.

The settings layer owns these names: the modules that implement a choice (the folds in
`aggregation.robust`, the weightings in `aggregation.trust`, the policies in `engine.selection`,
the staleness weights in `aggregation.staleness`) import them from here, so that validating a
configuration never imports the engine.
"""

# the robust fold (aggregation/robust.py); the streaming ones judge each update as it arrives,
# in memory O(model), and run at sites too
AGGREGATORS = ("centered_clip", "mean", "gated_mean", "trimmed_mean", "median", "geomed")
STREAMING = ("centered_clip", "mean")
DEFAULT_AGGREGATOR = "centered_clip"
# centered_clip's kinship flag (aggregation/consensus.py): a path cosine above it flags a device; 0 = off.
# Off by default: at 0.4 it stopped no backdoor in bench/attacks.py and flagged honest Synthetic devices
DEFAULT_KINSHIP = 0.0
# centered_clip's agreement stage flags an update only when its median cosine with its round is below
# -agreement_floor (and its round's MAD rule). 0 = today's rule; the sketch measures a cosine to about
# 0.02, so flags just below 0 are mostly sketch noise and near-orthogonal honest updates (docs/RESEARCH.md)
DEFAULT_AGREEMENT_FLOOR = 0.0
# centered_clip's agreement stage: the flags among a device's last 5 judged updates before its weight falls.
# 1: from its first; 2 spares honest devices of skewed data (a third of them down-weighted on digits' label
# shards at 1, a tenth at 2) and costs the headline's 20% attacks (docs/RESEARCH.md)
DEFAULT_AGREEMENT_FLAGS = 1
AGREEMENT_WINDOW = 5  # a device's judged updates its flags are counted over
WEIGHTINGS = ("capped", "uniform", "reported")  # what a device's sample count may weigh (aggregation/trust.py)
POLICIES = ("random", "stability")  # cohort selection (engine/selection.py)
STALENESS_WEIGHTS = ("inverse_sqrt", "constant")  # buffered mode (aggregation/staleness.py)
EVALUATE_MODES = ("auto", "central", "devices", "both")
MODES = ("sync", "buffered")
TOPOLOGIES = ("flat", "sites")
# the server optimizer applied to each round's (or buffered version's) step (aggregation/server_optimizer.py),
# and its server_lr when [server_optimizer] server_lr is not set: 1.0 keeps sgd's step the server rule's own; momentum's
# 1 - server_momentum makes its long-run step on a steady pseudo-gradient the same length (Hsu et al.'s
# effective rate 1); the adaptive ones' are Flower's FedYogi / FedAdagrad defaults (adam takes yogi's)
SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")
DEFAULT_SERVER_LR = {"sgd": 1.0, "adam": 0.01, "yogi": 0.01, "adagrad": 0.1}  # momentum: 1 - server_momentum
