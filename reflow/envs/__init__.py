"""Environments a multi-turn task talks to while it generates: the code sandbox, tools, test runners."""
