"""The server side: broker configuration, rounds, aggregation, evaluation, and the simulation driver."""
