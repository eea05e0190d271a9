"""Sequence packing for the training forward (``train.packing``): a micro-batch's episodes
laid end to end in a few rows, position ids restarting at every episode and attention kept
within each episode, so no decoder compute is spent on padding.

Method: Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination"
(arXiv:2107.02027): sequences are bin-packed into rows (first-fit decreasing here, their
baseline heuristic), position ids restart per sequence, and a block-diagonal attention
mask keeps each sequence from seeing the others, so every token's output is what the
unpacked forward gives. transformers does the same for padding-free training
(``DataCollatorWithFlattening``): with ``position_ids`` that restart and no attention mask,
``masking_utils.find_packed_sequence_indices`` turns the restarts into a block-diagonal
mask (sdpa, eager, flex) and the flash-attention path into ``cu_seqlens`` for the varlen
kernel, which skips the cross-sequence blocks outright.

Two routes, chosen by :func:`packing_route` from the model's attention implementation:

- ``"mask"`` (eager and sdpa without sliding-window layers; plainrl's CPU default is eager):
  rows as wide as the longest *block*, and an explicit 4-D mask built here. A block is one
  episode, or with shared prompts one prompt followed by several of its completions, each
  completion attending causally to itself and to the prompt and not to its siblings (a
  prefix tree flattened into one row). Every distinct prompt then runs once (per block),
  as in :func:`plainrl.models.shared_prompt_hidden`, with no padding at all and in one
  pass without a KV cache. Position ids: the prompt's 0..p-1, each completion's p..p+n-1.
- ``"positions"`` (flash attention, flex, sliding-window models): blocks are whole
  episodes, position ids restart at each and no mask is passed; transformers derives the
  per-sequence attention (and the varlen ``cu_seqlens``; flash needs everything in one row).
  Shared prompts do not apply: a varlen kernel cannot let several sequences read one prefix.

Dense masked attention computes all W^2 scores of a row of width W whatever the mask, so
rows are as narrow as the widest block, and blocks are kept to :data:`MAX_BLOCK_TOKENS`
(a group with more completions is split, its prompt repeated in each part). Without
shared prompts a row is then never wider than the longest episode, as in the padded
batch, and packing gains where several episodes fit in that width (short prompts, spread
completion lengths); with shared prompts the gain is the padding of the completions and
the prompts' own padding. Tokens left at the end of a row form a segment of their own
that attends only to itself, so no query row of the mask is empty (an all-masked row
gives NaN under softmax, and NaN in backward).

plainrl's ``model.attn_implementation`` is eager (CPU default) or sdpa, both the ``"mask"``
route, or ``flash_attention_2`` (the GPU default where ``flash-attn`` is installed), the
``"positions"`` route with its varlen kernel; ``"positions"`` also serves sliding-window
models (tested on Qwen2 with a window). The flash route has not run here (no GPU).

Shapes: B episodes (rows of the padded micro-batch), T padded length, R packed rows,
W packed width, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# Largest block (a prompt + completions sharing it) under the "mask" route; an episode longer
# than this is a block by itself. A dense row of width W costs W^2 attention scores where
# an unpacked completion token needs only p + n: on the embedded 135M model one score (QK and
# AV, 4 x 576 FLOPs a layer) costs ~1/3000 of a token's linear layers (~7 MFLOPs a layer), and
# eager attention keeps [heads, W, W] probabilities for backward, so beyond a few hundred
# tokens a wider block costs more in attention than it saves by not repeating the prompt.
MAX_BLOCK_TOKENS = 512

PackingRoute = Literal["mask", "positions"]


@dataclass(frozen=True)
class PackedLayout:
    """Where each token of a padded micro-batch sits in the packed rows.

    input_ids:    [R, W] packed token ids (the row ends hold copies of a real token).
    position_ids: [R, W] position of each token within its episode (prompt 0..p-1, then
                  completion p..p+n-1); the row end counts 0, 1, ... as a segment of its own.
    segments:     [R, W] segment id of each token, distinct within a row: a prompt, a
                  completion, a whole episode, or the row's unused end.
    context:      [R, W] the segment a token may read besides its own: its prompt's for a
                  completion token of a shared prompt, else its own segment.
    source:       [B, T] index into the flattened [R * W] packed tokens of each padded
                  position (0 for padding, which carries no meaning).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    context: torch.Tensor
    source: torch.Tensor


def packing_route(config) -> PackingRoute:
    """``"mask"`` when the model takes an explicit 4-D mask for every layer (eager or sdpa
    attention, no sliding-window layers), else ``"positions"`` (transformers derives the
    packing from the restarting position ids: flash varlen, flex, sliding windows)."""
    impl = getattr(config, "_attn_implementation", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        sliding = any(t != "full_attention" for t in types)
    else:
        sliding = bool(getattr(config, "sliding_window", None)) and bool(getattr(config, "use_sliding_window", True))
    return "mask" if impl in ("eager", "sdpa") and not sliding else "positions"


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of at most ``capacity`` (an item larger than it gets a bin of its own), items
    placed largest first into the first bin with room: within 11/9 of the fewest bins
    (Johnson 1973); Krell et al.'s baseline packer.

    Args:
        sizes: [N] item sizes.
    Returns:
        bins of item indices covering 0..N-1 exactly once.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, free in enumerate(room):
            if sizes[i] <= free:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


@dataclass(frozen=True)
class _Block:
    """Spans of the padded micro-batch laid out one after another: ``pieces`` are
    ``(row b, start, end, position of start)``; with a shared prompt the first piece is the
    prompt and ``readers`` the rows whose prompt positions read that copy."""

    pieces: list[tuple[int, int, int, int]]
    readers: list[int]

    @property
    def size(self) -> int:
        return sum(end - start for _, start, end, _ in self.pieces)


def _blocks(lens: list[int], p_lens: list[int] | None, prompts: list[tuple[int, ...]] | None,
            max_block: int) -> list[_Block]:
    """One block per episode; with shared prompts, a prompt then the completions of rows
    sharing it, at most ``max_block`` tokens (or the longest such episode) per block."""
    if p_lens is None:
        return [_Block([(b, 0, n, 0)], []) for b, n in enumerate(lens)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, key in enumerate(prompts):
        groups.setdefault(key, []).append(b)
    blocks = []
    for members in groups.values():
        p, owner = p_lens[members[0]], members[0]
        cap = max(max_block, max(lens[b] for b in members))
        # rows with an empty completion read the group's first copy of the prompt
        block = _Block([(owner, 0, p, 0)], [b for b in members if lens[b] == p])
        for b in members:
            n = lens[b] - p
            if n == 0:
                continue
            if len(block.pieces) > 1 and block.size + n > cap:
                blocks.append(block)
                block = _Block([(owner, 0, p, 0)], [])
            block.pieces.append((b, p, lens[b], p))
            block.readers.append(b)
        blocks.append(block)  # the first block too: a split happens only after a completion joined it
    return blocks


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor | None = None,
                   *, one_row: bool = False, max_block: int = MAX_BLOCK_TOKENS) -> PackedLayout:
    """Lay a right-padded micro-batch out in packed rows (:class:`PackedLayout`).

    Args:
        input_ids: [B, T] prompt + completion, right-padded.
        attention_mask: [B, T] 1 on real tokens (a prefix of each row).
        prompt_lens: [B] prompt tokens per row: rows with the same prompt then share one copy
            of it (blocks of prompt + completions); None: every episode is one segment.
        one_row: every block in a single row (flash varlen: batch size 1), else rows as wide
            as the widest block, filled first-fit decreasing.
        max_block: the most tokens of one shared-prompt block (a longer episode is its own).
    Returns:
        the layout, its tensors on ``input_ids``' device.
    """
    n_seq, t = input_ids.shape
    lens = attention_mask.sum(1).tolist()
    p_lens = prompts = None
    if prompt_lens is not None:
        p_lens = [min(int(p), n) for p, n in zip(prompt_lens.tolist(), lens)]
        prompts = [tuple(input_ids[b, : p_lens[b]].tolist()) for b in range(n_seq)]
    blocks = _blocks(lens, p_lens, prompts, max_block)
    sizes = [blk.size for blk in blocks]
    width = max(1, sum(sizes) if one_row else max(sizes, default=1))
    rows = [list(range(len(blocks)))] if one_row else first_fit_decreasing(sizes, width)
    n_rows = max(1, len(rows))
    flat = [0] * (n_rows * width)  # index into input_ids.view(-1) of each packed token
    pos = [0] * (n_rows * width)
    seg = [0] * (n_rows * width)
    ctx = [0] * (n_rows * width)
    source = torch.zeros(n_seq, t, dtype=torch.long)
    for r, members in enumerate(rows):
        col, s = r * width, 0
        for k in members:
            prompt_seg = s
            for i, (b, start, end, p0) in enumerate(blocks[k].pieces):
                n = end - start
                flat[col : col + n] = range(b * t + start, b * t + end)
                pos[col : col + n] = range(p0, p0 + n)
                seg[col : col + n] = [s] * n
                shared = p_lens is not None and i > 0  # a completion: reads its prompt's segment too
                ctx[col : col + n] = [prompt_seg if shared else s] * n
                if p_lens is not None and i == 0:  # a shared prompt: read by the rows of this block
                    source[blocks[k].readers, :n] = torch.arange(col, col + n)
                else:
                    source[b, start:end] = torch.arange(col, col + n)
                col, s = col + n, s + 1
        end_of_row = (r + 1) * width
        if col < end_of_row:  # the unused end: a segment of its own
            pos[col:end_of_row] = range(end_of_row - col)
            seg[col:end_of_row] = ctx[col:end_of_row] = [s] * (end_of_row - col)
    dev = input_ids.device
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long).view(n_rows, width).to(dev)  # noqa: E731
    return PackedLayout(input_ids=input_ids.reshape(-1)[as_tensor(flat)], position_ids=as_tensor(pos),
                        segments=as_tensor(seg), context=as_tensor(ctx), source=source.to(dev))


def block_causal_mask(layout: PackedLayout, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D attention mask of packed rows: query i reads key j <= i of its own segment or
    of its context segment (its prompt), nothing else.

    Args:
        layout: from :func:`pack_sequences`.
        attn_implementation: ``"sdpa"`` (boolean mask, True = attend) or ``"eager"``
            (additive: 0 or the dtype's minimum).
        dtype: the model's compute dtype (eager's additive mask).
    Returns:
        [R, 1, W, W] mask, passed to the decoder as is (transformers uses a 4-D mask unchanged).
    """
    seg, ctx = layout.segments, layout.context  # [R, W]
    w = seg.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=seg.device).tril()  # [W, W]
    same = (seg[:, None, :] == seg[:, :, None]) | (seg[:, None, :] == ctx[:, :, None])  # [R, Wq, Wk]
    allowed = (same & causal)[:, None]  # [R, 1, W, W]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill(~allowed, torch.finfo(dtype).min)


def packed_hidden(base: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_lens: torch.Tensor | None = None, *, route: PackingRoute | None = None) -> torch.Tensor:
    """The decoder's last hidden states of a padded micro-batch, computed packed.

    The result is laid out as the plain forward's, so everything after the decoder (the LM
    head over the loss positions, a value head) is unchanged; it equals the plain forward's
    up to float rounding (the matmuls see different shapes).

    Args:
        base: the unwrapped transformers model (a causal LM or a value/score model).
        input_ids: [B, T] prompt + completion, right-padded.
        attention_mask: [B, T] 1 on real tokens.
        prompt_lens: [B] prompt tokens per row: with the ``"mask"`` route, rows with the same
            prompt run it once; ignored by the ``"positions"`` route.
        route: :data:`PackingRoute`; default :func:`packing_route` of the model's config.
    Returns:
        [B, T, H] hidden states (padding positions hold finite values of no meaning).
    """
    config = base.config
    route = route or packing_route(config)
    impl = getattr(config, "_attn_implementation", "eager")
    decoder = base.get_decoder()
    if route == "mask":
        layout = pack_sequences(input_ids, attention_mask, prompt_lens, max_block=MAX_BLOCK_TOKENS)
        dtype = decoder.get_input_embeddings().weight.dtype  # the hidden states' (eager adds the mask to scores)
        mask = block_causal_mask(layout, impl, dtype)
    else:
        layout = pack_sequences(input_ids, attention_mask, one_row="flash" in impl)
        mask = None  # transformers reads the packing from the restarting position ids
    hidden = decoder(input_ids=layout.input_ids, attention_mask=mask, position_ids=layout.position_ids,
                     use_cache=False).last_hidden_state  # [R, W, H]
    return hidden.reshape(-1, hidden.shape[-1])[layout.source]  # [B, T, H]
