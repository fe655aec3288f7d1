"""One-off probes and design runs behind the defaults, kept so that docs/RESEARCH.md ("Probes") can be
reproduced; none is a benchmark of record, and none runs in `make test`. Each is run with
`python -m research.NAME` and imports what it needs from bench/; results, where a probe writes any,
go to bench/results/."""
