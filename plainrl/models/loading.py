"""Loading the policy: a transformers causal LM from a directory, a hub id, a ``.gguf``
file or the embedded default ``smollm2-135m-instruct``; dtype; LoRA via peft; saving it.

GGUF files are dequantised once per machine into plainrl's content-keyed cache
(:mod:`plainrl.models.gguf`, :mod:`plainrl.models.cache`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from pathlib import Path

import torch

from plainrl.config import LoraConfig, ModelConfig
from plainrl.durable import remove_stale_siblings, replace_dir, temp_sibling
from plainrl.models.errors import ModelLoadError
from plainrl.models.gguf import EMBEDDED_MODELS, GGUFError, convert_gguf, embedded_gguf
from plainrl.models.portable import BaseModelRef, record_base
from plainrl.models.precision import model_dtype
from plainrl.models.quantization import (
    bnb_config,
    check_support,
    keep_training_layout,
    prepare_for_training,
    quiet_int8_cast,
)

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU.

    Raises:
        ModelLoadError: ``cuda`` asked for but not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device=cuda but torch sees no CUDA device; set device=cpu or device=auto")
    return torch.device(device)


def resolve_model_path(name: str, cache_dir: str | None = None) -> str:
    """Map ``model.name`` to something ``from_pretrained`` accepts (a directory or hub id).

    Raises:
        ModelLoadError: embedded package missing, or an unreadable GGUF file.
    """
    try:
        if name in EMBEDDED_MODELS:
            return str(convert_gguf(embedded_gguf(name), cache_dir, hub_id=EMBEDDED_MODELS[name].hub_id))
        if name.endswith(".gguf"):
            p = Path(name)
            if not p.is_file():
                raise ModelLoadError(f"model.name={name!r}: no such GGUF file")
            return str(convert_gguf(p, cache_dir))
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e
    return name


def _from_pretrained(loader, path: str, **kwargs):
    try:
        return loader.from_pretrained(path, **kwargs)
    except OSError as e:
        where = "local directory" if Path(path).exists() else "local path or hub id (is the hub reachable?)"
        raise ModelLoadError(
            f"model.name={path!r}: could not load it as a {where}: {e}. "
            f"Use a transformers checkpoint directory, a .gguf file, a hub id, or one of {sorted(EMBEDDED_MODELS)}"
        ) from e


def load_tokenizer(name: str, cache_dir: str | None = None):
    """Tokenizer for ``model.name``, with a pad token (EOS when it has none).

    Raises:
        ModelLoadError: as :func:`resolve_model_path`, or the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, resolve_model_path(name, cache_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS (padding is
    always masked out, so any id would do; these keep decoded batches readable)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def apply_lora(model, lora: LoraConfig, *, task_type: str = "CAUSAL_LM"):
    """Wrap ``model`` with LoRA adapters (peft). Only adapter weights stay trainable,
    plus, for ``task_type`` ``TOKEN_CLS``/``SEQ_CLS``, the model's new ``score`` head
    (peft's ``modules_to_save``: trained and saved with the adapter).

    Raises:
        ModelLoadError: a target module name matches no layer; the message lists the
            linear layer names that exist.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=task_type,
    )
    try:
        # Adapters in the model's dtype: peft's default (fp32 adapters on a bf16 model)
        # casts activations at every layer, ~2.5x slower forward on CPU. Precision is
        # kept by the learner's fp32 master weights instead.
        return get_peft_model(model, peft_cfg, autocast_adapter_dtype=False)
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ModelLoadError(
            f"model.lora.target_modules={lora.target_modules!r} does not fit this model ({e}); "
            f"linear layers here: {linear}"
        ) from e


def share_frozen_weights(model: torch.nn.Module, donor: torch.nn.Module) -> int:
    """Make ``model`` use ``donor``'s frozen parameters wherever both have one of the same
    name, shape and dtype, so a second model on the same base (the PPO critic next to a
    LoRA policy) holds no second copy of the base weights.

    Names are compared without peft's wrapping (``base_model.model.``, ``.base_layer``).
    Only frozen donor parameters are shared, so training either model never changes
    the other's weights through them; call it before ``model`` gets its own adapters.
    The engine's merged-LoRA decoding writes into the shared weights during generation
    and restores them exactly afterwards, and nothing else runs meanwhile.

    Returns:
        the number of parameters now shared.
    """
    frozen = {
        name.removeprefix("base_model.model.").replace(".base_layer", ""): p
        for name, p in donor.named_parameters() if not p.requires_grad
    }
    shared = 0
    for name, p in list(model.named_parameters()):
        d = frozen.get(name)
        if d is not None and d.shape == p.shape and d.dtype == p.dtype and d.device == p.device:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, d)
            shared += 1
    return shared


def attention_implementation(requested: str, device: torch.device) -> str:
    """``model.attn_implementation`` for ``device``: ``auto`` is eager on CPU, and on CUDA flash
    attention 2 where ``flash_attn`` imports (packed micro-batches then take its varlen kernel,
    :func:`plainrl.models.packing.packing_route`), else SDPA.

    Raises:
        ModelLoadError: ``flash_attention_2`` off CUDA or without the ``flash-attn`` package.
    """
    import importlib.util

    has_flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        return "eager" if device.type != "cuda" else "flash_attention_2" if has_flash else "sdpa"
    if requested == "flash_attention_2" and not has_flash:
        where = "the flash-attn package is not installed (pip install flash-attn)" if device.type == "cuda" else \
            f"it runs on CUDA only, and this run's device is {device.type}"
        raise ModelLoadError(f"model.attn_implementation=flash_attention_2: {where}; use sdpa or auto")
    return requested


def _load(cfg: ModelConfig, device: torch.device, auto_class, task_type: str, share_with=None,
          reference_adapter: bool = False, meta: bool = False, **kwargs):
    path = resolve_model_path(cfg.name, cfg.cache_dir)
    attn = attention_implementation(cfg.attn_implementation, device)
    dtype = model_dtype(cfg.dtype, device)
    quantized = cfg.quantization != "none"
    if meta:
        return _build_meta(cfg, path, auto_class, task_type, dtype, attn, reference_adapter, **kwargs)
    if quantized:
        log.info(check_support(cfg.quantization, device, dtype))
        if cfg.quantization == "int8":
            quiet_int8_cast()
        # bitsandbytes quantizes while placing the weights; a quantized model refuses .to()
        head = ["score"] if kwargs.get("num_labels") is not None else None  # trained, so kept in float
        kwargs.update(quantization_config=bnb_config(cfg.quantization, dtype, head), device_map={"": device})
    model = _from_pretrained(auto_class, path, dtype=dtype, attn_implementation=attn, **kwargs)
    if not quantized:
        model.to(device)
    elif cfg.quantization == "nf4":
        keep_training_layout(model)
    model.config.use_cache = False  # the learner never needs a cache; the engine passes its own
    if kwargs.get("num_labels") is not None:
        # the new head stays float32: it is small, and values/rewards need the precision
        model.score.float()
    if quantized and cfg.lora.enabled:
        # before sharing: it casts 16-bit norms and embeddings to float32, as it did the donor's
        model = prepare_for_training(model)
    if share_with is not None:
        share_frozen_weights(model, share_with)
    if cfg.adapter is not None:
        model = load_adapter(model, cfg.adapter, lora_enabled=cfg.lora.enabled, reference=reference_adapter)
    elif cfg.lora.enabled:
        model = apply_lora(model, cfg.lora, task_type=task_type)
    model.train()
    return model


def _build_meta(cfg: ModelConfig, path: str, auto_class, task_type: str, dtype: torch.dtype, attn: str,
                reference_adapter: bool, **kwargs):
    """The model :func:`_load` would load, built from its config on the meta device: the same
    modules, names, shapes and dtypes, no weight read and none allocated (FSDP2 fills them
    from rank 0, :meth:`plainrl.train.distributed.Parallel.wrap`). Adapters are made as
    :func:`_load` makes them, so the global RNG advances as it does there."""
    from transformers import AutoConfig

    if cfg.quantization != "none":
        raise ModelLoadError("a model built on the meta device cannot be quantized; use model.quantization=none")
    config = _from_pretrained(AutoConfig, path, **kwargs)  # (num_labels: a config field)
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False
    if kwargs.get("num_labels") is not None:
        model.score.float()
    if cfg.adapter is not None:
        with warnings.catch_warnings():  # its weights are read into meta tensors: a no-op, by design here
            warnings.filterwarnings("ignore", message="for .*: copying from a non-meta parameter")
            model = load_adapter(model, cfg.adapter, lora_enabled=cfg.lora.enabled, reference=reference_adapter)
    elif cfg.lora.enabled:
        model = apply_lora(model, cfg.lora, task_type=task_type)
    empty_weights(model, "meta")  # peft places a second adapter on the CPU
    model.train()
    return model


def empty_weights(model: torch.nn.Module, device: torch.device | str) -> None:
    """Replace every parameter and buffer of ``model`` by an uninitialised one on ``device``
    (the meta device: nothing allocated), in place, keeping dtypes, ``requires_grad`` and
    tied parameters tied (``Module.to("meta")`` and ``to_empty`` untie them between the
    meta device and another). The old tensors are freed unless something else holds them."""
    memo: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                m._parameters[name] = memo[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device=device)
                m._buffers[name] = memo[id(b)]


# peft's name of the adapter a run trains (get_peft_model and PeftModel.from_pretrained use it)
TRAINED_ADAPTER = "default"
# a frozen second copy of model.adapter: the KL / DPO reference of a run that starts from an adapter
REFERENCE_ADAPTER = "reference"


def load_adapter(model, adapter: str | Path, *, lora_enabled: bool = True, reference: bool = False):
    """Wrap ``model`` with a saved peft LoRA adapter, trainable, in the model's dtype
    (as :func:`apply_lora`): how an RL run starts from an SFT run's ``final/``.

    Args:
        reference: also load the adapter a second time, frozen, as :data:`REFERENCE_ADAPTER`:
            the reference policy of :func:`reference_policy` is then the policy the run
            starts from (base + this adapter), as a KL penalty or DPO means it (Ouyang et
            al. 2022; Rafailov et al. 2023: the SFT model), not the base model under it.
            TRL's DPOTrainer does the same with ``ref_adapter_name``. Costs one more copy
            of the adapter's weights.

    Raises:
        ModelLoadError: LoRA is off, the directory is missing or holds no adapter.
    """
    from peft import PeftModel

    path = Path(adapter)
    if not lora_enabled:
        raise ModelLoadError(f"model.adapter={str(adapter)!r} needs model.lora.enabled=true")
    if not (path / "adapter_config.json").is_file():
        raise ModelLoadError(
            f"model.adapter={str(adapter)!r}: no adapter_config.json there; give a peft adapter directory "
            "such as a LoRA run's RUN_DIR/final"
        )
    model = PeftModel.from_pretrained(model, str(path), is_trainable=True, autocast_adapter_dtype=False)
    if reference:
        model.load_adapter(str(path), adapter_name=REFERENCE_ADAPTER, is_trainable=False,
                           autocast_adapter_dtype=False)
    return model


@contextlib.contextmanager
def adapter_policy(model: torch.nn.Module, adapter: str | None):
    """Within this context the LoRA ``model`` computes with its frozen adapter ``adapter``
    instead of the trained one, or with none (``adapter=None``: the base, adapters disabled).

    The switch sets the active adapter of each LoRA layer directly: peft's ``set_adapter``
    would also flip ``requires_grad`` of the trained adapter, which DDP and FSDP2 registered.

    Raises:
        KeyError: ``adapter`` is not loaded on ``model``.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    if adapter is None:
        with model.disable_adapter():
            yield
        return
    if adapter not in getattr(model, "peft_config", {}):
        raise KeyError(f"no adapter {adapter!r} on the model (loaded: {sorted(getattr(model, 'peft_config', {}))})")
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    saved = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = [adapter]
        yield
    finally:
        for m, active in zip(layers, saved):
            m._active_adapter = active


def reference_policy(model: torch.nn.Module):
    """A context within which ``model`` computes the reference policy of a LoRA run: with a
    :data:`REFERENCE_ADAPTER` loaded (a run from ``model.adapter``), that adapter instead of
    the trained one; otherwise the base model (adapters disabled). A model without adapters
    is left as it is (full fine-tuning keeps a frozen copy instead). See :func:`adapter_policy`."""
    if REFERENCE_ADAPTER in getattr(model, "peft_config", {}):
        return adapter_policy(model, REFERENCE_ADAPTER)
    if hasattr(model, "disable_adapter"):
        return adapter_policy(model, None)
    return contextlib.nullcontext()


def load_frozen_adapter(model: torch.nn.Module, adapter: str | Path, name: str) -> None:
    """Load the peft adapter directory ``adapter`` onto the LoRA ``model`` as a second, frozen
    adapter called ``name`` (a distillation teacher on the policy's base: one copy of the base
    weights), used through :func:`adapter_policy`.

    Raises:
        ModelLoadError: ``model`` has no LoRA adapters, or the directory holds no adapter.
    """
    path = Path(adapter)
    if not hasattr(model, "load_adapter"):
        raise ModelLoadError(f"cannot add the adapter {str(adapter)!r} to a model without LoRA; enable model.lora")
    if not (path / "adapter_config.json").is_file():
        raise ModelLoadError(f"{str(adapter)!r}: no adapter_config.json there; give a peft adapter directory "
                             "such as a LoRA run's RUN_DIR/final")
    model.load_adapter(str(path), adapter_name=name, is_trainable=False, autocast_adapter_dtype=False)


def load_policy(cfg: ModelConfig, device: torch.device, *, reference_adapter: bool = False, meta: bool = False):
    """Load the policy (with LoRA when enabled) in ``cfg.dtype`` on ``device``; with
    ``cfg.quantization`` the base's linear layers are quantized by bitsandbytes (QLoRA,
    :mod:`plainrl.models.quantization`) and only the adapters train.

    Args:
        reference_adapter: the run computes a reference policy (a KL term, DPO): with
            ``cfg.adapter``, also load it frozen as that reference (:func:`load_adapter`).
        meta: build it from its config on the meta device instead, reading no weights (a
            rank other than 0 under FSDP2, which receives its shards from rank 0).

    Returns:
        the model (a peft ``PeftModel`` under LoRA, else the transformers model), in train mode.

    Raises:
        ModelLoadError: see :func:`resolve_model_path`, :func:`apply_lora` and
            :func:`plainrl.models.quantization.check_support`.
    """
    from transformers import AutoModelForCausalLM

    return _load(cfg, device, AutoModelForCausalLM, "CAUSAL_LM", reference_adapter=reference_adapter, meta=meta)


def load_value_model(cfg: ModelConfig, device: torch.device, *, per_token: bool, share_with=None,
                     meta: bool = False):
    """A value model: the backbone of ``cfg.name`` with a new linear head ``score``
    (hidden -> 1, float32), LoRA per ``cfg.lora`` with the head trained beside it.

    ``per_token=True`` loads ``AutoModelForTokenClassification`` (a critic: one value per
    position), ``False`` ``AutoModelForSequenceClassification`` (a reward model: one score
    per sequence). Both are standard transformers classes, so a saved value model loads
    without plainrl; read values with :func:`plainrl.models.token_values` /
    :func:`plainrl.models.sequence_scores`.

    ``share_with``: a model on the same base whose frozen weights this one reuses
    (:func:`share_frozen_weights`); pass it only when both train adapters, not full weights.
    ``meta``: as :func:`load_policy`'s.

    Raises:
        ModelLoadError: as :func:`load_policy`, or the architecture has no such head class.
    """
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from transformers.utils import logging as hf_logging

    auto, task = (AutoModelForTokenClassification, "TOKEN_CLS") if per_token else (
        AutoModelForSequenceClassification, "SEQ_CLS")
    # transformers warns at length that `score` is newly initialised: here that is the point
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _load(cfg, device, auto, task, share_with=share_with, meta=meta, num_labels=1)
    except ValueError as e:  # transformers: "Unrecognized configuration class ... for this kind of AutoModel"
        raise ModelLoadError(f"model {cfg.name!r} has no {auto.__name__} head: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def active_lora_adapters(linear: torch.nn.Module) -> list[str]:
    """Names of the LoRA adapters a peft layer applies in its forward; [] for a plain layer,
    a merged one (its deltas are in the base weight) or one with adapters disabled."""
    if getattr(linear, "base_layer", None) is None or getattr(linear, "merged", False):
        return []
    if getattr(linear, "disable_adapters", False):
        return []
    return [a for a in linear.active_adapters if a in linear.lora_A]


def lora_delta(linear: torch.nn.Module) -> torch.Tensor | None:
    """The summed delta ``s * B @ A`` [out, in] of a peft LoRA layer's active adapters, in
    its base weight's dtype; None for a plain layer, a merged one, or no active adapter."""
    active = active_lora_adapters(linear)
    if not active:
        return None
    return sum(linear.get_delta_weight(a) for a in active).to(linear.base_layer.weight.dtype)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """Parameters with ``requires_grad`` (the adapters under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def save_policy(model, tokenizer, directory: str | Path, *, base: BaseModelRef | None = None,
                card: str | None = None, state_dict: dict | None = None, adapter: str = TRAINED_ADAPTER) -> Path:
    """Save the policy in Hugging Face format: a peft adapter directory under LoRA
    (loadable with ``PeftModel.from_pretrained(base, dir)``), else full safetensors
    weights (``AutoModelForCausalLM.from_pretrained(dir)``). Written to a temporary
    directory and swapped in whole (:func:`plainrl.durable.replace_dir`), so a kill at any
    moment leaves the old model or the new one in ``directory``, never half or none.

    Args:
        base: what the model was trained on; the adapter then names it portably (its hub
            id, not a cache path: :func:`plainrl.models.portable.record_base`).
        card: the model card (``README.md``), replacing the one peft writes.
        state_dict: the weights to write instead of the model's own (FSDP2: the gathered
            full tensors).
        adapter: which of a peft model's adapters to save (``plainrl tinker`` holds one per
            training client); written at the top of ``directory`` whatever its name.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(directory)  # what a killed save left
    tmp = temp_sibling(directory)
    tmp.mkdir()
    try:
        kwargs = {} if state_dict is None else {"state_dict": state_dict}
        if hasattr(model, "peft_config") and adapter != TRAINED_ADAPTER:
            _save_named_adapter(model, adapter, tmp)
        else:
            if hasattr(model, "peft_config"):  # the trained adapter, not the frozen reference copy
                kwargs["selected_adapters"] = [TRAINED_ADAPTER]
            model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
        if base is not None:
            record_base(tmp, base)
        if card is not None:
            (tmp / "README.md").write_text(card)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        return replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_named_adapter(model, name: str, directory: Path) -> None:
    """Adapter ``name`` as a peft adapter directory in ``directory`` itself (peft's own
    ``save_pretrained`` puts an adapter not named ``default`` in a subdirectory of that name)."""
    from safetensors.torch import save_file

    from plainrl.models.named_adapters import WEIGHTS_FILE, state_dict

    model.peft_config[name].save_pretrained(str(directory))
    save_file({k: v.detach().contiguous() for k, v in state_dict(model, name).items()}, str(directory / WEIGHTS_FILE))
