"""Prompt datasets: local JSONL or Parquet files, in the layouts the community ships them in.

    load_problems(path, key) -> list[Problem]        the layout is read off each row; ``path`` may be a hub
                                                     dataset's split, ``org/name:split`` (``reflow.hub``)

Layouts:
  reflow   {"id", "prompt": str, "answer"}                            (assets/data/chain_sum_*.jsonl)
  verl     {"data_source", "prompt": [{"role", "content"}, ...], "ability",
            "reward_model": {"ground_truth", "style"}, "extra_info": {"index", ...}}
           verl's RL layout, in which DAPO-Math-17K and GSM8K are usually shipped (Parquet); the
           messages are rendered with the tokenizer's chat template
  apps     {"problem_id", "question", "input_output": {"inputs": [...], "outputs": [...], "fn_name"?},
            "solutions": [...], "starter_code", "difficulty"}
           APPS; ``input_output`` and ``solutions`` may be JSON strings, as in the released files.
           Standard-input tests, or with ``fn_name`` call-based ones (the arguments and the result as JSON)

A row that fits no layout, or misses a field of its layout, is one error naming the config key, the file,
the row ("file:line" in JSONL, "file row N" in Parquet) and the field: a bad row never becomes an empty prompt.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from reflow.tasks.base import Problem


class RowError(ValueError):
    pass


def load_problems(path: str, key: str = "task.train_file") -> list[Problem]:
    """A local JSONL or Parquet file, or a hub dataset's split, ``org/name:split`` (``reflow.hub``)."""
    from reflow.hub import dataset_rows, is_dataset_spec

    if is_dataset_spec(path):
        rows: Iterator[tuple[str, int, Any]] = ((f"{path} row {i}", i, row) for i, row in enumerate(dataset_rows(path, key)))
    else:
        if os.path.isdir(path):
            raise ValueError(f"{key}: {path} is a folder, not a JSONL or Parquet file")
        if not os.path.exists(path):
            raise ValueError(f"{key}: task data file not found: {path} (nor a hub dataset: org/name:split)")
        rows = (_parquet_rows if path.endswith(".parquet") else _jsonl_rows)(path, key)
    problems = []
    for where, row_id, row in rows:
        try:
            problems.append(parse_row(row, default_id=f"{os.path.basename(path)}:{row_id}"))
        except RowError as e:
            raise ValueError(f"{key}: {where}: {e}") from None
    if not problems:
        raise ValueError(f"{key}: task data file is empty: {path}")
    return problems


def _jsonl_rows(path: str, key: str) -> Iterator[tuple[str, int, Any]]:
    """(where, line number, row) per non-blank line; where is "path:line"."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{key}: {where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{key}: {where}: not a JSON object ({e.msg})") from None
            yield where, lineno, row


def _parquet_rows(path: str, key: str) -> Iterator[tuple[str, int, Any]]:
    """(where, row index, row) per row; where is "path row N"."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
        raise ValueError(f"{key}: {path}: not a readable Parquet file ({e})") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"{path} row {index}", index, row


def parse_row(row: Any, default_id: str) -> Problem:
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object (a reflow, verl or APPS row), got {type(row).__name__}")
    if "question" in row or "input_output" in row:
        return _apps_row(row)
    if isinstance(row.get("prompt"), list) or "reward_model" in row:
        return _verl_row(row, default_id)
    return _reflow_row(row, default_id)


def _reflow_row(row: dict, default_id: str) -> Problem:
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowError(f"row has no prompt (field 'prompt' must be a non-empty string, got {prompt!r})")
    if "answer" not in row:
        raise RowError("row has no 'answer' field")
    return Problem(uid=str(row.get("id", default_id)), prompt=prompt, answer=str(row["answer"]))


def _verl_row(row: dict, default_id: str) -> Problem:
    messages = row.get("prompt")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"field 'prompt' must be a non-empty list of chat messages, got {messages!r}")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict) or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RowError(f"field 'prompt'[{i}] must be a message {{'role': str, 'content': str}}, got {message!r}")
        if message["role"] == "user" and not message["content"].strip():
            raise RowError(f"field 'prompt'[{i}] is an empty user message")
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise RowError("field 'prompt' has no user message")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise RowError(f"field 'reward_model.ground_truth' is missing (reward_model = {reward_model!r})")
    truth = reward_model["ground_truth"]
    if isinstance(truth, (list, tuple)):
        truth = truth[0] if len(truth) == 1 else ", ".join(map(str, truth))
    if truth is None or not str(truth).strip():
        raise RowError(f"field 'reward_model.ground_truth' is empty ({truth!r})")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    source = str(row.get("data_source") or "")
    uid = f"{source}-{extra['index']}" if source and "index" in extra else str(row.get("id", default_id))
    return Problem(
        uid=uid, prompt=users[-1], answer=str(truth),
        messages=tuple({"role": m["role"], "content": m["content"]} for m in messages), source=source,
    )


def _json_field(row: dict, name: str) -> Any:
    value = row.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise RowError(f"field {name!r} is a string that is not JSON ({e.msg})") from None
    return value


def _apps_row(row: dict) -> Problem:
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise RowError(f"field 'question' must be a non-empty string, got {question!r}")
    tests = _json_field(row, "input_output")
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) or not isinstance(tests.get("outputs"), list):
        raise RowError("field 'input_output' must hold {'inputs': [...], 'outputs': [...]}")
    entry_point = tests.get("fn_name") or ""
    if not isinstance(entry_point, str) or (entry_point and not entry_point.isidentifier()):
        raise RowError(f"field 'input_output.fn_name' must be a Python name, got {entry_point!r}")
    if not tests["inputs"] or len(tests["inputs"]) != len(tests["outputs"]):
        raise RowError(f"field 'input_output' needs as many outputs as inputs, at least one "
                       f"(got {len(tests['inputs'])} and {len(tests['outputs'])})")
    pairs = []
    for i, (stdin, stdout) in enumerate(zip(tests["inputs"], tests["outputs"])):
        if entry_point:  # call-based: the arguments and the expected result, as JSON
            if not isinstance(stdin, list):
                raise RowError(f"field 'input_output' test {i}: call-based inputs must be a list of arguments, "
                               f"got {type(stdin).__name__}")
            pairs.append((json.dumps(stdin), json.dumps(stdout)))
            continue
        if isinstance(stdin, list):
            stdin = "\n".join(map(str, stdin))
        if isinstance(stdout, list):
            stdout = "\n".join(map(str, stdout))
        if not isinstance(stdin, str) or not isinstance(stdout, str):
            raise RowError(f"field 'input_output' test {i}: input and output must be text, "
                           f"got {type(stdin).__name__}, {type(stdout).__name__}")
        pairs.append((stdin, stdout))
    solutions = _json_field(row, "solutions") or []
    if not isinstance(solutions, list):
        raise RowError(f"field 'solutions' must be a list of programs, got {type(solutions).__name__}")
    if "problem_id" not in row:
        raise RowError("row has no 'problem_id' field")
    return Problem(
        uid=f"apps-{row['problem_id']}", prompt=question, answer=str(solutions[0]) if solutions else "",
        tests=tuple(pairs), entry_point=entry_point, source="apps",
    )
