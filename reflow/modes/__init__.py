"""Training modes (``reflow.modes.registry.MODES`` by name). The package imports nothing itself: the simulator
and the unit tests use its roles (``trainer_shard``, ``trainer_role``, ``leader``, ``rollout_worker``) without the live stack."""
