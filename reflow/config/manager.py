"""Load, override and validate the config tree.

    cfg = ConfigManager().parse_args(["--config", "train_configs/tiny.toml", "--training.lr=1e-4"])

TOML tables map to sections, keys to fields. ``--section.key=value`` (or
``--section.key value``) overrides the file. Unknown sections or keys, values
of the wrong type and impossible combinations raise ``ConfigError`` naming the
key and the file it came from.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import sys
import typing
from typing import Any

try:
    import tomllib as _toml  # Python >= 3.11
except ModuleNotFoundError:  # pragma: no cover
    import tomli as _toml

from reflow.config.job_config import JobConfig


class ConfigError(ValueError):
    """A user error in the config: names the key and where it came from."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of a dataclass (for --help)."""
    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def read_toml(path: str) -> dict[str, Any]:
    """Parse a TOML file; a syntax error names the file."""
    with open(path, "rb") as f:
        try:
            return _toml.load(f)
        except _toml.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _field_type(section_cls: type, name: str) -> Any:
    hints = typing.get_type_hints(section_cls)
    return hints[name]


def _coerce(value: Any, typ: Any, where: str, from_cli: bool) -> Any:
    """Check (TOML values) or convert (command-line strings) ``value`` to ``typ``."""
    if from_cli and typ is not str:
        # command-line string: parse it as a TOML value when it looks like one
        text = value.strip()
        if typ is bool:
            low = text.lower()
            if low in ("true", "1", "yes"):
                return True
            if low in ("false", "0", "no"):
                return False
            raise ConfigError(f"{where}: expected a boolean (true/false), got {value!r}")
        try:
            value = _toml.loads(f"v = {text}")["v"]
        except Exception:
            raise ConfigError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    origin = typing.get_origin(typ) or typ
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (element,) = typing.get_args(typ) or (Any,)
        if element is Any:
            return value
        return [_coerce(item, element, f"{where}[{index}]", from_cli=False) for index, item in enumerate(value)]
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected a boolean, got {value!r}")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float and not isinstance(value, float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if typ is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


MOVED = {
    "training.clip_eps": "loss.clip_low",
    "training.clip_eps_high": "loss.clip_high",
    "training.kl_coef": "kl.coef",
    "training.is_truncation": "off_policy.cap (off_policy.correction = 'none' turns the correction off)",
    "training.normalize_adv_std": "advantage.estimator ('grpo' divides by the group std, 'dr_grpo' does not)",
    "training.advantage_eps": "advantage.eps",
}
"""Keys that moved to the algorithm sections: an old config gets one line saying where."""


def _set(cfg: JobConfig, section: str, key: str, value: Any, source: str, from_cli: bool = False) -> None:
    if f"{section}.{key}" in MOVED:
        raise ConfigError(f"{source}: '{section}.{key}' moved: use {MOVED[f'{section}.{key}']}")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise ConfigError(f"{source}: unknown section [{section}] (known: {', '.join(sections)})")
    sec = getattr(cfg, section)
    keys = {f.name for f in dataclasses.fields(sec)}
    if key not in keys:
        raise ConfigError(f"{source}: unknown key '{section}.{key}' (known in [{section}]: {', '.join(sorted(keys))})")
    typ = _field_type(type(sec), key)
    setattr(sec, key, _coerce(value, typ, f"{source}: '{section}.{key}'", from_cli))


class ConfigManager:
    """Builds a validated ``JobConfig`` from a TOML file plus overrides."""

    def __init__(self) -> None:
        self.config = JobConfig()
        self.sources: dict[str, str] = {}

    def load_toml(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        data = read_toml(path)
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
            for key, value in table.items():
                _set(self.config, section, key, value, path)
                self.sources[f"{section}.{key}"] = path

    def apply_overrides(self, args: list[str]) -> None:
        i = 0
        while i < len(args):
            arg = args[i]
            if not arg.startswith("--") or "." not in arg:
                raise ConfigError(f"command line: cannot parse argument {arg!r} (expected --section.key=value)")
            if "=" in arg:
                name, value = arg[2:].split("=", 1)
            else:
                if i + 1 >= len(args):
                    raise ConfigError(f"command line: {arg} needs a value")
                name, value = arg[2:], args[i + 1]
                i += 1
            section, key = (part.replace("-", "_") for part in name.split(".", 1))  # --training.max-norm works too
            _set(self.config, section, key, value, "command line", from_cli=True)
            self.sources[f"{section}.{key}"] = "command line"
            i += 1

    def parse_args(self, argv: list[str] | None = None) -> JobConfig:
        """Parse ``--config FILE [--dry-run | --check] [--section.key=value ...]``."""
        argv = list(sys.argv[1:] if argv is None else argv)
        self.dry_run = False
        self.check_only = False  # --check: validate config, placement and inputs for WORLD_SIZE ranks, then exit
        self.config_file = None
        rest: list[str] = []
        i = 0
        while i < len(argv):
            a = argv[i]
            if a in ("--config", "--job.config_file"):
                if i + 1 >= len(argv):
                    raise ConfigError("command line: --config needs a file")
                self.config_file = argv[i + 1]
                i += 2
                continue
            if a.startswith("--config="):
                self.config_file = a.split("=", 1)[1]
            elif a == "--dry-run":
                self.dry_run = True
            elif a == "--check":
                self.check_only = True
            elif a in ("-h", "--help"):
                print(self.help_text())
                raise SystemExit(0)
            else:
                rest.append(a)
            i += 1
        if self.config_file:
            self.load_toml(self.config_file)
        self.apply_overrides(rest)
        return self.config

    def where(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")

    def help_text(self) -> str:
        lines = ["usage: reflow.train --config FILE [--dry-run | --check] [--section.key=value ...]", ""]
        for sec_field in dataclasses.fields(JobConfig):
            sec = getattr(self.config, sec_field.name)
            docs = field_docs(type(sec))
            lines.append(f"[{sec_field.name}]")
            for f in dataclasses.fields(sec):
                lines.append(f"  --{sec_field.name}.{f.name}={getattr(sec, f.name)!r}  {docs.get(f.name, '')}")
        return "\n".join(lines)


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def format_config(cfg: JobConfig) -> str:
    return json.dumps(config_to_dict(cfg), indent=2, sort_keys=False)
