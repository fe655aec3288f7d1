"""A federation on one machine, for `simulate`, the benchmarks and the tests: private brokers
(`private_broker`, `local_sites`), sites with their aggregators (`simulated_sites`), the
emulated fleet (`fleet`), process control (`processes`), rounds without a broker (`in_memory`)
and the driver (`simulate`). Imports the engine; production code never imports it (an import-
linter contract).
"""
