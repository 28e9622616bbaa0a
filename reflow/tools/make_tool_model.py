"""Regenerate the tiny tool-use assets: the calculator chain_sum data and ``assets/tiny-qwen3-tools``.

    python -m reflow.tools.make_tool_model [--out assets] [--seed 0] [--source assets/tiny-qwen3]

The tiny chain_sum model (``make_tiny_assets``) knows one format. This fine-tunes it, supervised and
deterministically (single-threaded CPU math), on a few demonstrations of two more, so that RL has something
to improve in each (``models/tiny_tools.toml``):

  chain_sum_boxed       "Box: 3+5+2="  ->  "8,10\\n\\boxed{10}"
  chain_sum_calculator  "Calc: 3+5+...="  ->  either the tool path
                            "<calc>3+5+...</calc>" + "<result>N</result>\\n" + "\\boxed{N}"
                        or the direct path, the running sums then the boxed total
  coding_agent          "Code:\\n\\n3+5+2=\\n"  ->  "<code>print(3+5+2)</code>", and in some demonstrations a
                        wrong program first, the test runner's feedback, then a corrected one
                        (the APPS-layout chain_sum_code_*.jsonl files: one test each, the sum on stdout)

plus plain chain_sum, so the old format is kept. Demonstration digits are corrupted with probability
``--digit-noise`` in running sums and ``--copy-noise`` in a chain copied into a call or a program, so the
model keeps a calibrated share of probability on mistakes (answering a long chain directly goes wrong far
more often than copying it into the calculator); a quarter of the calculator demonstrations answer
directly. The environment's text (the calculator's result, the test runner's feedback) is never trained on,
as in RL. Finally the output head is scaled by ``--head-scale`` (sampling at a higher temperature), which
leaves RL a headroom it recovers quickly by sharpening, as with the chain_sum model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

from reflow.tasks.base import with_instructions
from reflow.tasks.calculator import ChainSumCalculatorTask, evaluate
from reflow.tasks.chain_sum import ChainSumBoxedTask, ChainSumSpec, generate, write_jsonl
from reflow.tasks.coding import TestReport, failure_line, feedback
from reflow.tools.make_tiny_assets import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, corrupt, encode

CALC_SPEC = ChainSumSpec(min_terms=4, max_terms=20, tail_p=0.15)
"""Chains long enough that answering directly often goes wrong for the tiny model."""
CODE_INSTRUCTIONS = "Code:"
"""task.instructions of the tiny coding variant (train_configs/tiny_coding.toml)."""


def write_code_problems(problems, path: str) -> None:
    """chain_sum problems in the APPS layout: a program must print the sum (one test, empty input)."""
    with open(path, "w", encoding="utf-8") as f:
        for index, problem in enumerate(problems):
            expression = problem.prompt.rstrip("=")
            f.write(json.dumps({
                "problem_id": f"code-{index}", "question": problem.prompt,
                "input_output": json.dumps({"inputs": [""], "outputs": [f"{evaluate(expression)}\n"]}),
                "solutions": json.dumps([f"print({expression})"]), "starter_code": "", "difficulty": "introductory",
            }) + "\n")


def demonstration(problem, kind: str, rng: random.Random, noise: float, copy_noise: float) -> list[tuple[str, bool]]:
    """(text, trained) segments of one demonstration: the prompt and the environment's answers are not trained.
    ``noise`` corrupts digits the model computes (running sums), ``copy_noise`` digits it copies (a chain into
    a call or a program)."""
    if kind == "plain":
        return [(problem.prompt, False), (corrupt(problem.answer, rng, noise), True)]
    if kind == "boxed":
        sums = corrupt(problem.answer, rng, noise)
        return [(ChainSumBoxedTask.PREFIX + problem.prompt, False), (f"{sums}\n\\boxed{{{sums.split(',')[-1]}}}", True)]
    prompt = ChainSumCalculatorTask.PREFIX + problem.prompt
    if kind == "calc_direct":
        sums = corrupt(problem.answer, rng, noise)
        return [(prompt, False), (f"{sums}\n\\boxed{{{sums.split(',')[-1]}}}", True)]
    if kind in ("code", "code_revised"):
        expression = problem.prompt.rstrip("=")
        total = evaluate(expression)
        if kind == "code":
            return [(with_instructions(CODE_INSTRUCTIONS, problem), False),
                    (f"<code>print({corrupt(expression, rng, copy_noise)})</code>", True)]
        wrong = corrupt(expression, rng, 0.3)
        got = evaluate(wrong)
        if got == total:
            return [(with_instructions(CODE_INSTRUCTIONS, problem), False), (f"<code>print({wrong})</code>", True)]
        report = TestReport(0, 1, failure_line(0, "", f"{total}\n", f"{got}\n"))
        return [(with_instructions(CODE_INSTRUCTIONS, problem), False), (f"<code>print({wrong})</code>", True),
                (feedback(report), False),
                (f"<code>print({corrupt(expression, rng, copy_noise)})</code>", True)]
    assert kind == "calc_tool", kind
    expression = corrupt(problem.prompt.rstrip("="), rng, copy_noise)
    value = evaluate(expression)
    return [(prompt, False), (f"<calc>{expression}</calc>", True), (f"<result>{value}</result>\n", False),
            (f"\\boxed{{{value}}}", True)]


def batch(tok, segments_list: list[list[tuple[str, bool]]]):
    seqs, masks = [], []
    for segments in segments_list:
        ids, mask = [BOS_ID], [0]
        for text, trained in segments:
            piece = encode(tok, text)
            ids += piece
            mask += [int(trained)] * len(piece)
        ids.append(EOS_ID)
        mask.append(1)
        seqs.append(ids)
        masks.append(mask)
    width = max(map(len, seqs))
    return (
        torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs]),
        torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets")
    ap.add_argument("--source", default="", help="the chain_sum model to start from (default: <out>/tiny-qwen3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--digit-noise", type=float, default=0.1)
    ap.add_argument("--copy-noise", type=float, default=0.02)
    ap.add_argument("--head-scale", type=float, default=0.8)
    args = ap.parse_args(argv)

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    source = args.source or os.path.join(args.out, "tiny-qwen3")
    target = os.path.join(args.out, "tiny-qwen3-tools")
    data_dir = os.path.join(args.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(source)
    model = Qwen3ForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    write_jsonl(generate(2048, args.seed + 11, CALC_SPEC, "calc"), os.path.join(data_dir, "chain_sum_calc_train.jsonl"))
    write_jsonl(generate(256, args.seed + 12, CALC_SPEC, "calc-eval"), os.path.join(data_dir, "chain_sum_calc_eval.jsonl"))
    write_code_problems(generate(2048, args.seed + 15, CALC_SPEC, "code"), os.path.join(data_dir, "chain_sum_code_train.jsonl"))
    write_code_problems(generate(256, args.seed + 16, CALC_SPEC, "code-eval"),
                        os.path.join(data_dir, "chain_sum_code_eval.jsonl"))
    short = generate(4096, args.seed + 13, ChainSumSpec(), "tools-sft")
    long = generate(4096, args.seed + 14, CALC_SPEC, "tools-sft-calc")
    # copying a chain (into a call, into a program) is the hard skill for a 4-layer model: it gets the most
    kinds = ["plain"] + ["boxed"] * 2 + ["calc_direct"] + ["calc_tool"] * 3 + ["code"] * 2 + ["code_revised"]

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)) * 0.95 + 0.05
    )
    rng = random.Random(args.seed)
    history, t0 = [], time.time()
    model.train()
    for step in range(1, args.steps + 1):
        rows = []
        for _ in range(args.batch):
            kind = rng.choice(kinds)
            pool = long if kind.startswith("calc") else short
            rows.append(demonstration(pool[rng.randrange(len(pool))], kind, rng, args.digit_noise, args.copy_noise))
        ids, mask = batch(tok, rows)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll.view_as(mask[:, 1:]) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % 100 == 0 or step == args.steps:
            history.append({"step": step, "loss": round(loss.item(), 4)})
            print(f"tool sft step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.head_scale)
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    with open(os.path.join(target, "reflow_sft.json"), "w") as f:
        json.dump({"args": vars(args), "history": history}, f, indent=1)
    print(f"wrote {target} and the calculator data in {data_dir}")


if __name__ == "__main__":
    main()
