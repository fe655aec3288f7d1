"""What a federation is configured with: the coordinator's TOML (`config`), the `[rounds]` section
(`round_settings`), the values each choice may take (`choices`), which choices run together
(`composition`), size limits (`limits`) and a site's table (`site_settings`). The bottom layer:
it imports only the contract (`edgefl_protocol`) and `models`, never the engine, so any command
can validate a configuration before anything starts.
"""
