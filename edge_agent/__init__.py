"""The device side: local data, the local training loop, and the MQTT session."""
