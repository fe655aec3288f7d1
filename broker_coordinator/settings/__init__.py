"""What a federation is configured with: the coordinator's TOML (`config`), the sections that say
how rounds run (`round_sections`, read with the keys' old `[rounds]` place by `round_config`),
what the engine receives of them (`round_settings`), the values each choice may take (`choices`),
which choices run together (`composition`), size limits (`limits`) and a site's table
(`site_settings`). The bottom layer: it imports only the contract (`edgefl_protocol`) and
`models`, never the engine, so any command can validate a configuration before anything starts.
"""
