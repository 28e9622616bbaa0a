"""Models and datasets by their Hugging Face hub names, through the standard cache.

    resolve_model("Qwen/Qwen3-8B", key)          -> the snapshot folder in the hub cache (downloaded if needed)
    dataset_files("org/name:train", key)         -> the split's Parquet or JSONL files in the hub cache

A value that names an existing path is a local folder or file, as before; a value of the form ``org/name`` (a
dataset's with ``:split``) that is not a path is a hub id. With ``HF_HUB_OFFLINE=1`` both come from the cache
only, and an id missing there is one line naming it and the command that fetches it. The cache is
huggingface_hub's (``HF_HOME``, ``HF_HUB_CACHE``): what ``huggingface-cli download`` fills, shared with
transformers, vLLM and verl.

A dataset repository's split is found by the layouts the hub uses for data files: ``data/<split>-*.parquet``,
``<split>-*.parquet``, ``<config>/<split>-*.parquet``, and the same for ``.jsonl`` and ``.json``, or a file
named ``<split>.<ext>``. The rows are read with ``datasets`` (its Parquet and JSON builders) and parsed as any
local file's (``reflow.tasks.datasets``).
"""

from __future__ import annotations

import functools
import os
import re

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
DATA_EXTENSIONS = (".parquet", ".jsonl", ".json")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def is_hub_id(value: str) -> bool:
    """``org/name`` that is not a path: neither it nor its first part exists (relative to the working directory
    or the repo root), so that a mistyped ``outputs/run1`` is a missing folder, not a hub id."""
    from reflow.model.recipe import resolve_path

    if not HUB_ID.match(value):
        return False
    org = value.split("/", 1)[0]
    return not any(os.path.exists(path) for path in (value, resolve_path(value), org, resolve_path(org)))


def _snapshot(repo_id: str, repo_type: str, key: str, allow_patterns: list[str] | None = None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    fetch = f"huggingface-cli download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{repo_id}"
    try:
        return snapshot_download(repo_id, repo_type=repo_type, allow_patterns=allow_patterns, local_files_only=_offline())
    except LocalEntryNotFoundError:
        where = (
            "HF_HUB_OFFLINE=1 and it is not in the Hugging Face cache" if _offline()
            else "it is not in the cache and the hub cannot be reached"
        )
        raise ValueError(f"{key}: {repo_type} {repo_id!r} cannot be loaded: {where} ({_cache_dir()}); "
                         f"fetch it with `{fetch}` where there is network, or give a local path") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{key}: no {repo_type} {repo_id!r} on the Hugging Face hub (or it is gated: log in with "
                         "`huggingface-cli login`)") from None
    except HfHubHTTPError as error:
        raise ValueError(f"{key}: {repo_type} {repo_id!r}: the hub answered {error}; fetch it with `{fetch}`") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


@functools.lru_cache(maxsize=None)
def resolve_model(value: str, key: str) -> str:
    """A Hugging Face checkpoint folder: ``value`` itself, or the hub id's snapshot in the cache (resolved once
    per process: the start-up checks and the build read the same folder)."""
    from reflow.model.recipe import resolve_path

    if not is_hub_id(value):
        return resolve_path(value)
    return _snapshot(value, "model", key, MODEL_FILES)


def is_dataset_spec(value: str) -> bool:
    """``org/name:split``, not an existing file."""
    repo, _, split = value.rpartition(":")
    return bool(split) and is_hub_id(repo)


def dataset_files(value: str, key: str) -> list[str]:
    """The data files of split ``value``'s split (``org/name:split``) in the cached snapshot, in name order."""
    repo, _, split = value.rpartition(":")
    root = _snapshot(repo, "dataset", key)
    named = re.compile(rf"^{re.escape(split)}([-_.].*)?$")
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            ext = next((ext for ext in DATA_EXTENSIONS if name.endswith(ext)), None)
            if ext is not None and named.match(name[: -len(ext)]):
                found.append(os.path.join(folder, name))
    if not found:
        raise ValueError(f"{key}: dataset {repo!r} has no data files for split {split!r} (looked for {split}-*.parquet, "
                         f"{split}.jsonl and the like under {root})")
    kinds = {os.path.splitext(path)[1] for path in found}
    if len(kinds) > 1:
        raise ValueError(f"{key}: dataset {repo!r} split {split!r} mixes {', '.join(sorted(kinds))} files")
    return sorted(found)


def dataset_rows(value: str, key: str) -> list[dict]:
    """Every row of ``org/name:split``, read with ``datasets``."""
    import datasets

    files = dataset_files(value, key)
    builder = "parquet" if files[0].endswith(".parquet") else "json"
    table = datasets.load_dataset(builder, data_files={"rows": files}, split="rows")
    return list(table)
