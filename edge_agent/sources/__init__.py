"""The data sources behind edge_agent/data_sources.py: one module per kind of source."""
