"""Training modes (``reflow.modes.registry.MODES`` by name). The package imports nothing itself: the simulator
and the unit tests use its roles (``trainer_shard``, ``leader``, ``commands``) without the live stack."""
