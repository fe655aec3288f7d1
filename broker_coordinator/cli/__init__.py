"""The command lines and services: `broker-coordinator` (`cli`, its shared argument types in
`arguments`), its `simulate` subcommand (`simulate_cli`), the operator's commands
(`operator_cli`), the coordinator service (`service`) and the site aggregator service
(`site_service`). The top layer: it may import everything below; only `simulate_cli` imports
simulation, and `cli` imports it only when the command is `simulate`.
"""
