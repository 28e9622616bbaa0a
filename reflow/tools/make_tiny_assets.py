"""Regenerate assets/: the tiny tokenizer, the chain_sum data and a warm-started tiny Qwen3.

    python -m reflow.tools.make_tiny_assets [--out assets] [--seed 0]

Deterministic for a given seed (single-threaded CPU math). Steps:
1. a character-level tokenizer (``tokenizers`` WordLevel, one token per char), with a small chat
   template (``<|role|>content`` lines, then ``<|assistant|>``) for the layouts whose prompts are chat
   messages;
2. chain_sum JSONL files: train (RL prompts), eval (held out) and sft;
3. a Qwen3-architecture model (head_dim 32, which vLLM's CPU attention
   accepts), trained by a supervised run on the sft split whose answer digits
   are corrupted with probability ``--digit-noise``. The model learns the
   arithmetic (its greedy answer is mostly right) but keeps a calibrated
   ``digit-noise`` share of probability on wrong digits, so its sampled
   (temperature 1) reward starts well above 0 and well below the ceiling:
   the situation RL post-training meets in practice (pass@k >> pass@1).
   Training runs ``--sft-steps`` steps with a cosine learning-rate decay;
4. the model is then made deliberately under-confident: the output head is
   scaled down (the same as sampling the SFT model at a higher temperature)
   until its sampled reward falls to ``--target-reward``. The greedy answers
   do not change, so RL has a known headroom to recover;
5. everything saved in Hugging Face format (safetensors), which both the
   trainer (through torchtitan's Qwen3 state-dict adapter) and vLLM load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

from reflow.tasks.chain_sum import ChainSumSpec, ChainSumTask, generate, generate_drifting, write_jsonl

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 128

LONG_TAIL = ChainSumSpec(min_terms=2, max_terms=40, tail_p=0.2)
DRIFT_START, DRIFT_END = ChainSumSpec(min_terms=2, max_terms=4, tail_p=0.5), ChainSumSpec(min_terms=12, max_terms=40, tail_p=0.05)


def write_drift_data(data_dir: str, seed: int, num: int = 1536) -> None:
    """The drifting workload (read in order): short chains first, long-tailed long ones at the end."""
    write_jsonl(generate_drifting(num, seed + 5, DRIFT_START, DRIFT_END), os.path.join(data_dir, "chain_sum_drift_train.jsonl"))

TINY_ARCH = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=1000000.0,
)


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: str):
    """A char-level tokenizer saved as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    assert len(vocab) <= VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIALS[PAD_ID], bos_token=SPECIALS[BOS_ID], eos_token=SPECIALS[EOS_ID]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


@torch.no_grad()
def sampled_reward(model, tok, problems, max_new_tokens: int, gen: torch.Generator, greedy: bool = False) -> float:
    """Mean chain_sum reward of one temperature-1 sample (or the greedy completion) per problem."""
    task = ChainSumTask()
    model.eval()
    prompts = [[BOS_ID] + encode(tok, p.prompt) for p in problems]
    total = 0.0
    for i in range(0, len(prompts), 64):
        chunk = prompts[i : i + 64]
        width = max(map(len, chunk))
        # left-pad so every row generates at the same position
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in chunk])
        att = (ids != PAD_ID).long()
        done = torch.zeros(len(chunk), dtype=torch.bool)
        outs: list[list[int]] = [[] for _ in chunk]
        for _ in range(max_new_tokens):
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -1]
            if greedy:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).squeeze(-1)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    if t == EOS_ID:
                        done[j] = True
                    else:
                        outs[j].append(t)
            if done.all():
                break
            ids = torch.cat([ids, nxt[:, None]], 1)
            att = torch.cat([att, torch.ones_like(nxt)[:, None]], 1)
        for j, p in enumerate(problems[i : i + 64]):
            total += task.reward(p, tok.decode(outs[j]))
    model.train()
    return total / len(problems)


def corrupt(answer: str, rng: random.Random, noise: float) -> str:
    """Replace each digit by a random one with probability ``noise``."""
    return "".join(str(rng.randrange(10)) if c.isdigit() and rng.random() < noise else c for c in answer)


def sft_batch(tok, problems, rng: random.Random, batch: int, noise: float):
    rows = [problems[rng.randrange(len(problems))] for _ in range(batch)]
    seqs, masks = [], []
    for p in rows:
        prompt = [BOS_ID] + encode(tok, p.prompt)
        answer = encode(tok, corrupt(p.answer, rng, noise)) + [EOS_ID]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    return ids, loss_mask


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=4096)
    ap.add_argument("--num-eval", type=int, default=512)
    ap.add_argument("--num-sft", type=int, default=8192)
    ap.add_argument("--digit-noise", type=float, default=0.1)
    ap.add_argument("--sft-steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--target-reward", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = os.path.join(args.out, "tiny-qwen3")
    data_dir = os.path.join(args.out, "data")
    os.makedirs(model_dir, exist_ok=True)
    tok = build_tokenizer(model_dir)

    spec = ChainSumSpec()
    write_jsonl(generate(args.num_train, args.seed + 1, spec, "train"), os.path.join(data_dir, "chain_sum_train.jsonl"))
    eval_set = generate(args.num_eval, args.seed + 2, spec, "eval")
    write_jsonl(eval_set, os.path.join(data_dir, "chain_sum_eval.jsonl"))
    sft_set = generate(args.num_sft, args.seed + 3, spec, "sft")
    # the benchmark workload: same task, a much longer tail of chain lengths (rollout-bound, like reasoning RL)
    write_jsonl(generate(args.num_train, args.seed + 4, LONG_TAIL, "long"), os.path.join(data_dir, "chain_sum_long_train.jsonl"))
    write_drift_data(data_dir, args.seed)

    cfg = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
        **TINY_ARCH,
    )
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    probe = eval_set[:128]
    history = []
    t0 = time.time()
    greedy = sampled = 0.0
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.sft_steps) / args.sft_steps)) * 0.95 + 0.05
    )
    for step in range(1, args.sft_steps + 1):
        ids, loss_mask = sft_batch(tok, sft_set, rng, 64, args.digit_noise)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB_SIZE).float(), ids[:, 1:].reshape(-1), reduction="none"
        ).view_as(loss_mask[:, 1:])
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % args.eval_every == 0 or step == args.sft_steps:
            greedy = sampled_reward(model, tok, probe, 48, gen, greedy=True)
            sampled = sampled_reward(model, tok, probe, 48, gen)
            history.append({"step": step, "loss": round(loss.item(), 4), "greedy_reward": greedy, "sampled_reward": sampled})
            print(f"sft step {step} loss {loss.item():.4f} greedy {greedy:.3f} sampled {sampled:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    # 4. under-confident warm start: scale the output head down until the sampled reward is at the target
    head = model.lm_head.weight
    original = head.detach().clone()
    scale = 1.0
    for candidate in [1.0 - 0.05 * k for k in range(0, 15)]:
        with torch.no_grad():
            head.copy_(original * candidate)
        sampled = sampled_reward(model, tok, probe, 48, torch.Generator().manual_seed(args.seed))
        history.append({"head_scale": round(candidate, 2), "sampled_reward": sampled})
        print(f"head scale {candidate:.2f}: sampled reward {sampled:.3f}", flush=True)
        scale = candidate
        if sampled <= args.target_reward:
            break
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(model_dir, safe_serialization=True)
    with open(os.path.join(model_dir, "reflow_sft.json"), "w") as f:
        json.dump({"args": vars(args), "history": history}, f, indent=1)
    print(f"wrote {model_dir} and {data_dir}; greedy reward {greedy:.3f}, head scale {scale:.2f}, sampled reward {sampled:.3f}")


if __name__ == "__main__":
    main()
