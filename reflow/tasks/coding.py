"""coding_agent: an APPS-style agent that writes a program, reads its test failures, and revises.

    prompt       the problem statement, with instructions
    model        "<code>\\n...program...\\n</code>"            generation stops at "</code>"
    environment  "<feedback>\\npassed 1 of 3 tests\\ntest 2: input ... expected ... got ...\\n</feedback>\\n"
    model        "<code>\\n...revised program...\\n</code>"    ... up to task.max_turns programs are tested

Each program runs once per test in ``reflow.envs.sandbox`` with the test's input on stdin; a test passes
when the output matches the expected one line by line (trailing whitespace aside). A problem with
call-based tests (APPS ``fn_name``) runs the program with a harness that calls the function (or the
``Solution`` method) on the test's JSON arguments and prints the result as JSON; the test passes when it
equals the expected result (or the one value an APPS result list wraps). When every test
passes, the environment ends the trajectory. The reward is the fraction of tests the last program passes
(0 without a program). Results are cached per problem and program, so the reward does not run again the
tests the environment just ran.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass

from reflow.envs.sandbox import Sandbox, SandboxResult
from reflow.tasks.base import Problem, with_instructions
from reflow.tasks.retool import unfenced

INSTRUCTIONS = (
    "Write a Python 3 program that reads the input from standard input and prints the answer. "
    "Put the whole program between <code> and </code>. It will be run on tests, and you will see the "
    "failures; you may then write a corrected program the same way."
)


ANY_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)


def last_program(transcript: str) -> str | None:
    """The last ``<code>...</code>`` block anywhere in the transcript (a Markdown fence inside is removed)."""
    blocks = list(ANY_CODE.finditer(transcript))
    return unfenced(blocks[-1].group(1)) if blocks else None


@dataclass(frozen=True)
class TestReport:
    passed: int
    total: int
    first_failure: str
    """What the agent is shown about the first failing test ("" when all passed)."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def outputs_match(got: str, expected: str) -> bool:
    strip = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
    return strip(got) == strip(expected)


CALL_HARNESS = """

import json as _json, sys as _sys
_function = globals().get({name!r}) or getattr(globals()["Solution"](), {name!r})
_result = _function(*_json.loads(_sys.stdin.read()))
print(_json.dumps(_result))
"""
"""Appended to a program with call-based tests: call the function on the JSON arguments, print the result."""


def results_match(got: str, expected: str) -> bool:
    try:
        value = json.loads(got.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    want = json.loads(expected)
    return value == want or (isinstance(want, list) and len(want) == 1 and value == want[0])


class TestRunner:
    """The environment: runs the program that ended the model's turn on the problem's tests."""

    stop = ("</code>",)

    def __init__(self, sandbox: Sandbox, max_turns: int = 4, shown_chars: int = 300):
        self.sandbox = sandbox
        self.max_turns = max_turns
        self.shown_chars = shown_chars
        self._cache: dict[tuple[str, str], TestReport] = {}
        self._lock = threading.Lock()

    def run_tests(self, problem: Problem, program: str) -> TestReport:
        key = (problem.uid, hashlib.sha256(repr((program, problem.tests, problem.entry_point)).encode()).hexdigest())
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        passed, first_failure = 0, ""
        code = program + CALL_HARNESS.format(name=problem.entry_point) if problem.entry_point else program
        match = results_match if problem.entry_point else outputs_match
        for index, (stdin, expected) in enumerate(problem.tests):
            result: SandboxResult = self.sandbox.run(code, stdin=stdin)
            if result.ok and match(result.stdout, expected):
                passed += 1
            elif not first_failure:
                got = result.stdout if result.ok else result.message(self.shown_chars)
                first_failure = failure_line(index, stdin, expected, got, self.shown_chars)
        report = TestReport(passed, len(problem.tests), first_failure)
        with self._lock:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = report
        return report

    def respond(self, problem: Problem, transcript: str) -> str | None:
        program = last_program(transcript)
        if program is None:
            return "<feedback>\nno program between <code> and </code>\n</feedback>\n"
        report = self.run_tests(problem, program)
        if report.passed == report.total:
            return None  # solved: the trajectory ends here
        return feedback(report)


def feedback(report: TestReport) -> str:
    """The environment's answer to a program that failed a test."""
    return f"<feedback>\npassed {report.passed} of {report.total} tests\n{report.first_failure}\n</feedback>\n"


def failure_line(index: int, stdin: str, expected: str, got: str, limit: int = 300) -> str:
    return f"test {index + 1}: input {_clip(stdin, limit)!r}, expected {_clip(expected, limit)!r}, got {_clip(got, limit)!r}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class CodingAgentTask:
    name = "coding_agent"

    def __init__(self, sandbox: Sandbox, max_turns: int = 4, instructions: str = ""):
        self.environment = TestRunner(sandbox, max_turns)
        self.instructions = instructions or INSTRUCTIONS

    def format_prompt(self, problem: Problem) -> str | list[dict]:
        return with_instructions(self.instructions, problem)

    def reward(self, problem: Problem, completion: str) -> float:
        program = last_program(completion)
        if program is None or not problem.tests:
            return 0.0
        return self.environment.run_tests(problem, program).fraction
