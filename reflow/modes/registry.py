"""Training modes by name: ``training.mode`` picks one from this explicit dict."""

from reflow.modes.decoupled import DecoupledMode
from reflow.modes.sync import SyncMode

MODES = {
    "sync": SyncMode,
    "one_step_off": DecoupledMode,
    "async": DecoupledMode,
    "reflow": DecoupledMode,
}
