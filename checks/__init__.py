"""Checks, not benchmarks: the Pi install under aarch64 emulation and the operator guide under systemd
(`pi/`), the tests and a federation on Debian's own torch (`torch_debian`), and the test suite under load
(`test_soak`). Each writes its verdict to bench/results/ beside the benchmarks' results."""
