"""Rounds: the coordinator (`coordinator`, sync rounds), its schedules and topologies (`buffered`,
`tree`, `site_aggregator`), what happens to each answer (`intake`), who is online (`presence`),
who trains (`selection`), the round's state machine (`rounds`) and the model releases
(`releases`). May import the layers below it (aggregation, access, storage, reporting,
settings); never simulation or the command lines.
"""
