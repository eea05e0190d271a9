"""The embedded engine: sampling with the learner's own transformers model, in process.

Weight sync is free (same module). Sequences are decoded in batches with a KV
cache; a sequence that finishes (EOS, stop string or length) leaves the batch,
so the cost of a step falls as the batch empties.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plainrl.types import Generation, SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus; Holtzman et al. 2020) filtering.

    Args:
        logits: [B, V] float32. Filtered-out entries become -inf.
        temperature: > 0 (greedy decoding is handled by the caller).
        top_k: keep the k largest (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off);
            the most likely token is always kept.
    Returns:
        [B, V] processed logits.
    """
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFEngine:
    """Batched sampling with a transformers (or peft-wrapped) causal LM.

    Args:
        model: the learner's model; it is put in eval mode during generation and
            restored afterwards (LoRA dropout off while sampling).
        tokenizer: for EOS/pad ids and for checking stop strings (the decoded text
            is only inspected, never re-tokenised).
        batch_size: sequences decoded together.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def load_weights(self, model: torch.nn.Module) -> None:
        """No-op: the engine samples with the learner's module itself."""
        assert model is self.model, "HFEngine shares the learner's model; nothing to load"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt (repeat a prompt for a group).

        Args:
            prompts: N lists of prompt token ids.
            params: sampling settings; temperature 0 is greedy.
            generator: RNG for sampling (on the model's device) for reproducibility.
        Returns:
            N :class:`Generation` in the order of ``prompts``.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Generation] = []
            for i in range(0, len(prompts), self.batch_size):
                out.extend(self._generate_batch(prompts[i : i + self.batch_size], params, generator))
            return out
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Generation]:
        from transformers import DynamicCache

        dev = self.device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        # Left padding, so every row's next token is written at the same column.
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(p)
            attn[r, width - len(p) :] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        eos_ids = self.eos_ids.to(dev)

        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        active = torch.arange(n, device=dev)  # original row of each live batch row
        stop_window = max((len(s) for s in params.stop), default=0) + 4

        logits = self.model(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1].float()  # [b, V]
        next_pos = position_ids[:, -1:] + 1  # [b, 1]
        for t in range(params.max_new_tokens):
            logprobs = torch.log_softmax(logits, dim=-1)  # [b, V] unmodified policy
            if params.temperature == 0:
                tok = logits.argmax(-1)
            else:
                probs = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [b]
            tok_lp = logprobs.gather(-1, tok[:, None]).squeeze(-1)
            done = torch.isin(tok, eos_ids)
            tok_l, lp_l, done_l = tok.tolist(), tok_lp.tolist(), done.tolist()
            for j, row in enumerate(active.tolist()):
                tokens[row].append(tok_l[j])
                logps[row].append(lp_l[j])
                if done_l[j]:
                    reasons[row] = "eos"
                elif params.stop:
                    tail = self.tokenizer.decode(tokens[row][-stop_window:])
                    if any(s in tail for s in params.stop):
                        reasons[row] = "stop"
                        done_l[j] = True
            if t == params.max_new_tokens - 1:
                break
            keep = [j for j, d in enumerate(done_l) if not d]
            if not keep:
                break
            if len(keep) < len(done_l):  # finished rows leave the batch
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                attn, active, tok, next_pos = attn[idx], active[idx], tok[idx], next_pos[idx]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=-1)
            logits = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                past_key_values=cache, use_cache=True,
            ).logits[:, -1].float()
            next_pos = next_pos + 1
        return [
            Generation(token_ids=tokens[r], logprobs=logps[r], finish_reason=reasons[r] or "length")
            for r in range(n)
        ]
