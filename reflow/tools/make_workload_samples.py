"""Write the small workload samples in ``assets/data`` in the layouts real datasets ship in.

    python -m reflow.tools.make_workload_samples [--out assets/data]

  math_sample.parquet   verl's RL layout (data_source, prompt as chat messages, ability,
                        reward_model.ground_truth, extra_info), as DAPO-Math-17K and GSM8K are
                        usually shipped; read by the math and retool tasks
  apps_sample.jsonl     the APPS layout (problem_id, question, input_output and solutions as JSON
                        strings, starter_code, difficulty); read by the coding_agent task

The problems are written for ReFlow (no dataset is downloaded, at build or at run time), each with the
reference answer or solution its tests score against.
"""

from __future__ import annotations

import argparse
import json
import os

BOXED = " Reason step by step, then give the final answer in \\boxed{}."

MATH_PROBLEMS = [
    # (data_source, problem, answer)
    ("sample/gsm8k", "A baker fills 7 trays with 12 muffins each and keeps 9 muffins for herself. How many muffins does "
                     "she sell?", "75"),
    ("sample/dapo-math", "What is the remainder when $2^{10}$ is divided by $7$?", "2"),
    ("sample/dapo-math", "Find the sum of all positive divisors of $36$.", "91"),
    ("sample/gsm8k", "Tom has 3 times as many marbles as Ann, and together they have 48. How many marbles does Tom have?", "36"),
    ("sample/gsm8k", "A rectangle has a perimeter of 30 cm and a length of 9 cm. What is its area in square centimetres?", "54"),
    ("sample/dapo-math", "In how many ways can 5 different books be arranged on a shelf?", "120"),
    ("sample/dapo-math", "Compute $\\frac{3}{4} + \\frac{5}{6}$.", "\\frac{19}{12}"),
    ("sample/dapo-math", "What is the smallest positive integer $n$ such that $n!$ is divisible by $1000$?", "15"),
]

APPS_PROBLEMS = [
    {
        "question": "Read two integers a and b from one line and print their sum.",
        "tests": [("1 2\n", "3\n"), ("-5 10\n", "5\n"), ("100 200\n", "300\n")],
        "solution": "a, b = map(int, input().split())\nprint(a + b)\n",
    },
    {
        "question": "The first line holds n. The second line holds n integers. Print the largest of them.",
        "tests": [("3\n1 7 4\n", "7\n"), ("1\n-3\n", "-3\n"), ("5\n2 2 9 9 1\n", "9\n"), ("4\n-1 -8 -2 -5\n", "-1\n")],
        "solution": "n = int(input())\nprint(max(map(int, input().split()[:n])))\n",
    },
    {
        "question": "Read a word. Print YES if it reads the same backwards, and NO otherwise.",
        "tests": [("level\n", "YES\n"), ("reflow\n", "NO\n"), ("a\n", "YES\n"), ("abca\n", "NO\n")],
        "solution": "w = input().strip()\nprint('YES' if w == w[::-1] else 'NO')\n",
    },
    {
        "question": "Read n and print the first n lines of FizzBuzz: Fizz for multiples of 3, Buzz for multiples of 5, "
                    "FizzBuzz for both, the number otherwise.",
        "tests": [("5\n", "1\n2\nFizz\n4\nBuzz\n"),
                  ("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n")],
        "solution": "n = int(input())\nfor i in range(1, n + 1):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
                    "else 'Buzz' if i % 5 == 0 else i)\n",
    },
]


def math_rows() -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": problem + BOXED}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index},
        }
        for index, (source, problem, answer) in enumerate(MATH_PROBLEMS)
    ]


def apps_rows() -> list[dict]:
    return [
        {
            "problem_id": index,
            "question": problem["question"],
            "input_output": json.dumps({"inputs": [i for i, _ in problem["tests"]], "outputs": [o for _, o in problem["tests"]]}),
            "solutions": json.dumps([problem["solution"]]),
            "starter_code": "",
            "difficulty": "introductory",
        }
        for index, problem in enumerate(APPS_PROBLEMS)
    ]


def main(argv: list[str] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/data")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(math_rows()), os.path.join(args.out, "math_sample.parquet"))
    with open(os.path.join(args.out, "apps_sample.jsonl"), "w", encoding="utf-8") as f:
        for row in apps_rows():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.out}/math_sample.parquet ({len(MATH_PROBLEMS)} rows) and "
          f"{args.out}/apps_sample.jsonl ({len(APPS_PROBLEMS)} rows)")


if __name__ == "__main__":
    main()
