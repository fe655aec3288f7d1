"""EdgeFL worked example: tabular regression with federated evaluation and no central test set.

- `model:build`: the factory the coordinator's config names (a small MLP).
- `prepare`: splits scikit-learn's diabetes data over clinics as CSV files, with each device's `[data]`.
"""
