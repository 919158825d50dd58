"""The Tinker SDK's wire formats, both ways: a ``forward_backward`` request arrives as protobuf (zstd-compressed
when ``client/config`` asks for it), its result and a sample's go back as protobuf, in the schema the SDK
ships (``tinker.proto.tinker_public_pb2``, so the two can never disagree); the rest is JSON. Requests become
the plain values below (``Datum``, ``SampleAsk``), checked here, so the workbench never sees the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.responses import JSONResponse, Response

from agentjet_server.errors import InvalidRequestError, PayloadTooLargeError

PROTOBUF = "application/x-protobuf"
MAX_BODY = 256 * 1024 * 1024  # a forward_backward body, decompressed
FLOAT_INPUTS = {"weights", "advantages", "logprobs", "mask", "clip_low_threshold", "clip_high_threshold"}


def schema() -> Any:
    """The SDK's protobuf module (``agentjet-server[tinker]`` installs the SDK)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:  # pragma: no cover - the extra is part of every test environment
        raise InvalidRequestError(
            "this server speaks the Tinker API only with the tinker package: pip install 'agentjet-server[tinker]'"
        ) from exc
    return tinker_public_pb2


@dataclass(frozen=True)
class Span:
    """Where a run of a datum's tokens came from: a sampled sequence's prompt or its sampled tokens."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, dense, in their shapes
    input_spans: list[Span] | None = None
    target_spans: list[Span] | None = None


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool = False


@dataclass
class SampleAsk:
    """One ``asample`` request: the prompt, how many sequences and how to sample them, what to score."""

    prompt: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: list[int] | None = None  # None: the model's end-of-sequence token stops
    stop_strings: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt: int = 0
    topk_sample: int = 0  # every sequence is kept for stable_reinforce, whether or not the client records them


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise InvalidRequestError(f"Content-Encoding {encoding!r} is not supported here: send zstd or none")
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY)
    except zstandard.ZstdError as exc:
        raise InvalidRequestError(f"the zstd body does not decompress: {exc}") from exc


def forward_backward_from_proto(body: bytes) -> ForwardBackward:
    pb = schema()
    if len(body) > MAX_BODY:
        raise PayloadTooLargeError(f"the forward_backward body is {len(body)} bytes; at most {MAX_BODY}")
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise InvalidRequestError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = [_datum_from_proto(pb, d, i) for i, d in enumerate(message.data)]
    return ForwardBackward(message.model_id, int(message.seq_id), message.loss_fn, config, data, message.forward_only)


def _datum_from_proto(pb: Any, datum: Any, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"datum {index}: a {kind} chunk; this server trains on text tokens only (EncodedTextChunk)"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: _tensor(pb, tensor, f"datum {index}: {name}") for name, tensor in datum.loss_fn_inputs.items()}
    return Datum(tokens, inputs, _spans(datum.model_input_spans), _spans(datum.loss_fn_input_spans))


def _spans(spans: Any) -> list[Span] | None:
    if not len(spans):
        return None
    out = []
    for span in spans:
        kind = span.WhichOneof("span")
        run = getattr(span, kind)
        out.append(Span(kind == "sampled_tokens", run.sequence_id, int(run.offset), int(run.length)))
    return out


def _tensor(pb: Any, tensor: Any, what: str) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    dtype = dtypes.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequestError(f"{what}: tensors are float32, int64 or int32 here (dtype {tensor.dtype})")
    shape = [int(s) for s in tensor.shape]
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if (
            len(shape) != 2
            or len(crow) != shape[0] + 1
            or len(col) != len(values)
            or (len(col) and col.max() >= shape[1])
        ):
            raise InvalidRequestError(f"{what}: a sparse tensor whose indices do not fit its shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    array = np.frombuffer(tensor.dense, dtype=dtype)
    if shape:
        if math.prod(shape) != array.size:
            raise InvalidRequestError(f"{what}: {array.size} values for the shape {shape}")
        array = array.reshape(shape)
    return array.copy()


def datum_from_json(value: Any, index: int) -> Datum:
    """A datum in the SDK's JSON shape (``model_input.chunks``, ``loss_fn_inputs`` of TensorData)."""
    if not isinstance(value, dict) or not isinstance(value.get("model_input"), dict):
        raise InvalidRequestError(f"datum {index} needs model_input and loss_fn_inputs")
    tokens: list[int] = []
    for chunk in value["model_input"].get("chunks") or []:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidRequestError(f"datum {index}: this server trains on text tokens only (encoded_text chunks)")
        tokens.extend(int(t) for t in chunk.get("tokens") or [])
    inputs: dict[str, np.ndarray] = {}
    for name, tensor in (value.get("loss_fn_inputs") or {}).items():
        dtype = np.int64 if tensor.get("dtype") == "int64" else np.float32
        array = np.asarray(tensor.get("data") or [], dtype=dtype)
        shape = tensor.get("shape")
        inputs[name] = array.reshape(shape) if shape else array
    return Datum(tokens, inputs)


def sample_ask(body: dict[str, Any]) -> SampleAsk:
    """A ``SampleRequest`` (JSON), checked."""
    prompt = body.get("prompt")
    if not isinstance(prompt, dict):
        raise InvalidRequestError('"prompt" must be a ModelInput ({"chunks": [{"tokens": [...]}]})', param="prompt")
    tokens = datum_from_json({"model_input": prompt}, 0).tokens
    if not tokens:
        raise InvalidRequestError("the prompt has no tokens", param="prompt")
    for unsupported in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
        if body.get(unsupported):
            raise InvalidRequestError(f'"{unsupported}" is not supported by this server', param=unsupported)
    params = body.get("sampling_params") or {}
    stop = params.get("stop")
    ask = SampleAsk(
        prompt=tokens,
        num_samples=_int(body.get("num_samples", 1), "num_samples", 1, 256),
        max_tokens=_int(params.get("max_tokens") or 16, "max_tokens", 1, 1 << 20),
        temperature=float(params.get("temperature", 1.0)),
        top_k=int(params.get("top_k", -1)),
        top_p=float(params.get("top_p", 1.0)),
        seed=params.get("seed"),
        prompt_logprobs=bool(body.get("prompt_logprobs")),
        prompt_logprobs_last_n=body.get("prompt_logprobs_last_n"),
        topk_prompt=_int(body.get("topk_prompt_logprobs") or 0, "topk_prompt_logprobs", 0, 64),
        topk_sample=_int(body.get("topk_sample_logprobs") or 0, "topk_sample_logprobs", 0, 64),
    )
    if isinstance(stop, list) and not stop:  # none at all, not even the end-of-sequence token
        ask.stop_tokens = []
    elif isinstance(stop, str):
        ask.stop_strings = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        ask.stop_strings = list(stop)
    elif isinstance(stop, list):
        ask.stop_tokens = [int(s) for s in stop]
    if not ask.temperature >= 0 or not 0 < ask.top_p <= 1:
        raise InvalidRequestError("temperature must be at least 0 and top_p in (0, 1]", param="sampling_params")
    last_n = ask.prompt_logprobs_last_n
    if last_n is not None and not 1 <= int(last_n) <= len(tokens) - 1:
        raise InvalidRequestError(f"prompt_logprobs_last_n must be between 1 and {len(tokens) - 1}")
    return ask


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f'"{name}" must be an integer from {low} to {high} (got {value!r})', param=name)
    return value


# ----------------------------------------------------------------------------------------------- answers


def forward_backward_proto(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one record of every datum's output arrays (each field a batched tensor)."""
    pb = schema()
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        sizes = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = sizes.tobytes()
        batched.dtype = pb.DTYPE_FLOAT32
    return bytes(message.SerializeToString())


def forward_backward_json(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> dict[str, Any]:
    def tensor(a: np.ndarray) -> dict[str, Any]:
        return {"data": a.astype(np.float32).ravel().tolist(), "dtype": "float32", "shape": list(a.shape)}

    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [{name: tensor(a) for name, a in o.items()} for o in outputs],
        "metrics": metrics,
    }


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # a stop token or string ended it (else max_tokens did)
    topk: tuple[np.ndarray, np.ndarray] | None = None  # (ids [n, k], logprobs [n, k])


@dataclass
class SampleResult:
    sequences: list[Sampled]
    prompt_logprobs: np.ndarray | None = None  # NaN where not scored (the first token)
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None


def sample_proto(result: SampleResult) -> bytes:
    pb = schema()
    message = pb.SampleResponse()
    for seq in result.sequences:
        out = message.sequences.add()
        out.stop_reason = pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk is not None:
            _topk(out.topk_sampled_logprobs, seq.topk)
    if result.prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype=np.float32).tobytes()
    if result.topk_prompt is not None:
        _topk(message.topk_prompt_logprobs, result.topk_prompt)
    return bytes(message.SerializeToString())


def _topk(target: Any, topk: tuple[np.ndarray, np.ndarray]) -> None:
    ids, logprobs = topk
    target.length, target.k = int(ids.shape[0]), int(ids.shape[1]) if ids.ndim == 2 else 0
    target.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    target.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()


def sample_json(result: SampleResult) -> dict[str, Any]:
    def nan_none(a: np.ndarray) -> list[float | None]:
        return [None if math.isnan(x) else float(x) for x in a.tolist()]

    return {
        "type": "sample",
        "sequences": [
            {"stop_reason": "stop" if s.stopped else "length", "tokens": s.tokens, "logprobs": s.logprobs}
            for s in result.sequences
        ],
        "prompt_logprobs": None if result.prompt_logprobs is None else nan_none(result.prompt_logprobs),
    }


def forward_backward_from_json(body: dict[str, Any]) -> ForwardBackward:
    """A forward_backward (or forward) request in JSON, for clients that do not send protobuf."""
    given = body.get("forward_backward_input") or body.get("forward_input") or {}
    data = [datum_from_json(d, i) for i, d in enumerate(given.get("data") or [])]
    config = {k: (v if isinstance(v, str) else float(v)) for k, v in (given.get("loss_fn_config") or {}).items()}
    return ForwardBackward(
        str(body.get("model_id")), int(body.get("seq_id") or 0), str(given.get("loss_fn")), config, data
    )


def render(result: Any, proto: bool) -> Response:
    """A finished future's answer: forward/backward outputs and samples as protobuf when the client accepts it
    (the SDK always does, and refuses JSON there), else JSON; the rest JSON."""
    if isinstance(result, tuple) and result[0] == "forward_backward":
        if proto:
            return Response(forward_backward_proto(*result[1:]), media_type=PROTOBUF)
        return JSONResponse(forward_backward_json(*result[1:]))
    if isinstance(result, tuple) and result[0] == "sample":
        return Response(sample_proto(result[1]), media_type=PROTOBUF) if proto else JSONResponse(sample_json(result[1]))
    return JSONResponse(result)
