"""Device checks: the Pi install under aarch64 emulation (pi_check) and the operator guide under systemd."""
