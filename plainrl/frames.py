"""How episodes become tensors: the *completion frame* ([N, L], position k = completion
token k of episode n) and padded micro-batches by token budget ([B, T], target t
predicts token t+1). Every stage that turns episodes into tensors goes through here.

Micro-batches are bounded by tokens (``train.micro_batch_tokens``: padded tokens, or real
tokens under ``train.packing``) and balanced: as few as the budget allows, with the
sequences spread so that the largest is as small as it can be (:func:`balance`). Under
torchrun the ranks' shares of a batch are balanced the same way, by real tokens
(:func:`split_by_tokens`). The loss is normalised over the whole batch, so how the
sequences are grouped changes the gradient by float rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from plainrl.types import Episode, MicroBatch


@dataclass(frozen=True)
class CompletionFrame:
    """One step's per-token episode lists as tensors, built once (:func:`completion_frame`).

    mask:     [N, L] float32 loss mask (0 past each completion).
    logprobs: [N, L] float32 engine logprobs of the sampled tokens (0 past each completion).
    """

    mask: torch.Tensor
    logprobs: torch.Tensor


def completion_frame(episodes: list[Episode]) -> CompletionFrame:
    """The loss masks and engine logprobs of N episodes in the completion frame. Build it
    after anything that edits loss masks (DAPO's overlong filter)."""
    return CompletionFrame(completion_tensor(episodes), completion_tensor(episodes, [e.logprobs for e in episodes]))


def completion_tensor(episodes: list[Episode], values: list[list[float]] | None = None) -> torch.Tensor:
    """Per-token lists of N episodes as one right-padded [N, L] float32 tensor, L the
    longest completion: the *completion frame* (position k = completion token k).
    ``values`` default to the episodes' loss masks."""
    rows = values if values is not None else [e.loss_mask for e in episodes]
    out = torch.zeros(len(episodes), max((len(e.completion_ids) for e in episodes), default=0))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def balance(pack: Callable[[int], list[list[int]]], parts: int, hi: int) -> list[list[int]]:
    """The grouping ``pack(cap)`` with the smallest ``cap`` in ``[1, hi]`` that still needs at
    most ``parts`` groups: with ``parts = len(pack(hi))``, as few groups as the budget ``hi``
    allows, the largest of them as small as possible.

    ``pack`` must be a next-fit packer: it walks the items in a fixed order and opens a new group
    when the next item would take the current one over ``cap``, a group's cost growing as items
    are added. Next-fit then gives the fewest groups of any split of that order into contiguous
    runs under ``cap``, so a binary search over ``cap`` (about log2(hi) packings) finds the
    contiguous split whose largest group is smallest (the "linear partition" problem).
    Contiguity keeps what the order was chosen for: similar lengths together (padding) and a
    prompt's samples together (shared prompts).

    Raises:
        ValueError: ``pack(hi)`` needs more than ``parts`` groups, or ``hi < 1``.
    """
    if hi < 1:
        raise ValueError(f"the cap must be >= 1, got {hi}")
    best = pack(hi)
    if len(best) > parts:
        raise ValueError(f"{len(best)} groups at cap {hi}, more than the {parts} allowed")
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        groups = pack(mid)
        if len(groups) <= parts:
            hi, best = mid, groups
        else:
            lo = mid + 1
    return best


def pack_by_length(widths: list[int], token_budget: int, rows: list[int] | None = None) -> list[list[int]]:
    """Indices grouped longest first so each group's padded size, members x rows each x
    the group's longest width, stays within ``token_budget`` (a single item may exceed it),
    in as few groups as that allows, balanced (:func:`balance`).

    Args:
        widths: [N] padded length of each item.
        rows: [N] sequences per item (2 for a chosen/rejected pair); default 1.
    Returns:
        groups of indices covering 0..N-1 exactly once.
    """
    rows = rows or [1] * len(widths)
    if not widths:
        return []
    groups = _next_fit_by_length(widths, token_budget, rows)
    return groups if len(groups) == 1 else balance(lambda cap: _next_fit_by_length(widths, cap, rows),
                                                   len(groups), token_budget)


def _next_fit_by_length(widths: list[int], token_budget: int, rows: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in sorted(range(len(widths)), key=lambda i: -widths[i]):
        # sorted descending, so the group's first member sets its padded width
        if groups and (len(groups[-1]) + 1) * rows[i] * widths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def pack_by_tokens(prompts: list[tuple[int, ...]], completion_lens: list[int], token_budget: int, *,
                   share_prompts: bool) -> list[list[int]]:
    """Indices grouped so each group's *real* tokens stay within ``token_budget`` (a single
    item may exceed it), in as few groups as that allows, balanced (:func:`balance`): the
    micro-batches of a packed forward, which spends nothing on padding.

    Episodes of one prompt are kept together (in order of the prompt's first appearance), so
    with ``share_prompts`` a group's prompt counts once per micro-batch, as the packed forward
    runs it (:func:`plainrl.models.packing.pack_sequences`).

    Args:
        prompts: [N] each episode's prompt token ids.
        completion_lens: [N] completion tokens of each episode.
        share_prompts: count a prompt once per micro-batch, not once per episode.
    Returns:
        groups of indices covering 0..N-1 exactly once.
    """
    if not prompts:
        return []
    groups = _next_fit_by_tokens(prompts, completion_lens, token_budget, share_prompts)
    if len(groups) == 1:
        return groups
    return balance(lambda cap: _next_fit_by_tokens(prompts, completion_lens, cap, share_prompts), len(groups),
                   token_budget)


def split_by_tokens(episodes: list[Episode], indices: list[int], parts: int, *,
                    share_prompts: bool) -> list[list[int]]:
    """``indices`` (into ``episodes``) in ``parts`` shares of balanced real tokens: under torchrun,
    each rank's share of a (mini-)batch. A share is a contiguous run of the episodes in prompt
    order (a prompt's samples stay together where they can; with ``share_prompts`` a prompt
    counts once per share), the largest share as small as possible (:func:`balance`); shares
    may be empty when there are fewer episodes than parts.

    Returns:
        ``parts`` lists of indices, together ``indices`` exactly once.
    """
    if not indices:
        return [[] for _ in range(parts)]
    eps = [episodes[i] for i in indices]
    prompts, lens = [tuple(e.prompt_ids) for e in eps], [len(e.completion_ids) for e in eps]
    total = sum(map(len, prompts)) + sum(lens)
    groups = balance(lambda cap: _next_fit_by_tokens(prompts, lens, cap, share_prompts), parts, max(1, total))
    return [[indices[j] for j in g] for g in groups] + [[] for _ in range(parts - len(groups))]


def _next_fit_by_tokens(prompts: list[tuple[int, ...]], completion_lens: list[int], token_budget: int,
                        share_prompts: bool) -> list[list[int]]:
    first: dict[tuple[int, ...], int] = {}
    order = sorted(range(len(prompts)), key=lambda i: (first.setdefault(prompts[i], i), i))
    groups: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    used = 0
    for i in order:
        cost = completion_lens[i] + (0 if share_prompts and prompts[i] in seen else len(prompts[i]))
        if not groups or used + cost > token_budget:
            groups.append([])
            seen, used = set(), 0
            cost = completion_lens[i] + len(prompts[i])
        groups[-1].append(i)
        seen.add(prompts[i])
        used += cost
    return groups


def make_micro_batches(
    episodes: list[Episode],
    advantages: torch.Tensor,
    *,
    pad_id: int,
    token_budget: int,
    old_logps: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    packing: bool = False,
    share_prompts: bool = False,
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    behaviour_logps: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """Group episodes into padded micro-batches of at most ``token_budget`` padded tokens,
    or, with ``packing``, of at most ``token_budget`` real tokens (:func:`pack_by_tokens`).

    Without packing, episodes are sorted by length first so each micro-batch pads to a
    similar length (less wasted compute than padding everything to the longest). With it,
    the micro-batch is still handed over padded ([B, T], the same layout for the loss), and
    the forward packs it (``sequence_logps(..., packing=True)``).

    Args:
        episodes: N episodes.
        advantages: [N] one advantage per episode, or [N, L] per completion token.
        old_logps: [N, L] logprobs to use as pi_old instead of the engine's.
        old_values, returns: [N, L] critic values at rollout time and critic targets (GAE).
            (All [N, L] tensors are in the completion frame of :func:`completion_tensor`.)
        teacher_topk: ``(ids, logps)``, [N, L, k] each: a distillation teacher's top-k tokens
            (``algorithm.distill_loss: gkd_topk``).
        behaviour_logps: [N, L] ``old_logps`` after the sampler's top-k/top-p filter (the
            off-policy correction's pi_old, :mod:`plainrl.algorithms.sampling_filter`).
        packing: budget by real tokens (the packed forward's cost), not padded ones.
        share_prompts: with ``packing``, a prompt shared by several episodes counts once.
    Returns:
        micro-batches covering every episode exactly once.
    """
    if packing:
        groups = pack_by_tokens([tuple(e.prompt_ids) for e in episodes], [len(e.completion_ids) for e in episodes],
                                token_budget, share_prompts=share_prompts)
    else:
        groups = pack_by_length([_len(e) for e in episodes], token_budget)
    frames = {"advantages": advantages, "old_logps": old_logps, "old_values": old_values, "returns": returns,
              "teacher_ids": None if teacher_topk is None else teacher_topk[0],
              "teacher_logps": None if teacher_topk is None else teacher_topk[1], "behaviour_logps": behaviour_logps}
    return [_collate(episodes, g, pad_id, {k: v for k, v in frames.items() if v is not None}) for g in groups]


def _len(ep: Episode) -> int:
    return len(ep.prompt_ids) + len(ep.completion_ids)


def _collate(episodes: list[Episode], index: list[int], pad_id: int, frames: dict[str, torch.Tensor]) -> MicroBatch:
    eps = [episodes[i] for i in index]
    width = max(_len(e) for e in eps)
    b = len(eps)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    old = torch.zeros((b, width - 1))
    pos = torch.full((b, width - 1), -1, dtype=torch.long)
    for r, e in enumerate(eps):
        p, n = len(e.prompt_ids), len(e.completion_ids)
        ids[r, : p + n] = torch.tensor(e.prompt_ids + e.completion_ids)
        attn[r, : p + n] = 1
        # target index t predicts token t+1: completion token k sits at target p-1+k
        loss_mask[r, p - 1 : p - 1 + n] = torch.tensor(e.loss_mask, dtype=torch.float32)
        old[r, p - 1 : p - 1 + n] = torch.tensor(e.logprobs)
        pos[r, p - 1 : p - 1 + n] = torch.arange(n)
    idx = torch.tensor(index)
    fields = {}
    for name, frame in frames.items():
        if name == "advantages" and frame.dim() == 1:
            fields[name] = frame[idx].float()  # [B], broadcast over tokens by the loss
            continue
        rows = frame[idx] if name == "teacher_ids" else frame[idx].float()  # [B, L] (or [B, L, k])
        extra = rows.shape[2:]
        if rows.shape[1] == 0:  # every completion empty
            fields[name] = torch.zeros(*pos.shape, *extra, dtype=rows.dtype)
            continue
        at = pos.clamp(0, rows.shape[1] - 1).view(*pos.shape, *([1] * len(extra))).expand(*pos.shape, *extra)
        picked = rows.gather(1, at)  # [B, T-1] (or [B, T-1, k])
        fields[name] = torch.where((pos >= 0).view(*pos.shape, *([1] * len(extra))), picked, torch.zeros_like(picked))
    fields.setdefault("old_logps", old)
    fields["engine_logps"] = old
    prompt_lens = torch.tensor([len(e.prompt_ids) for e in eps])
    return MicroBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, index=idx, completion_pos=pos,
                      prompt_lens=prompt_lens, **fields)


def to_completion_frame(x: torch.Tensor, mb: MicroBatch, out: torch.Tensor) -> None:
    """Write a micro-batch's [B, T-1] (or [B, T-1, k]) per-target values into ``out`` [N, L]
    (or [N, L, k]: the completion frame), at each row's episode index, in ``out``'s dtype."""
    sel = mb.completion_pos >= 0  # [B, T-1]
    rows = mb.index.to(x.device)[:, None].expand_as(sel)[sel]
    out[rows.cpu(), mb.completion_pos[sel].cpu()] = x[sel.to(x.device)].detach().to(out.dtype).cpu()
