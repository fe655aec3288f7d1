"""The command lines and services: `broker-coordinator` (`cli`), the operator's commands
(`operator_cli`), the coordinator service (`service`) and the site aggregator service
(`site_service`). The top layer: it may import everything below; `service`, `site_service` and
`operator_cli` never import simulation.
"""
