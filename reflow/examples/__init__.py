"""Example agents for ``task.name = 'agent'`` (docs/agents.md)."""
