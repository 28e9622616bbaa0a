"""The real environments on their shipped samples, with scripted completions: a reference answer or program
scores 1, a wrong one 0 (or the fraction of tests it passes), a hostile one is contained and scores 0. And
the community data layouts, with errors that name the file, the row and the field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reflow.config.job_config import TaskSection
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.tasks import build_task, load_problems
from reflow.tasks.base import Problem
from reflow.tasks.calculator import Calculator, evaluate
from reflow.tools.make_workload_samples import APPS_PROBLEMS, MATH_PROBLEMS
from tests.conftest import ROOT, TINY_HF, require_kernel_sandbox

MATH_FILE = f"{ROOT}/assets/data/math_sample.parquet"
APPS_FILE = f"{ROOT}/assets/data/apps_sample.jsonl"
SANDBOX = dict(sandbox_wall_s=4.0, sandbox_cpu_s=2.0, sandbox_memory_mb=512)


@pytest.fixture(scope="module")
def math_problems():
    return load_problems(MATH_FILE)


@pytest.fixture(scope="module")
def apps_problems():
    return load_problems(APPS_FILE)


# ---- data layouts ------------------------------------------------------------------------------------

def test_shipped_samples_load_in_their_layouts(math_problems, apps_problems):
    assert len(math_problems) == len(MATH_PROBLEMS) and len(apps_problems) == len(APPS_PROBLEMS)
    first = math_problems[0]
    assert first.uid == "sample/gsm8k-0" and first.source == "sample/gsm8k" and first.answer == "75"
    assert first.messages[0]["role"] == "user" and first.prompt == first.messages[-1]["content"]
    assert apps_problems[0].uid == "apps-0" and apps_problems[0].tests[0] == ("1 2\n", "3\n")


def test_chat_rows_use_the_chat_template(math_problems):
    tokenizer = PromptTokenizer(TINY_HF)
    text = tokenizer.decode(tokenizer.encode_prompt(list(math_problems[1].messages)))
    assert text == f"<|user|>{math_problems[1].prompt}\n<|assistant|>"
    chat = PromptTokenizer(TINY_HF, chat=True)  # task.chat: a text prompt becomes a user message
    assert chat.decode(chat.encode_prompt("2+2=")) == "<|user|>2+2=\n<|assistant|>"


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


GOOD_VERL = {"data_source": "d", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}


@pytest.mark.parametrize("change,message", [
    ({"prompt": []}, "row 1: field 'prompt' must be a non-empty list of chat messages"),
    ({"prompt": [{"role": "user", "content": "  "}]}, "row 1: field 'prompt'[0] is an empty user message"),
    ({"prompt": [{"role": "system", "content": "be brief"}]}, "row 1: field 'prompt' has no user message"),
    ({"reward_model": {"style": "rule", "ground_truth": ""}}, "row 1: field 'reward_model.ground_truth' is empty"),
    ({"reward_model": None}, "row 1: field 'reward_model.ground_truth' is missing"),
])
def test_malformed_verl_rows_name_file_row_and_field(tmp_path, change, message):
    bad = dict(GOOD_VERL, **change)
    path = _write_parquet(tmp_path / "data.parquet", [GOOD_VERL, bad])
    with pytest.raises(ValueError, match="task.train_file") as err:
        load_problems(path)
    assert f"{path} {message}" in str(err.value)


def _apps(**change):
    row = {"problem_id": 7, "question": "Print 1.", "input_output": json.dumps({"inputs": [""], "outputs": ["1\n"]}),
           "solutions": json.dumps(["print(1)"]), "starter_code": "", "difficulty": "introductory"}
    return json.dumps(dict(row, **change))


@pytest.mark.parametrize("change,message", [
    ({"question": ""}, "field 'question' must be a non-empty string"),
    ({"input_output": "{not json"}, "field 'input_output' is a string that is not JSON"),
    ({"input_output": json.dumps({"inputs": ["1"], "outputs": []})}, "needs as many outputs as inputs"),
    ({"input_output": json.dumps({"fn_name": "f(x)", "inputs": [[1]], "outputs": [1]})},
     "'input_output.fn_name' must be a Python name"),
    ({"input_output": json.dumps({"fn_name": "f", "inputs": ["1"], "outputs": [1]})},
     "call-based inputs must be a list of arguments"),
])
def test_malformed_apps_rows_name_file_line_and_field(tmp_path, change, message):
    path = tmp_path / "apps.jsonl"
    path.write_text(_apps() + "\n" + _apps(**change) + "\n")
    with pytest.raises(ValueError) as err:
        load_problems(str(path), "task.eval_file")
    assert str(err.value).startswith(f"task.eval_file: {path}:2: ") and message in str(err.value), str(err.value)


def test_not_parquet_is_named(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("hello")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        load_problems(str(path))


# ---- math (single turn) --------------------------------------------------------------------------------

def test_math_sample_scripted_completions(math_problems):
    task = build_task(TaskSection(name="math", reward_timeout_s=5.0))
    try:
        for problem in math_problems:
            assert task.reward(problem, f"Working it out... the answer is \\boxed{{{problem.answer}}}.") == 1.0, problem.uid
            assert task.reward(problem, "Working it out... the answer is \\boxed{1001}.") == 0.0, problem.uid
    finally:
        task.verifier.close()


# ---- retool: math with a sandboxed interpreter ----------------------------------------------------------

@pytest.fixture(scope="module")
def retool():
    require_kernel_sandbox()
    task = build_task(TaskSection(name="retool", max_turns=3, **SANDBOX))
    yield task
    task.verifier.close()


def test_retool_interpreter_and_reward(retool, math_problems):
    problem = math_problems[1]  # 2^10 mod 7
    env = retool.environment
    assert env.stop == ("</code>",) and env.max_turns == 3
    prompt = retool.format_prompt(problem)
    assert prompt[0]["role"] == "system" and "<code>" in prompt[0]["content"] and prompt[1:] == list(problem.messages)
    turn = "Let me compute it.\n<code>\n```python\nprint(2**10 % 7)\n```\n</code>"
    answer = env.respond(problem, turn)
    assert answer == "<interpreter>\n2\n</interpreter>\n"
    transcript = turn + answer + "So the remainder is \\boxed{2}."
    assert retool.reward(problem, transcript) == 1.0  # the reference
    assert retool.reward(problem, turn + answer + "So the remainder is \\boxed{3}.") == 0.0  # a wrong conclusion
    # a boxed answer the code printed is not the model's answer
    printed = "<code>\nprint('\\\\boxed{2}')\n</code>"
    assert retool.reward(problem, printed + env.respond(problem, printed) + "I am not sure.") == 0.0
    # a second call runs its own block
    second = transcript + "\nChecking: <code>\nprint(1024 - 7 * 146)\n</code>"
    assert env.respond(problem, second) == "<interpreter>\n2\n</interpreter>\n"
    # broken code: the error comes back as the interpreter's output
    assert "ZeroDivisionError" in env.respond(problem, "<code>\n1/0\n</code>")


@pytest.mark.parametrize("code,says", [
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "sandbox: signalling"),
    ("while True:\n    pass", "time limit exceeded (CPU)"),
    ("print(open('/etc/shadow').read())", "sandbox: reading '/etc/shadow'"),
])
def test_retool_hostile_code_is_contained(retool, math_problems, code, says):
    answer = retool.environment.respond(math_problems[0], f"<code>\n{code}\n</code>")
    assert answer.startswith("<interpreter>\n") and says in answer, answer
    assert retool.reward(math_problems[0], f"<code>\n{code}\n</code>" + answer) == 0.0


# ---- coding agent ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def coding():
    require_kernel_sandbox()
    return build_task(TaskSection(name="coding_agent", max_turns=3, **SANDBOX))


def test_coding_agent_reference_solutions_pass(coding, apps_problems):
    for problem in apps_problems:
        transcript = f"<code>\n{problem.answer}</code>"
        assert coding.environment.respond(problem, transcript) is None, problem.uid  # solved: the trajectory ends
        assert coding.reward(problem, transcript) == 1.0, problem.uid


def test_coding_agent_call_based_tests(coding, tmp_path):
    # APPS call-based rows: fn_name, the arguments as a list, the result (often wrapped in a one-element list)
    path = tmp_path / "apps.jsonl"
    path.write_text(_apps(input_output=json.dumps({"fn_name": "add", "inputs": [[1, 2], [5, -5]], "outputs": [[3], [0]]})) + "\n")
    problem = load_problems(str(path))[0]
    assert problem.entry_point == "add"
    assert coding.reward(problem, "<code>\ndef add(a, b):\n    return a + b\n</code>") == 1.0
    assert coding.reward(problem, "<code>\nclass Solution:\n    def add(self, a, b):\n        return a + b\n</code>") == 1.0
    assert coding.reward(problem, "<code>\ndef add(a, b):\n    return a + b if a < 5 else 1\n</code>") == 0.5


def test_coding_agent_feedback_and_revision(coding, apps_problems):
    problem = apps_problems[1]  # the maximum of n integers; 4 tests, two of them all negative
    wrong = "<code>\nn = int(input())\nprint(max(0, *map(int, input().split())))\n</code>"
    feedback = coding.environment.respond(problem, wrong)
    assert feedback.startswith("<feedback>\npassed 2 of 4 tests\ntest 2: input '1\\n-3\\n', expected '-3\\n', got '0\\n'")
    assert coding.reward(problem, wrong) == 0.5  # the fraction of tests passed
    revised = wrong + feedback + f"<code>\n{problem.answer}</code>"
    assert coding.environment.respond(problem, revised) is None and coding.reward(problem, revised) == 1.0
    assert coding.reward(problem, "I cannot write this program.") == 0.0


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",
    "print(open('/etc/shadow').read())",
    "import time\ntime.sleep(60)",
])
def test_coding_agent_hostile_program_scores_zero(coding, apps_problems, code):
    if "sleep" in code:  # the wall-clock limit ends it: a short one (each of the 3 tests waits it out)
        coding = build_task(TaskSection(name="coding_agent", max_turns=3, **{**SANDBOX, "sandbox_wall_s": 1.0}))
    transcript = f"<code>\n{code}\n</code>"
    feedback = coding.environment.respond(apps_problems[0], transcript)
    assert feedback.startswith("<feedback>\npassed 0 of 3 tests")
    assert coding.reward(apps_problems[0], transcript) == 0.0


# ---- the tiny variants' rewards ----------------------------------------------------------------------------

def test_calculator_evaluates_arithmetic_only():
    assert evaluate("3+5+2+8") == 18 and evaluate("2*(3-10)") == -14
    for bad in ("__import__('os')", "2**99999999", "x+1", "1/0", "9" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)
    env = Calculator(max_turns=2)
    problem = Problem("p", "3+5+2+8=", "8,10,18")
    assert env.respond(problem, "<calc>3+5+2+8</calc>") == "<result>18</result>\n"
    assert env.respond(problem, "<calc>open('x')</calc>").startswith("<result>error:")
    # a later call is answered for itself, not for the text since the first one
    assert env.respond(problem, "<calc>1+2</calc><result>3</result>\n<calc>3+4</calc>") == "<result>7</result>\n"


def test_boxed_and_calculator_rewards():
    problem = Problem("p", "3+5+2+8=", "8,10,18")
    boxed = build_task(TaskSection(name="chain_sum_boxed"))
    calculator = build_task(TaskSection(name="chain_sum_calculator"))
    try:
        assert boxed.format_prompt(problem) == "Box: 3+5+2+8="
        assert boxed.reward(problem, "8,10,18\n\\boxed{18}") == 1.0
        assert boxed.reward(problem, "8,10,17\n\\boxed{17}") == 0.0
        assert boxed.reward(problem, "8,10,18") == 0.0  # no box: the format is part of the task
        assert calculator.format_prompt(problem) == "Calc: 3+5+2+8="
        assert calculator.reward(problem, "<calc>3+5+2+8</calc><result>18</result>\n\\boxed{18}") == 1.0
        assert calculator.reward(problem, "<calc>3+5+2+9</calc><result>19</result>\n\\boxed{19}") == 0.0
    finally:
        boxed.verifier.close()
        calculator.verifier.close()
