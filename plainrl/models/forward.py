"""The model's forward passes that every stage shares: float32 logprobs of chosen tokens
in chunks (policy, reference, learner), a value head per token (PPO's critic) and a
score per sequence (reward models), each able to run a group's shared prompt once and
to run packed, without padding (:mod:`plainrl.models.packing`).

Shapes: B sequences, T padded tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from plainrl.algorithms import entropy_from_logits
from plainrl.algorithms.sampling_filter import filtered_logprobs
from plainrl.models.loading import unwrap
from plainrl.models.packing import packed_hidden

# Largest [chunk, V] float32 block of logits computed at once (elements): 2^24 = 64 MiB, 341
# tokens of a 49152-token vocabulary. A checkpointed chunk's backward holds about three such
# blocks at once (the recomputed log-softmax, the gradient scattered by gather, the gradient of
# the logits), so at 2^26 (256 MiB) the LM head alone added ~0.8 GB to the update's peak. The
# work is the same in smaller chunks; a [341, H] x [H, V] product (19 GFLOP at H = 576) is still
# far above the size where a matmul's per-call overhead shows.
LOGIT_BLOCK_ELEMENTS = 1 << 24


def _target_logps(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()  # [c, V] float32, one chunk only
    if temperature != 1.0:
        logits = logits / temperature
    # targets [c]: the chosen tokens; [c, m]: the chosen token and m - 1 more per position (distillation)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None] if targets.dim() == 1 else targets)
    logps = logps.squeeze(-1) if targets.dim() == 1 else logps  # [c] or [c, m]
    return (logps, entropy_from_logits(logits)) if with_entropy else logps


class _FrozenHeadLogps(torch.autograd.Function):
    """Logprobs of the targets (and the entropy) of one chunk through a frozen LM head,
    with the gradient with respect to the hidden states computed in the forward pass.

    With z = (h W^T + b) / T and p = softmax(z), for one position:
      d log p_y / dz = onehot(y) - p                    (log p_y = z_y - logsumexp(z))
      d H / dz       = -p * (log p + H)                 (H = -sum_v p_v log p_v)
    and dz/dh = W / T, so each output's gradient with respect to h is a [V] vector times W:
    one [c, V] x [V, H] product per output, done while the logits exist. Backward then
    only scales those [c, H] rows by the incoming per-position gradients. A checkpointed
    chunk instead recomputes the [c, H] x [H, V] logits in backward and then does the same
    [c, V] x [V, H] product: this saves one of the LM head's three matmuls and the
    recomputed softmax. Only for a head without trainable parameters (LoRA on the decoder,
    a tied or frozen head): a trainable W would need the incoming gradients to form dW.
    The same trick as fused linear-cross-entropy losses (e.g. Liger Kernel's, Hsu et al.
    2024, arXiv:2410.10989), here for per-token logprobs rather than a mean loss.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy):
        # every [c, V] block (64 MiB) is worked on in place where it can be: a fresh product here
        logits = torch.nn.functional.linear(hidden, weight, bias).float()  # [c, V]
        if temperature != 1.0:
            logits.div_(temperature)
        logp = torch.log_softmax(logits, dim=-1)  # [c, V]
        del logits
        out = logp.gather(-1, targets[:, None]).squeeze(-1)  # [c]
        probs = logp.exp()
        rows = []  # d out / d z, [c, V] each, in the order of the outputs
        if with_entropy:  # before probs is overwritten below
            plogp = (probs * logp).nan_to_num_(0.0)  # 0 * -inf = 0: a banned token adds nothing
            entropy = -plogp.sum(-1)  # [c]
            ent_row = plogp.addcmul_(probs, entropy[:, None]).neg_()  # -p (log p + H)
        del logp
        rows.append(probs.neg_().scatter_add_(-1, targets[:, None], torch.ones_like(out[:, None])))  # onehot - p
        if with_entropy:
            rows.append(ent_row)
        # dz/dlogits = 1/T; in the head's dtype, as autograd's backward through the matmul would be
        units = [(r.div_(temperature).to(weight.dtype) @ weight).float() for r in rows]  # [c, H] each
        ctx.save_for_backward(*units)
        ctx.hidden_dtype = hidden.dtype
        return (out, entropy) if with_entropy else out

    @staticmethod
    def backward(ctx, *grads):
        terms = [g[:, None] * unit for g, unit in zip(grads, ctx.saved_tensors) if g is not None]
        grad = sum(terms[1:], terms[0]).to(ctx.hidden_dtype) if terms else None
        return grad, None, None, None, None, None


def _frozen_head(lm_head: torch.nn.Module) -> bool:
    """Whether the LM head is a plain Linear with nothing to train (not peft-wrapped,
    sharded or quantized), so :class:`_FrozenHeadLogps` computes exactly its gradient."""
    params = list(lm_head.parameters())
    return type(lm_head) is torch.nn.Linear and not any(p.requires_grad for p in params) \
        and all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params)


def shared_prompt_hidden(
    base: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor
) -> torch.Tensor | None:
    """The decoder's last hidden states [B, T, H] with each distinct prompt run once.

    A GRPO group's samples share their prompt, and a prompt is often longer than the
    completions; recomputing it for every sample is most of the training forward and
    backward. Here the distinct prompts run first (left-padded so they all end at
    column P, with use_cache), their keys and values are repeated to the rows that
    share them (an index, so gradients from every row sum into the one prompt
    computation), and the completions run on top with the cache. The result is laid out
    as the plain forward's: row b's position i is prompt column P - p_b + i for i < p_b,
    else completion column i - p_b. The mathematics is that of one causal forward per
    row; only float rounding differs.

    Args:
        base: the unwrapped transformers causal LM.
        input_ids: [B, T] prompt + completion, right-padded.
        attention_mask: [B, T] 1 on real tokens.
        prompt_lens: [B] prompt tokens per row.
    Returns:
        [B, T, H] hidden states (padding positions hold finite values of no meaning),
        or None when no two rows share a prompt (nothing to save).
    """
    from transformers import DynamicCache

    b, t = input_ids.shape
    lens = attention_mask.sum(1).tolist()
    p_lens = prompt_lens.tolist()
    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(input_ids[r, : p_lens[r]].tolist()), len(first)) for r in range(b)]
    if len(first) == b or min(p_lens) < 1:
        return None
    dev = input_ids.device
    width = max(p_lens)  # P: prompts end at column P
    suffix = max(n - p for n, p in zip(lens, p_lens))  # longest completion
    prompt_ids = torch.zeros(len(first), width, dtype=torch.long, device=dev)
    prompt_mask = torch.zeros(len(first), width, dtype=torch.long, device=dev)
    for key, g in first.items():
        prompt_ids[g, width - len(key):] = torch.tensor(key, device=dev)
        prompt_mask[g, width - len(key):] = 1
    comp_ids = torch.zeros(b, suffix, dtype=torch.long, device=dev)
    comp_mask = torch.zeros(b, suffix, dtype=torch.long, device=dev)
    for r in range(b):
        comp_ids[r, : lens[r] - p_lens[r]] = input_ids[r, p_lens[r] : lens[r]]
        comp_mask[r, : lens[r] - p_lens[r]] = 1
    owner_t = torch.tensor(owner, device=dev)
    p_t = prompt_lens.to(dev)
    decoder = base.get_decoder()
    cache = DynamicCache()
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    prompt_hidden = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                            past_key_values=cache, use_cache=True).last_hidden_state  # [G, P, H]
    cache.batch_select_indices(owner_t)  # [G, ...] -> [B, ...], differentiable
    comp_pos = p_t[:, None] + torch.arange(suffix, device=dev)[None]  # [B, C]
    comp_hidden = decoder(input_ids=comp_ids, attention_mask=torch.cat([prompt_mask[owner_t], comp_mask], dim=1),
                          position_ids=comp_pos, past_key_values=cache, use_cache=True).last_hidden_state  # [B, C, H]
    joined = torch.cat([prompt_hidden[owner_t], comp_hidden], dim=1)  # [B, P + C, H]
    column = (width - p_t[:, None] + torch.arange(t, device=dev)[None]).clamp(max=width + suffix - 1)  # [B, T]
    return joined.gather(1, column[..., None].expand(-1, -1, joined.shape[-1]))


def head_logps(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, *,
               temperature: float = 1.0, with_entropy: bool = False,
               sampling_filter: tuple[int, float] | None = None) -> list[torch.Tensor]:
    """Float32 log pi_T(target | hidden state) of K positions through the LM head, in chunks of
    :data:`LOGIT_BLOCK_ELEMENTS` logits (a frozen head's chunk with its gradient computed in the
    forward pass, a trainable head's checkpointed; see :func:`sequence_logps`).

    Args:
        hidden: [K, H] the decoder's last hidden states at the K positions.
        targets: [K] the token each position is scored on, or [K, m]: m tokens per position
            (the chosen one and a teacher's top-k; checkpointed: the fused gradient covers one token).
        sampling_filter: ``(top_k, top_p)``: also the chosen token's logprob under pi_T after the
            sampler's filter (:func:`plainrl.algorithms.sampling_filter.filtered_logprobs`), without
            gradient; its logits are computed a second time, so only runs that filter pay for it.
    Returns:
        ``[logps]`` ([K] or [K, m]), ``[logps, entropy]`` with ``with_entropy``, then the filtered
        logprobs ([K], -inf where the filter drops the token) with ``sampling_filter``.
    """
    chunk = max(1, LOGIT_BLOCK_ELEMENTS // lm_head.weight.shape[0])
    fused = torch.is_grad_enabled() and hidden.requires_grad and _frozen_head(lm_head) and targets.dim() == 1
    outs = []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s : s + chunk], targets[s : s + chunk]
        if fused:
            out = _FrozenHeadLogps.apply(h, lm_head.weight, lm_head.bias, y, temperature, with_entropy)
        elif torch.is_grad_enabled():
            out = checkpoint(_target_logps, h, lm_head, y, temperature, with_entropy, use_reentrant=False)
        else:
            out = _target_logps(h, lm_head, y, temperature, with_entropy)
        out = out if with_entropy else (out,)
        if sampling_filter is not None:
            with torch.no_grad():
                logits = lm_head(h.detach()).float() / temperature  # [c, V]
                out = (*out, filtered_logprobs(logits, y if y.dim() == 1 else y[:, 0], *sampling_filter))
        outs.append(out)
    width = 1 + with_entropy + (sampling_filter is not None)
    return [torch.cat(c) for c in zip(*outs)] or [hidden.new_zeros(0, dtype=torch.float32)] * width


def sequence_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
    with_entropy: bool = False,
    prompt_lens: torch.Tensor | None = None,
    packing: bool = False,
    extra_targets: torch.Tensor | None = None,
    sampling_filter: tuple[int, float] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """log pi_T(x_{t+1} | x_{<=t}) for every position, in float32, where
    pi_T = softmax(logits / temperature) is the policy the engine sampled from;
    optionally also the entropy of pi_T at each position.

    The LM head and log-softmax run over chunks of positions so that no whole
    [B, T, V] float32 logits tensor exists; under autograd the chunks' logits are not
    kept either: a frozen head's chunk computes its gradient with respect to the hidden
    states in the forward pass (:class:`_FrozenHeadLogps`), a trainable head's chunk is
    checkpointed (recomputed in backward).

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        temperature: the sampling temperature (1 = the model's own distribution).
        positions: optional [B, T-1] bool; the LM head runs only where it is True
            (the completion tokens: prompts are most of a sequence and need no logits).
        with_entropy: also return the entropy of pi_T (:func:`entropy_from_logits`).
        prompt_lens: optional [B] prompt lengths; rows with identical prompts then run
            their prompt once (:func:`shared_prompt_hidden`, or within a packed row).
        packing: run the decoder on the episodes packed end to end without padding
            (:func:`plainrl.models.packing.packed_hidden`); the result is the same.
        extra_targets: optional [B, T-1, k] more token ids per position (a teacher's top-k,
            :mod:`plainrl.algorithms.distill`) whose logprobs are returned too; their chunks are
            checkpointed (the fused frozen-head gradient covers the chosen token only).
        sampling_filter: ``(top_k, top_p)`` of the engine's sampler: also the logprobs of
            ``input_ids[:, 1:]`` under the filtered, renormalised pi_T (:func:`head_logps`).
    Returns:
        [B, T-1] float32 logprobs of ``input_ids[:, 1:]`` (0 where ``positions`` is False);
        with ``with_entropy``, ``(logps, entropy)``, both [B, T-1]; with ``extra_targets``
        their [B, T-1, k] logprobs come next; with ``sampling_filter`` the filtered [B, T-1]
        logprobs come last.
    """
    base = unwrap(model)
    hidden = _hidden(model, input_ids, attention_mask, prompt_lens, packing)  # [B, T, H]
    b, t = input_ids.shape
    # flatten to 2-D rows so every chunk is contiguous: a strided 3-D slice makes
    # F.linear fall back to a batched matmul that copies the whole LM head per row
    hidden = hidden[:, :-1].reshape(b * (t - 1), -1)  # [B*(T-1), H]
    targets = input_ids[:, 1:].reshape(-1)  # [B*(T-1)]
    if extra_targets is not None:  # [B*(T-1), 1 + k]: the chosen token first
        targets = torch.cat([targets[:, None], extra_targets.reshape(b * (t - 1), -1).to(targets.device)], dim=1)
    results = _head_at(base, hidden, targets, positions, (b, t - 1), temperature=temperature,
                       with_entropy=with_entropy, sampling_filter=sampling_filter)
    filtered = [results.pop()] if sampling_filter is not None else []
    if extra_targets is not None:  # split the chosen token's column from the extra ones
        results = [results[0][..., 0], *results[1:], results[0][..., 1:]]
    results += filtered
    return tuple(results) if len(results) > 1 else results[0]


def target_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 targets: torch.Tensor, *, positions: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
    """log pi_T(targets[b, t] | input_ids[b, <=t]) in float32: :func:`sequence_logps` with the
    scored tokens given rather than read off ``input_ids`` (Tinker's ``target_tokens``, which
    need not be the next input token, and may be K per position), chunked the same way.

    Args:
        input_ids: [B, T] token ids (right-padded); attention_mask: [B, T] 1 on real tokens.
        targets: [B, T] (or [B, T, K]) the tokens scored at each position.
        positions: optional [B, T] bool; the LM head runs only where it is True.
    Returns:
        [B, T] (or [B, T, K]) float32, 0 where ``positions`` is False.
    """
    base = unwrap(model)
    b, t = input_ids.shape
    hidden = _hidden(model, input_ids, attention_mask).reshape(b * t, -1)  # [B*T, H]
    return _head_at(base, hidden, targets.reshape(b * t, *targets.shape[2:]), positions, (b, t),
                    temperature=temperature)[0]


def _head_at(base: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
             shape: tuple[int, int], **head_kw) -> list[torch.Tensor]:
    """:func:`head_logps` of the flattened rows ``hidden`` [B*T, H] against ``targets`` [B*T(, k)],
    only where ``positions`` ([B, T] bool) is True, each column scattered back to ``shape`` + its
    trailing dims (0 elsewhere)."""
    index = None
    if positions is not None:
        index = positions.reshape(-1).nonzero().squeeze(-1)  # [K]
        hidden, targets = hidden[index], targets[index]
    columns = head_logps(hidden, base.get_output_embeddings(), targets, **head_kw)

    def unflatten(flat: torch.Tensor) -> torch.Tensor:
        if index is None:
            return flat.view(*shape, *flat.shape[1:])
        full = torch.zeros(shape[0] * shape[1], *flat.shape[1:], dtype=flat.dtype, device=flat.device)
        return full.index_put((index,), flat).view(*shape, *flat.shape[1:])

    return [unflatten(c) for c in columns]


@torch.no_grad()
def sequence_topk(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, k: int,
    temperature: float = 1.0, positions: torch.Tensor | None = None, prompt_lens: torch.Tensor | None = None,
    packing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A teacher's view of every position, without gradient: the logprob of the next token and
    the ``k`` most likely tokens with their logprobs, of pi_T = softmax(logits / temperature).

    Args:
        input_ids, attention_mask, temperature, positions, prompt_lens, packing: as
            :func:`sequence_logps`.
        k: tokens per position (>= 1).
    Returns:
        ``(logps [B, T-1], topk_ids [B, T-1, k] int64, topk_logps [B, T-1, k])`` float32 logprobs,
        0 (ids 0) where ``positions`` is False.
    """
    base = unwrap(model)
    hidden = _hidden(model, input_ids, attention_mask, prompt_lens, packing)
    b, t = input_ids.shape
    hidden = hidden[:, :-1].reshape(b * (t - 1), -1)
    targets = input_ids[:, 1:].reshape(-1)
    index = None if positions is None else positions.reshape(-1).nonzero().squeeze(-1)
    if index is not None:
        hidden, targets = hidden[index], targets[index]
    lm_head = base.get_output_embeddings()
    chunk = max(1, LOGIT_BLOCK_ELEMENTS // lm_head.weight.shape[0])
    chosen, top_v, top_i = [], [], []
    for s in range(0, hidden.shape[0], chunk):
        logits = lm_head(hidden[s: s + chunk]).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)  # [c, V]
        chosen.append(logp.gather(-1, targets[s: s + chunk, None]).squeeze(-1))
        v, i = logp.topk(k, dim=-1)
        top_v.append(v)
        top_i.append(i)
    dev = input_ids.device
    flat = [torch.cat(x) if x else torch.zeros(0, *shape, dtype=dt, device=dev)
            for x, shape, dt in ((chosen, (), torch.float32), (top_i, (k,), torch.long), (top_v, (k,), torch.float32))]
    out = []
    for f in flat:
        full = torch.zeros(b * (t - 1), *f.shape[1:], dtype=f.dtype, device=f.device)
        full = f if index is None else full.index_put((index,), f)
        out.append(full.view(b, t - 1, *f.shape[1:]))
    return out[0], out[1], out[2]


def _hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            prompt_lens: torch.Tensor | None = None, packing: bool = False) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H]: packed, or with shared prompts, or plain."""
    base = unwrap(model)
    if packing:
        return packed_hidden(base, input_ids, attention_mask, prompt_lens)
    if prompt_lens is not None:
        hidden = shared_prompt_hidden(base, input_ids, attention_mask, prompt_lens)
        if hidden is not None:
            return hidden
    return base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def token_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_lens: torch.Tensor | None = None, *, packing: bool = False) -> torch.Tensor:
    """V(s_t) for every target position of a value model (``per_token=True``).

    The state before token t+1 is the prefix through token t, so the value at
    target index t is the head applied to hidden state t: the same frame as
    :func:`sequence_logps`.

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        prompt_lens: [B] prompt tokens per row; rows with the same prompt then run it
            once (:func:`shared_prompt_hidden`).
        packing: run the decoder packed (:func:`plainrl.models.packing.packed_hidden`).
    Returns:
        [B, T-1] float32 values (differentiable when grad is enabled).
    """
    hidden = _hidden(model, input_ids, attention_mask, prompt_lens, packing)[:, :-1]  # [B, T-1, H]
    return unwrap(model).score(hidden.float()).squeeze(-1)


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, last: torch.Tensor,
    prompt_lens: torch.Tensor | None = None, *, packing: bool = False,
) -> torch.Tensor:
    """A reward model's score of each sequence, read at the position ``last``.

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        last: [B] the position whose hidden state is scored (plainrl's reward models
            use the last token of the response: the EOS that closes the final assistant turn).
        prompt_lens: [B] prompt tokens per row; rows with the same prompt then run it
            once (:func:`shared_prompt_hidden`).
        packing: run the decoder packed (:func:`plainrl.models.packing.packed_hidden`).
    Returns:
        [B] float32 scores (differentiable when grad is enabled).
    """
    hidden = _hidden(model, input_ids, attention_mask, prompt_lens, packing)  # [B, T, H]
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)]  # [B, H]
    return unwrap(model).score(picked.float()).squeeze(-1)
