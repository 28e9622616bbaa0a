"""The prompt tokenizer every mode, the rollout workers and the turn driver share."""

from __future__ import annotations


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer: encode prompts (BOS first when the tokenizer has one), decode completions."""

    def __init__(self, hf_dir: str, chat: bool = False):
        from transformers import AutoTokenizer

        self.hf_dir = hf_dir
        self.chat = chat
        """task.chat: a text prompt is rendered as a user message with the chat template too."""
        self.tok = AutoTokenizer.from_pretrained(hf_dir)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.bos_id = self.tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self.tok(text, add_special_tokens=True).input_ids
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        """A task's prompt: text as ``encode``, chat messages through the tokenizer's chat template (ending
        with the assistant's opening, so the completion is the assistant's message)."""
        if isinstance(prompt, str):
            if not self.chat:
                return self.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if not self.tok.chat_template:
            raise ValueError(f"the task's prompts are chat messages, but the tokenizer in {self.hf_dir} has no chat template")
        return list(self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens that continue a sequence (an environment's answer inside a response): no BOS, and text that
        spells a special token ("<|im_end|>" printed by sandboxed code) stays text: an environment cannot end
        the turn, or open a new one, by printing the marker."""
        return self.tok(text, add_special_tokens=False, split_special_tokens=True).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
