"""The embedded engine: sampling with the learner's own transformers model, in process.

Weight sync is free (same module). Sequences are decoded in batches with a KV
cache; a sequence that finishes (EOS, stop string or length) leaves the batch at
the host's next check (every step on a CPU, every :data:`CHECK_EVERY` steps on an
accelerator, where a decode step otherwise makes no host round trip), so the cost
of a step falls as the batch empties.
"""

from __future__ import annotations

import contextlib
from typing import Literal, Protocol, get_args

import torch

from plainrl.algorithms import sampling_filter
from plainrl.models import is_quantized, lora_delta, pad_token_id, unwrap
from plainrl.rollout.engines.static_decoder import StaticDecoder, unsupported_reason
from plainrl.rollout.seeding import row_uniforms
from plainrl.types import FinishReason, Generation, SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then the sampler's top-k and top-p filter
    (:func:`plainrl.algorithms.sampling_filter.filter_logits`, the one the learner applies too).

    Args:
        logits: [B, V] float32. Filtered-out entries become -inf.
        temperature: > 0 (greedy decoding is handled by the caller).
        top_k: keep the k largest (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off);
            the most likely token is always kept.
    Returns:
        [B, V] processed logits.
    """
    return sampling_filter.filter_logits(logits / temperature, top_k, top_p)


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised probabilities, by inverting the CDF.

    ``torch.multinomial`` draws an exponential variate for every vocabulary entry
    (15 ms per step for [16, 49152] on one CPU core, more than a layer's matmuls);
    one uniform per row and a binary search over the cumulative sum cost ~1 ms.
    Index i is drawn when ``cdf[i-1] <= u * cdf[-1] < cdf[i]`` with ``u ~ U[0, 1)``, which
    has probability ``probs[i] / sum(probs)``; a zero entry can never be drawn.

    Args:
        probs: [b, V] non-negative float weights, each row with a positive sum.
        u: [b] uniform draws in [0, 1), one per row (its own random stream:
            :func:`~plainrl.rollout.seeding.row_uniforms`), on ``probs``' device.
    Returns:
        [b] long token ids.
    """
    cdf = probs.float().cumsum(-1)  # [b, V]
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


@contextlib.contextmanager
def merged_lora(model: torch.nn.Module):
    """Fold active LoRA adapters into the base weights (W' = W + s * B @ A) for the
    duration of the block, and run the model with the adapter path switched off.

    Decoding a small batch is dominated by per-module overhead, and peft's LoRA
    forward adds three small matmuls and casts to every targeted layer; merged
    weights remove that (about 1.8x faster decode on the embedded model). The
    original weight tensors are kept aside and put back untouched, so repeated
    merges never accumulate rounding error (unlike peft's merge/unmerge, which
    subtracts the delta again). Costs one extra copy of the targeted weights while
    generating. A no-op for models without adapters; for quantized models
    (``model.quantization``): a delta cannot be added to 4-bit or 8-bit codes, and
    merging into a dequantized copy would undo the memory saving; and for 16-bit weights:
    W + s * B @ A rounded to bfloat16 loses the part of the update below W's spacing
    (2^-9 |W|), so the engine would sample a policy the learner is not training (the static
    decoder keeps them unmerged for the same reason). Those decode through peft's adapter path.
    """
    if (not hasattr(model, "disable_adapter") or is_quantized(model)
            or unwrap(model).get_input_embeddings().weight.dtype != torch.float32):
        yield
        return
    from peft.tuners.lora import LoraLayer

    saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for m in model.modules():
                if not isinstance(m, LoraLayer) or not isinstance(m.base_layer, torch.nn.Linear):
                    continue
                delta = lora_delta(m)
                if delta is not None:
                    w = m.base_layer.weight
                    saved.append((w, w.data))
                    w.data = w.data + delta
        with model.disable_adapter():
            yield
    finally:
        for w, original in saved:
            w.data = original


# Decode steps between the host's checks for finished rows on an accelerator. Reading a result
# on the host waits for every queued kernel (on CUDA: a synchronisation), so a check every
# step would stall the launch queue once per token; between checks the loop runs on device
# tensors alone. The price: a row that finishes keeps decoding until the next check, at most
# CHECK_EVERY - 1 wasted steps per row (and for the batch after its last row ends), which at 8
# is small against a completion of hundreds of tokens. On a CPU a read waits for nothing
# (kernels run as they are issued), so it checks every step and finished rows leave at once.
CHECK_EVERY = 8

DecoderChoice = Literal["auto", "static", "transformers"]
DECODERS: tuple[str, ...] = get_args(DecoderChoice)


class Decoder(Protocol):
    """The forward passes the sampling loop needs, over one batch's KV cache
    (:class:`~plainrl.rollout.engines.static_decoder.StaticDecoder` or :class:`_TransformersDecoder`)."""

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        """Prefill left-padded prompts [b, s] (``valid`` False on padding); [b, V] float32 logits."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep or repeat batch rows."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row [b]; [b, V] float32 next-token logits."""


class _TransformersDecoder:
    """:class:`Decoder` through the model's own forward and a transformers ``DynamicCache``:
    any causal LM (with peft's LoRA modules, or merged by :func:`merged_lora`)."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.base = unwrap(model)
        self.cache = DynamicCache()

    def _next_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # The LM head runs on a contiguous [b, H] copy of the last hidden states: on the strided
        # [b, 1, H] slice that logits_to_keep=1 takes, matmul broadcasts the LM head to [b, H, V].
        hidden = self.base.get_decoder()(
            input_ids=input_ids, attention_mask=self.attn, position_ids=position_ids,
            past_key_values=self.cache, use_cache=True,
        ).last_hidden_state[:, -1].contiguous()  # [b, H]
        return self.base.get_output_embeddings()(hidden).float()

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        self.attn = valid.long()
        position_ids = (self.attn.cumsum(-1) - 1).clamp(min=0)
        self.next_pos = position_ids[:, -1:] + 1  # [b, 1]
        return self._next_logits(input_ids, position_ids)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attn, self.next_pos = self.attn[rows], self.next_pos[rows]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=-1)
        logits = self._next_logits(tokens[:, None], self.next_pos)
        self.next_pos = self.next_pos + 1
        return logits


class _Finisher:
    """Which rows of a batch have finished, settled on the host from blocks of decode steps.

    The decode loop keeps each row's tokens and first EOS step on the device and calls
    :meth:`check` every few steps with the block decoded since the last check. Each live row
    is then settled exactly as if it had been checked after every token: EOS at its first EOS
    step; a stop string at the first step before that whose decoded tail (the last
    ``max(len(stop)) + 4`` tokens, decoded but never re-tokenised) contains one; else it
    runs on. Tokens decoded after a row's end are dropped by :meth:`generations`.

    Args:
        n: rows in the batch.
        steps: the token budget (``max_new_tokens``); a row never settled ends by ``length``.
        stop: stop strings (``SamplingParams.stop``).
        tokenizer: decodes the tails checked for stop strings.
    """

    def __init__(self, n: int, steps: int, stop: tuple[str, ...], tokenizer):
        self.stop, self.tokenizer = stop, tokenizer
        self.window = max((len(s) for s in stop), default=0) + 4
        self.live = list(range(n))  # original row of each live batch row (the loop's ``active``)
        self.history: list[list[int]] = [[] for _ in range(n)]  # tokens seen so far (with stop strings)
        self.ends = [steps] * n  # tokens each row keeps
        self.reasons: list[FinishReason] = ["length"] * n

    def check(self, active: torch.Tensor, eos_at: torch.Tensor, out_tok: torch.Tensor, start: int, t: int) -> list[int]:
        """Settle the rows that finished at steps ``start..t`` (one device-to-host copy).

        Args:
            active: [b] original row of each live batch row (on the device).
            eos_at: [b] each live row's first EOS step, ``steps`` where none.
            out_tok: [n, steps] tokens by original row, filled up to step ``t``.
            start, t: the first and last step of the block not yet checked.
        Returns:
            the batch positions of the rows still running, ascending.
        """
        if self.stop:  # [b, 1 + block]: the first EOS step, then the block's tokens
            rows = torch.cat([eos_at[:, None], out_tok[active, start : t + 1]], dim=1).tolist()
        else:
            rows = [[e] for e in eos_at.tolist()]
        keep = []
        for j, (row, (eos, *block)) in enumerate(zip(self.live, rows)):
            end, reason = (eos + 1, "eos") if eos <= t else (None, None)
            if self.stop:  # the steps before the EOS step: there an EOS wins over a stop string
                history = self.history[row]
                for s, token in enumerate(block[: min(eos, t + 1) - start]):
                    history.append(token)
                    if any(x in self.tokenizer.decode(history[-self.window :]) for x in self.stop):
                        end, reason = start + s + 1, "stop"
                        break
            if end is None:
                keep.append(j)
            else:
                self.ends[row], self.reasons[row] = end, reason
        self.live = [self.live[j] for j in keep]
        return keep

    def generations(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[Generation]:
        """Each row's :class:`Generation` from the [n, steps] buffers, cut at its end."""
        return [Generation(token_ids=tok[:end], logprobs=lp[:end], finish_reason=reason)
                for tok, lp, end, reason in zip(tokens, logprobs, self.ends, self.reasons)]


class HFEngine:
    """Batched sampling with a transformers (or peft-wrapped) causal LM.

    Args:
        model: the learner's model; it is put in eval mode during generation and
            restored afterwards (LoRA dropout off while sampling).
        tokenizer: for EOS/pad ids and for checking stop strings (the decoded text
            is only inspected, never re-tokenised).
        batch_size: sequences decoded together.
        merge_lora: decode float32 weights with LoRA folded in (see :func:`merged_lora`;
            the static decoder folds them into its own fused copies in float32 and keeps them
            unmerged in 16-bit precision either way; ignored for quantized and 16-bit models,
            which decode through the adapter path).
        decoder: ``static`` (:class:`~plainrl.rollout.engines.static_decoder.StaticDecoder`,
            Llama-family models with float weights), ``transformers`` (the model's own
            forward with a ``DynamicCache``, any causal LM, quantized too) or ``auto``
            (static where supported).
        check_every: decode steps between the host's checks for finished rows (EOS, stop
            strings); None: 1 on a CPU, :data:`CHECK_EVERY` on an accelerator.

    Raises:
        ValueError: ``decoder="static"`` for an unsupported model, an unknown ``decoder``, or
            ``check_every`` below 1.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, batch_size: int = 64, merge_lora: bool = True,
                 decoder: DecoderChoice = "auto", check_every: int | None = None):
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        if check_every is not None and check_every < 1:
            raise ValueError(f"check_every must be at least 1 (decode steps between checks), got {check_every}")
        self._check_every = check_every
        self.model = model
        self.merge_lora = merge_lora
        unsupported = unsupported_reason(model)
        if decoder == "static" and unsupported is not None:
            raise ValueError(f"rollout.decoder=static cannot run this model ({unsupported}); "
                             "use rollout.decoder=auto or transformers")
        if decoder == "auto":
            decoder = "static" if unsupported is None else "transformers"
        self.decoder = decoder
        self._static: tuple[tuple, StaticDecoder] | None = None  # (weights key, decoder)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.pad_id = pad_token_id(tokenizer)

    def load_weights(self, model: torch.nn.Module) -> None:
        """No-op when the engine samples with ``model`` itself; when it samples with a copy
        (``rollout.async_steps``: :func:`plainrl.rollout.engines.factory.sampling_copy`), ``model``'s
        trainable parameters are copied into it (the frozen ones never change)."""
        if model is self.model:
            return
        source = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if source[name].requires_grad:
                    p.copy_(source[name])

    def offload(self) -> None:
        """Drop the static decoder's copies of the weights before the learner's update.

        The engine samples with the learner's own module, so there is nothing else to
        free; but the static decoder holds fused (and, on CPU, prepacked) copies of every
        projection and the LM head: nearly a second copy of the model (for the embedded
        model in float32, 405 MiB of projections and, prepacked, the 108 MiB LM head). The update changes the weights, so the next rollout rebuilds
        those copies anyway (:meth:`make_decoder`); keeping them through the update only
        raises the update's peak by that much.
        """
        self._static = None

    def take_metrics(self) -> dict[str, float]:
        """No counters."""
        return {}

    def close(self) -> None:
        """No-op: nothing runs outside the learner's process."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def check_every(self) -> int:
        """Decode steps between the host's checks for finished rows (see :data:`CHECK_EVERY`)."""
        if self._check_every is not None:
            return self._check_every
        return 1 if self.device.type == "cpu" else CHECK_EVERY

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt (repeat a prompt for a group).

        Args:
            prompts: N lists of prompt token ids.
            params: sampling settings; temperature 0 is greedy.
            seeds: N seeds, one per prompt: token t of completion i is drawn with the t-th
                number of seed i's stream (:func:`~plainrl.rollout.seeding.row_uniforms`),
                so a completion does not depend on the other prompts or the batch size.
                None: torch's global generator.
        Returns:
            N :class:`Generation` in the order of ``prompts``.
        Raises:
            ValueError: ``seeds`` is not one per prompt.
        """
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        was_training = self.model.training
        self.model.eval()
        static = self.decoder == "static"
        merge = merged_lora(self.model) if self.merge_lora and not static else contextlib.nullcontext()
        try:
            with merge:
                out: list[Generation] = []
                for i in range(0, len(prompts), self.batch_size):
                    dec = self.make_decoder()
                    chunk = None if seeds is None else seeds[i : i + self.batch_size]
                    out.extend(self._generate_batch(dec, prompts[i : i + self.batch_size], params, chunk))
                    if static:
                        dec.release()
            return out
        finally:
            self.model.train(was_training)

    def make_decoder(self) -> Decoder:
        """A :class:`Decoder` of the current weights, as :meth:`generate` uses it.

        The static decoder is rebuilt (fused copies, prepacking) only when a parameter
        was replaced or changed in place since the last call, so the batches and the
        turns of a multi-turn rollout share one build. The transformers decoder runs the
        model as it is: wrap its use in :func:`merged_lora` to decode with merged LoRA.
        """
        if self.decoder != "static":
            return _TransformersDecoder(self.model)
        key = tuple((p.data_ptr(), p._version) for p in self.model.parameters())
        static = self._static  # (read once: under rollout.async_steps offload() may clear it from the learner's thread)
        if static is None or static[0] != key:
            static = self._static = (key, StaticDecoder(self.model))
        return static[1]

    def _prefill(self, dec: Decoder, prompts: list[list[int]], steps: int) -> torch.Tensor:
        """Start ``dec`` on ``prompts`` with room for ``steps`` new tokens; [n, V] float32 logits
        of each prompt's next token, the decoder holding one row per prompt."""
        dev = self.device
        # A group's samples share one prompt: prefill each distinct prompt once,
        # then copy its KV cache rows to every sample of the group.
        first: dict[tuple[int, ...], int] = {}
        inverse = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts], device=dev)
        uniq = [list(p) for p in first]
        width = max(len(p) for p in uniq)
        # Left padding, so every row's next token is written at the same column.
        input_ids = torch.full((len(uniq), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(uniq), width), dtype=torch.long)
        for r, p in enumerate(uniq):
            input_ids[r, width - len(p) :] = torch.tensor(p)
            attn[r, width - len(p) :] = 1
        logits = dec.start(input_ids.to(dev), attn.to(dev).bool(), width + steps)[inverse]  # [n, V]
        if len(uniq) < len(prompts):
            dec.select(inverse)
        return logits

    @torch.no_grad()
    def _generate_batch(
        self, dec: Decoder, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None
    ) -> list[Generation]:
        dev = self.device
        n, steps = len(prompts), params.max_new_tokens
        eos_ids = (self.eos_ids if params.stop_token_ids is None
                   else torch.tensor(params.stop_token_ids, dtype=torch.long)).to(dev)

        # Everything a step produces stays on the device: tokens and logprobs go into buffers by
        # original row, and a row's first EOS step into ``eos_at`` (``steps``: none yet). The host
        # reads them only every ``check_every`` steps (:class:`_Finisher`) and once at the end.
        out_tok = torch.zeros(n, steps, dtype=torch.long, device=dev)
        out_lp = torch.zeros(n, steps, dtype=torch.float32, device=dev)
        active = torch.arange(n, device=dev)  # original row of each live batch row
        eos_at = torch.full((n,), steps, dtype=torch.long, device=dev)  # [b]
        # each row's draws come from its own stream, so its tokens do not depend on the batch
        uniforms = row_uniforms(seeds, n, steps, dev) if params.temperature > 0 else None  # [b, T], live rows
        finisher = _Finisher(n, steps, params.stop, self.tokenizer)
        every = self.check_every

        logits = self._prefill(dec, prompts, steps)  # [n, V]
        block_start = 0
        for t in range(steps):
            # logprobs of the distribution sampled from: softmax(z / T) after top-k/top-p, as vLLM's
            # processed_logprobs (the learner filters its own logits alike for the behaviour ratio)
            if params.temperature == 0:
                logprobs = torch.log_softmax(logits, dim=-1)  # [b, V]
                tok = logits.argmax(-1)
            else:
                logprobs = torch.log_softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p),
                                             dim=-1)  # [b, V], -inf off the kept set
                tok = sample_categorical(logprobs.exp(), uniforms[:, t])
            out_tok[:, t].index_copy_(0, active, tok)
            out_lp[:, t].index_copy_(0, active, logprobs.gather(-1, tok[:, None]).squeeze(-1))
            is_eos = (tok[:, None] == eos_ids).any(-1)
            eos_at.masked_fill_(is_eos & (eos_at == steps), t)
            if t + 1 - block_start < every and t < steps - 1:
                logits = dec.step(tok)
                continue
            keep = finisher.check(active, eos_at, out_tok, block_start, t)  # the host reads the block
            if not keep or t == steps - 1:
                break
            if len(keep) < len(active):  # finished rows leave the batch
                idx = torch.tensor(keep, device=dev)
                dec.select(idx)
                active, tok, eos_at = active[idx], tok[idx], eos_at[idx]
                uniforms = None if uniforms is None else uniforms[idx]
            block_start = t + 1
            logits = dec.step(tok)
        return finisher.generations(out_tok.tolist(), out_lp.tolist())
