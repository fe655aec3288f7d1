"""The engine: one loop (`loop.Engine`) given a schedule (`sync_rounds`, `buffered`), a topology
(`flat`, `tree`; `site_aggregator` runs a site's share), a transport (`transport`: MQTT or in
memory), and the parts it holds: what happens to each answer (`intake`), who is online
(`presence`), the model releases (`releases`) and what a round leaves behind (`records`); who
trains (`selection`) and the round's state machine (`rounds`). May import the layers below it
(aggregation, access, storage, reporting, settings); never simulation or the command lines.
"""
