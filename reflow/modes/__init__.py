"""Training modes. ``training.mode`` picks one from this explicit dict."""

from reflow.modes.sync import SyncMode

MODES = {
    "sync": SyncMode,
}

__all__ = ["MODES", "SyncMode"]
