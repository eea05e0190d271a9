"""The protobuf half of Tinker's wire format, through the SDK's own generated messages
(``tinker.proto.tinker_public_pb2``): ``forward_backward`` requests arrive as protobuf, and the
SDK reads ``ForwardBackwardOutput`` and ``SampleResponse`` results only as protobuf (it sends
``Accept: application/x-protobuf`` when it polls them). Everything else is JSON of the SDK's
pydantic types (see :mod:`plainrl.tinker.routes`).

The encoders are the inverses of the SDK's ``tinker/proto/response_conv.py`` readers, the decoder
the inverse of its ``request_conv.py`` writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from plainrl.tinker.errors import UserError
from plainrl.tinker.stability import Span

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class DatumArrays:
    """One ``types.Datum`` decoded: ``tokens`` [N] int64 (the model input's text chunks joined),
    its ``loss_fn_inputs`` as numpy arrays with their shapes, and the provenance of its targets
    (``loss_fn_input_spans``; None: the datum has none)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]
    spans: list[Span] | None = None


def _spans(spans) -> list[Span] | None:
    out = []
    for sp in spans:
        kind = sp.WhichOneof("span")
        arm = getattr(sp, kind)
        out.append(Span("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, arm.offset, arm.length))
    return out or None


@dataclass
class ForwardBackwardCall:
    """A decoded ``/api/v1/forward_backward`` request (``forward_only``: a ``forward`` call)."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[DatumArrays]


def _tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: tensor dtype {msg.dtype} is not float32 or int64")
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        shape = list(msg.shape)
        if len(shape) != 2:
            raise UserError(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
        dense = np.zeros(shape, dtype=dtype)
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        for r in range(shape[0]):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape)
    if shape and int(np.prod(shape)) != arr.size:
        raise UserError(f"{where}: shape {shape} does not hold {arr.size} values")
    return arr.reshape(shape) if shape else arr


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """Parse a protobuf ``ForwardBackwardRequest``.

    Raises:
        UserError: unparsable bytes, a chunk that is not text (images and audio: this service runs
            text models), or a tensor whose shape and data disagree.
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from e
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"data[{i}].model_input: a {chunk.WhichOneof('chunk')} chunk; this service "
                                "takes token chunks only (text models)")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        inputs = {k: _tensor(v, f"data[{i}].loss_fn_inputs[{k!r}]") for k, v in d.loss_fn_inputs.items()}
        data.append(DatumArrays(tokens, inputs, _spans(d.loss_fn_input_spans)))
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise UserError(f"loss_fn_config[{k!r}]={v.text!r}: this service's losses take numbers only")
        config[k] = float(v.number)
    return ForwardBackwardCall(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: one ``ArrayRecord`` whose fields hold every datum's
    [N_i] (or [N_i, K]: the field's ``trailing_shape``, the same for every datum) float32 array back
    to back, with byte offsets (N_i may differ per datum)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.trailing_shape.extend(np.shape(outputs[0][name])[1:])
        bt.dtype = pb.DTYPE_FLOAT32
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
    return msg.SerializeToString()


_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: np.ndarray | None,
                           topk: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """A protobuf ``SampleResponse``: per sequence (token ids, their logprobs, ``stop``|``length``),
    the prompt's logprobs [P] float32 (NaN where none was computed) when asked for, and the
    prompt's top-k ``(ids [P, k] int32, logprobs [P, k] float32)`` (``topk_prompt_logprobs``)."""
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = _STOP[reason]
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk is not None:
        ids, lps = topk
        msg.topk_prompt_logprobs.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
        msg.topk_prompt_logprobs.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
        msg.topk_prompt_logprobs.length, msg.topk_prompt_logprobs.k = ids.shape
    return msg.SerializeToString()
