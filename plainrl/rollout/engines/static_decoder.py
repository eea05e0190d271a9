"""A lean decode path for Llama-family decoders: fused projections on a preallocated KV cache.

Decoding a small batch on a CPU is not limited by the matmuls of the model but by
everything around them: the transformers forward issues ~60 tensor operations per
layer per token (mask building, cache bookkeeping, casts), and its ``DynamicCache``
concatenates every layer's keys and values on every step (a copy that grows with
the sequence). This module runs the same mathematics with

- q/k/v and gate/up projections fused into one matmul each (LoRA deltas folded in for
  float32 weights, kept unmerged for 16-bit ones: :class:`_Projection`),
- keys and values written in place into a cache allocated once per batch,
- rotary tables computed once by the model's own rotary module (any rope type it
  implements statically),
- attention over the filled part of the cache with a padding mask, and
- on CPU, weights prepacked once into oneDNN's blocked layout (the private
  ``torch.ops.mkldnn`` ops that torch.compile's CPU backend uses): a plain bf16
  ``F.linear`` reorders the weight on every call, which at decode batch sizes costs
  as much as the product (measured: the 30 layers plus LM head of SmolLM2-135M at
  batch 16, one core: 51.6 ms plain, 29.6 ms prepacked; results identical).

It covers ``llama``, ``mistral`` (without a sliding window shorter than the
sequence), ``qwen2`` (q/k/v biases) and dense ``qwen3`` (an RMSNorm over each head's
query and key before the rotation, and a ``head_dim`` that need not be hidden / heads);
:func:`unsupported_reason` says why
another model falls back to the transformers forward. The logits it returns match
the transformers forward to float rounding (tests compare both in float32 and
bfloat16); they are the rollout policy's logits, which the learner recomputes anyway.

Sources: the Llama architecture (Touvron et al. 2023, arXiv:2302.13971: pre-norm
RMSNorm, SwiGLU, rotary embeddings of Su et al. 2021, arXiv:2104.09864),
grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245), and transformers'
``modeling_llama`` / ``modeling_qwen2`` / ``modeling_qwen3`` (the references this is
tested against; Qwen3's per-head q/k norm: Qwen Team 2025, "Qwen3 Technical Report",
arXiv:2505.09388, section 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plainrl.models import active_lora_adapters, is_quantized, lora_delta, unwrap

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# model types whose attention normalises each head's query and key (weights [D]) before the rotation
_QK_NORM_MODEL_TYPES = frozenset({"qwen3"})


def _prepack(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] reordered once into oneDNN's blocked layout for :func:`_packed_linear`
    (16: the batch-size hint oneDNN chooses the layout for, a typical decode batch)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _mkldnn_packing_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack linear weights here (CPU builds with mkldnn), checked
    on a tiny product against F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(3, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
        return torch.allclose(_packed_linear(x, _prepack(w)).float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def _lora_factors(linear: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(s * B [out, r], A [r, in]) of each active adapter of a peft LoRA Linear, whose delta
    (peft's ``get_delta_weight``) is then ``s * B @ A``, in the base weight's dtype (s * B
    formed in float32, rounded once); [] without an active adapter. None where
    :func:`lora_delta` is the way: another layer type, ``fan_in_fan_out``, or DoRA."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    active = active_lora_adapters(linear)
    if not active:
        return []
    w = linear.base_layer.weight
    if (type(linear) is not LoraLinear or linear.fan_in_fan_out
            or any(linear.use_dora.get(a, False) for a in active)):
        return None
    return [((linear.lora_B[a].weight.float() * linear.scaling[a]).to(w.dtype), linear.lora_A[a].weight.to(w.dtype))
            for a in active]


@dataclass
class _Projection:
    """One fused projection ``y = x W^T + bias`` [.., out], with its LoRA adapters either folded
    into ``weight`` or kept unmerged: ``y = x W^T + bias + (x A^T) (s B)^T``.

    Why unmerged for 16-bit weights: W + s B A rounded to bfloat16 keeps 8 bits of mantissa
    at the scale of W, so an update smaller than half of W's spacing (2^-9 |W|) is rounded
    away and larger ones are quantised; the engine then samples a policy the learner (peft's
    unmerged forward, ``W x + s B (A x)``) is not training (on a tiny Llama with peaked logits
    in bfloat16, through 20 GRPO updates at the demo's lr: 0.04-0.06 nats mean |engine -
    learner| logprob folded, at most 3e-4 unmerged; tests/test_engine_precision.py). vLLM
    applies LoRA unmerged too. Float32 keeps 24 bits, so its fold is exact to ~1e-7 and saves
    the small products (unmerged: 1.06-1.10x the decode step's CPU time, docs/engines.md).

    Unmerged, the A of every part (and every active adapter) is stacked under W, so x A^T
    comes out of the same matmul as x W^T ([.., out + R]: R = the summed ranks); ``lora_b``
    [out, R] is block-diagonal (each part's s B in its own rows and rank columns, zeros
    elsewhere, which add exact zeros), so the LoRA path is one more product of inner size R.
    Both products round as peft's ``lora_B(lora_A(x))`` does.
    """

    weight: torch.Tensor  # [out + R, in] (R = 0 when merged)
    bias: torch.Tensor | None  # [out + R]
    lora_b: torch.Tensor | None = None  # [out, R]: s * B of each part, block-diagonal; None when merged

    @property
    def rank(self) -> int:
        return 0 if self.lora_b is None else self.lora_b.shape[1]


@torch.no_grad()
def _fused_weight(linears: list[torch.nn.Module]) -> torch.Tensor:
    """The weights of ``linears`` stacked along the output dimension, [sum out, in], each with
    its active LoRA adapters folded in (W + s * B @ A), without changing the modules; one
    plain layer's own weight is returned as it is.

    Each part is written once, into the rows of one new tensor (W + s B @ A as one addmm):
    ``torch.cat`` of ``W + lora_delta`` would write the delta, the sum and the stack each in
    full, and the decoder is rebuilt after every update (on a CPU those copies of the whole
    model were 40% of the build's time).
    """
    weights = [getattr(m, "base_layer", m).weight for m in linears]
    factors = [_lora_factors(m) for m in linears]
    if len(linears) == 1 and factors[0] == []:
        return weights[0]
    out = torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype=weights[0].dtype,
                      device=weights[0].device)
    row = 0
    for m, w, f in zip(linears, weights, factors):
        dest = out[row:row + w.shape[0]]
        row += w.shape[0]
        if f is None:
            torch.add(w, lora_delta(m), out=dest)
        elif not f:
            dest.copy_(w)
        elif w.device.type == "cpu" and w.dtype != torch.float32:
            # a 16-bit matmul is ~70x slower than float32 on a CPU without native bf16: B @ A in
            # float32, the sum rounded once
            dest.copy_(sum((b.float() @ a.float() for b, a in f), w.float()))
        else:
            torch.addmm(w, *f[0], out=dest)
            for b, a in f[1:]:
                dest.addmm_(b, a)
    return out


@torch.no_grad()
def _projection(linears: list[torch.nn.Module], *, merge: bool) -> _Projection:
    """The fused :class:`_Projection` of ``linears`` (which share their input), their LoRA
    adapters folded in (``merge``) or unmerged. A part that is not a plain peft LoRA Linear
    (:func:`_lora_factors` None) is folded either way."""
    biases = [getattr(m, "base_layer", m).bias for m in linears]
    bias = None if biases[0] is None else torch.cat(biases) if len(biases) > 1 else biases[0]
    factors = [_lora_factors(m) for m in linears]
    if merge or not any(factors):
        return _Projection(_fused_weight(linears), bias)
    folded = [m if f is None else getattr(m, "base_layer", m) for m, f in zip(linears, factors)]
    base = _fused_weight(folded)  # [out, in]; only the parts without factors carry a delta
    pairs = [(i, b, a) for i, f in enumerate(factors) for b, a in (f or [])]
    sizes = [getattr(m, "base_layer", m).weight.shape[0] for m in linears]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    rank = sum(a.shape[0] for _, _, a in pairs)
    lora_b = base.new_zeros(base.shape[0], rank)
    col = 0
    for i, b, a in pairs:
        lora_b[starts[i]:starts[i] + sizes[i], col:col + a.shape[0]] = b
        col += a.shape[0]
    weight = torch.cat([base] + [a for _, _, a in pairs])  # [out + R, in]
    if bias is not None:
        bias = torch.cat([bias, bias.new_zeros(rank)])
    return _Projection(weight, bias, lora_b)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (None when it can).

    Args:
        model: a transformers causal LM, possibly peft-wrapped.
    """
    base = unwrap(model)
    if is_quantized(base):
        return "its weights are quantized (model.quantization); the static decoder needs float weights"
    cfg = getattr(base, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        return f"rope_type {rope.get('rope_type')!r} depends on the sequence length"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias"
    decoder = base.get_decoder()
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "layers"):
        return "the decoder has no rotary_emb/layers"
    attn = decoder.layers[0].self_attn
    if hasattr(attn, "q_norm") != (model_type in _QK_NORM_MODEL_TYPES):
        return "q/k norms where none are expected (or none where they are)"
    if hasattr(attn, "q_norm") and attn.q_norm.weight.shape != (attn.head_dim,):
        # OLMo-2-style norms over all heads together are a different computation
        return f"q_norm of shape {tuple(attn.q_norm.weight.shape)}, not per head ({attn.head_dim},)"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in decoder.layers):
        return "sliding-window attention"
    return None


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: _Projection  # [(Hq + 2 Hkv) D] from [H]
    qk_norm: torch.Tensor | None  # [Hq + Hkv, 1, D]: q_norm's weight for each query head, k_norm's for each kv head
    o: _Projection  # [H] from [Hq D] (attention_bias=True in Llama/Qwen3 configs biases o_proj too)
    post_norm: torch.Tensor  # [H]
    gate_up: _Projection  # [2 I] from [H]
    down: _Projection  # [H] from [I]


class StaticDecoder:
    """Forward passes of a Llama-family decoder over a KV cache of fixed capacity.

    Built from the model's current weights (with LoRA folded in, or unmerged: ``merge_lora``);
    rebuild it after the weights change. Usage for one batch::

        dec = StaticDecoder(model)
        logits = dec.start(input_ids, valid, capacity)     # prefill: [b, V] next-token logits
        dec.select(rows)                                   # keep/duplicate batch rows
        logits = dec.step(tokens)                          # one token per row: [b, V]

    Every row's sequence occupies the same cache columns: prompts are left-padded
    (``valid`` False on padding), and each step appends one column for all rows.

    Args:
        model: a supported transformers causal LM (:func:`unsupported_reason`),
            possibly peft-wrapped.
        prepack: prepack the weights for oneDNN (CPU only; None: when it works here).
        sdpa: attention through ``torch.nn.functional.scaled_dot_product_attention`` (fused
            kernels, no materialised float32 scores [b, Hq, s, C]); None: on CUDA only, since on
            CPU the grouped matmuls below were measured as the faster decode (docs/benchmarks.md).
        merge_lora: fold LoRA adapters into the fused weights (True) or keep them unmerged
            (False, :class:`_Projection`); None: fold float32 weights only, since a 16-bit fold
            rounds the update away.

    Raises:
        ValueError: the model is not supported (the message says why).
    """

    def __init__(self, model: torch.nn.Module, *, prepack: bool | None = None, sdpa: bool | None = None,
                 merge_lora: bool | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"StaticDecoder does not support this model: {reason}")
        base = unwrap(model)
        cfg = base.config
        decoder = base.get_decoder()
        self.decoder = decoder
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        self.embed = decoder.embed_tokens.weight  # [V, H]
        self.final_norm = decoder.norm.weight
        dev, dtype = self.embed.device, self.embed.dtype
        self.merge_lora = dtype == torch.float32 if merge_lora is None else merge_lora
        fuse = lambda *linears: _projection(list(linears), merge=self.merge_lora)  # noqa: E731
        self.lm_head = fuse(base.get_output_embeddings())  # [V] from [H]
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer in decoder.layers:
                a, m = layer.self_attn, layer.mlp
                qk_norm = None
                if hasattr(a, "q_norm"):
                    qk_norm = torch.cat([a.q_norm.weight.expand(self.num_heads, -1),
                                         a.k_norm.weight.expand(self.num_kv_heads, -1)])[:, None, :]
                self.layers.append(_Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=fuse(a.q_proj, a.k_proj, a.v_proj), qk_norm=qk_norm, o=fuse(a.o_proj),
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=fuse(m.gate_proj, m.up_proj), down=fuse(m.down_proj),
                ))
        self.sdpa = dev.type == "cuda" if sdpa is None else sdpa
        if prepack is None:
            prepack = dev.type == "cpu" and _mkldnn_packing_works(dtype)
        self.linear = F.linear
        if prepack:
            self.linear = _packed_linear
            for proj in [self.lm_head] + [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]:
                proj.weight = _prepack(proj.weight)
                if proj.lora_b is not None:
                    proj.lora_b = _prepack(proj.lora_b)
        self.k_cache = self.v_cache = None  # [L, b, Hkv, C, D]
        self.valid = None  # [b, C] bool: columns holding a real token
        self.positions = None  # [b] position id of each row's next token
        self.length = 0  # columns filled

    def _project(self, x: torch.Tensor, proj: _Projection) -> torch.Tensor:
        """``x`` [.., in] through ``proj``: [.., out]."""
        y = self.linear(x, proj.weight, proj.bias)
        if proj.lora_b is None:
            return y
        y, xa = y.split([y.shape[-1] - proj.rank, proj.rank], dim=-1)  # x W^T + bias, x A^T
        return y + self.linear(xa.contiguous(), proj.lora_b)

    @property
    def capacity(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[3]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as LlamaRMSNorm: normalised in float32, then scaled in the model's dtype
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _rope_tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.decoder.rotary_emb(like, positions)  # [b, s, D] each
        return cos[:, None], sin[:, None]  # broadcast over heads

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run ``input_ids`` [b, s] at cache columns [length, length + s) (``self.valid``
        already covers them); returns the float32 logits of the last column, [b, V]."""
        b, s = input_ids.shape
        start, end = self.length, self.length + s
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = hq // hkv
        h = F.embedding(input_ids, self.embed)  # [b, s, H]
        cos, sin = self._rope_tables(positions, h)
        # additive mask over the filled columns: padding, and causality inside the new block
        keep = self.valid[:, None, :end].expand(b, s, end)  # [b, s, end]
        if s > 1:
            causal = torch.ones(s, end, dtype=torch.bool, device=h.device).tril(diagonal=start)
            # a padding query sees at least itself: an all -inf row would give NaN, and 0 * NaN
            # in a later probs @ values would reach the real rows
            own = torch.zeros(s, end, dtype=torch.bool, device=h.device)
            own[:, start:end] = torch.eye(s, dtype=torch.bool, device=h.device)
            keep = (keep & causal) | own
        mask = None
        if not self.sdpa:
            mask = torch.zeros(keep.shape, dtype=torch.float32, device=h.device).masked_fill_(~keep, float("-inf"))
            mask = mask[:, None, None]  # [b, 1, 1, s, end]
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            qkv = self._project(x, layer.qkv)  # [b, s, (hq + 2 hkv) d]
            qk, v = qkv.view(b, s, hq + 2 * hkv, d).transpose(1, 2).split([hq + hkv, hkv], dim=1)
            if layer.qk_norm is not None:  # Qwen3: RMSNorm over each head's D features, before RoPE
                qk = self._rms_norm(qk, layer.qk_norm)
            q, k = self._rotate(qk, cos, sin).split([hq, hkv], dim=1)  # one rotation for both
            self.k_cache[i, :, :, start:end] = k
            self.v_cache[i, :, :, start:end] = v
            keys, values = self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end]  # [b, hkv, end, d]
            if self.sdpa:  # the mask as booleans [b, 1, s, end]; kv heads shared by enable_gqa, not repeated
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep[:, None], scale=self.scaling,
                                                     enable_gqa=g > 1)  # [b, hq, s, d]
            else:
                # grouped-query attention without repeating keys: the g query heads of a kv head share its rows
                qg = (q * self.scaling).reshape(b, hkv, g * s, d)
                scores = torch.matmul(qg, keys.transpose(2, 3)).view(b, hkv, g, s, end)
                probs = torch.softmax(scores.float() + mask, dim=-1).to(q.dtype)
                out = torch.matmul(probs.view(b, hkv, g * s, end), values)  # [b, hkv, g s, d]
            out = out.view(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)
            h = h + self._project(out, layer.o)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = self._project(x, layer.gate_up).chunk(2, dim=-1)
            h = h + self._project(F.silu(gate) * up, layer.down)
        self.length = end
        last = self._rms_norm(h[:, -1], self.final_norm)  # [b, H]
        return self._project(last, self.lm_head).float()

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        """Allocate the cache and prefill left-padded prompts.

        Args:
            input_ids: [b, s] prompt ids, left-padded.
            valid: [b, s] bool, False on padding.
            capacity: cache columns (at least s plus the tokens to decode).
        Returns:
            [b, V] float32 logits of each row's next token.
        Raises:
            ValueError: capacity below the prompt width.
        """
        b, s = input_ids.shape
        if capacity < s:
            raise ValueError(f"capacity {capacity} is below the prompt width {s}")
        dtype, dev = self.embed.dtype, self.embed.device
        shape = (len(self.layers), b, self.num_kv_heads, capacity, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=dev)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=dev)
        self.valid = torch.zeros(b, capacity, dtype=torch.bool, device=dev)
        self.valid[:, :s] = valid
        self.length = 0
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [b, s]
        logits = self._forward(input_ids, positions)
        self.positions = positions[:, -1] + 1
        return logits

    def release(self) -> None:
        """Free the KV cache (the weights stay)."""
        self.k_cache = self.v_cache = self.valid = self.positions = None
        self.length = 0

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) batch rows: the cache becomes ``cache[rows]``.

        Args:
            rows: [b'] long indices into the current batch.
        """
        self.k_cache = self.k_cache.index_select(1, rows)
        self.v_cache = self.v_cache.index_select(1, rows)
        self.valid = self.valid.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row and return the next-token logits.

        Args:
            tokens: [b] token ids.
        Returns:
            [b, V] float32 logits.
        Raises:
            ValueError: the cache is full.
        """
        if self.length >= self.capacity:
            raise ValueError(f"the KV cache is full ({self.capacity} columns)")
        self.valid[:, self.length] = True
        logits = self._forward(tokens[:, None], self.positions[:, None])
        self.positions = self.positions + 1
        return logits
