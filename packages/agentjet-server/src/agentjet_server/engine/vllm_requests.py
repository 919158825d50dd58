"""The requests the vLLM engine runs: added to vLLM, their outputs turned into tokens, aborted, failed.

``RequestBook`` is the engine thread's ledger: the requests vLLM is running (``live``) and those that
arrived while the engine slept (``held``, added once it is awake). A request goes in with its
sampling parameters in vLLM's terms and a prefix-cache salt of the weights' version; each step's
output comes back as ``TokenEvent``s tagged with the version of the weights that produced them (or,
serving a LoRA adapter, the version of the adapter the request started on, to its end).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentjet_server.engine.base import FinishReason, SamplingParams, TokenEvent
from agentjet_server.engine.grammar import json_schema
from agentjet_server.engine.handoff import TokenStream
from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.engine.vllm_adapters import AdapterBook
from agentjet_server.errors import EngineError, InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class VLLMRequest(TokenStream):
    """One completion in the vLLM engine: its id in vLLM, prompt, parameters and what it sampled so far."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    adapter: int | None = None  # serving LoRA adapters: the version of the one this request runs on (of its name)


def prompt_logprobs(request: VLLMRequest, output: Any) -> list[float] | None:
    """The log-probability of each prompt token after the first, from a request's first output, if it asked."""
    if not request.params.prompt_logprobs:
        return None
    entries = list(output.prompt_logprobs or [])[1:]  # the first token has none
    ids = request.prompt_ids[1:]
    if len(entries) != len(ids):
        raise EngineError(f"vLLM scored {len(entries)} of the prompt's {len(ids)} tokens after the first")
    return [float(entry[token].logprob) for entry, token in zip(entries, ids, strict=True)]


class RequestBook:
    """The requests of one vLLM ``LLMEngine``, in the engine thread: ``live`` by id, and ``held``."""

    def __init__(self, engine: Any, chat: ChatTokenizer, adapters: AdapterBook | None) -> None:
        """``adapters``: the LoRA adapters the engine serves, if it does; each request runs on the newest
        when it starts, to its end."""
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        from vllm import SamplingParams as VLLMSamplingParams

        self._engine = engine
        self._chat = chat
        self._adapters = adapters
        self._vllm_params: Any = VLLMSamplingParams
        self._structured: Any = StructuredOutputsParams
        self._delta = RequestOutputKind.DELTA
        self.live: dict[str, VLLMRequest] = {}
        self.held: list[VLLMRequest] = []  # arrived while asleep: added once the engine is awake again

    def add(self, request: VLLMRequest, version: int) -> None:
        """Start ``request`` in vLLM on the weights (or the adapter) of ``version``."""
        if request.cancelled:
            return
        p = request.params
        salt = f"agentjet-{p.adapter}-v{version}" if p.adapter else f"agentjet-v{version}"
        prompt = {"prompt_token_ids": request.prompt_ids, "cache_salt": salt}
        lora = self._adapters.lora_request(version, p.adapter or "") if self._adapters is not None else None
        try:
            params = self._vllm_params(
                n=1,
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                seed=p.seed,
                logprobs=p.top_logprobs,  # 0: the sampled token's log-probability only
                prompt_logprobs=0 if p.prompt_logprobs else None,  # 0: each prompt token's own only
                stop_token_ids=sorted(self._chat.stop_ids),
                detokenize=False,
                output_kind=self._delta,
                structured_outputs=self._structured(json=json_schema(p.grammar)) if p.grammar else None,
            )
            if lora is not None:
                self._engine.add_request(request.request_id, prompt, params, lora_request=lora)
            else:
                self._engine.add_request(request.request_id, prompt, params)
        except ValueError as exc:  # vLLM's checks of this request (a setting, its length): this request's 400
            request.push(InvalidRequestError(f"vLLM refused the request: {exc}"))
            return
        except Exception as exc:  # vLLM failed to take this request: it alone fails
            request.push(EngineError(f"vLLM refused the request: {exc}"))
            return
        if self._adapters is not None:  # its tokens come from this version's adapter to the end
            request.adapter = version
        self.live[request.request_id] = request

    def release_held(self, version_of: Callable[[VLLMRequest], int]) -> None:
        """Add the requests held while the engine slept, each on the weights (or adapter) of its version now."""
        held, self.held = self.held, []
        for request in held:
            self.add(request, version_of(request))

    def adapters_in_use(self) -> set[tuple[str, int]]:
        """The (name, version) of the LoRA adapters that live requests run on (name "": plain LoRA's)."""
        return {(r.params.adapter or "", r.adapter) for r in self.live.values() if r.adapter is not None}

    def deliver(self, output: Any, version: int) -> None:
        """One step's output for one request (``version``: of the weights that step ran on) to its caller."""
        request = self.live.get(output.request_id)
        if request is None:
            return
        if request.adapter is not None:
            version = request.adapter
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        for j, token in enumerate(token_ids):
            entry = completion.logprobs[j] if completion.logprobs else {}
            sampled = entry.get(token)
            top: list[tuple[int, float]] = []
            if request.params.top_logprobs:
                ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
                top = [(tid, lp) for _, tid, lp in ranked[: request.params.top_logprobs]]
            scored = prompt_logprobs(request, output) if not request.output_ids else None
            request.output_ids.append(token)
            finish: FinishReason | None = None
            if token in self._chat.stop_ids or self._chat.hits_stop_string(request.output_ids, request.params.stop):
                finish = "stop"
            elif j == len(token_ids) - 1 and output.finished:
                finish = "length" if completion.finish_reason == "length" else "stop"
            elif len(request.output_ids) >= request.params.max_tokens:
                finish = "length"
            logprob = float(sampled.logprob if sampled is not None else float("nan"))
            # constrained: vLLM's log-probabilities are those of the masked distribution, the behaviour policy's
            behaviour = logprob if request.params.grammar else None
            request.push(TokenEvent(token, logprob, version, top, finish, behaviour, scored))
            if finish is not None:
                if output.finished:
                    self.live.pop(request.request_id, None)
                else:
                    self.abort(request.request_id)
                return
        if output.finished:  # finished without a token this step (aborted inside vLLM)
            self.live.pop(request.request_id, None)
            request.push(EngineError(f"vLLM ended the request ({completion.finish_reason})"))

    def abort(self, request_id: str) -> None:
        """Forget the request, held or live; a live one is aborted in vLLM, freeing its batch slot."""
        if self.held:
            self.held = [r for r in self.held if r.request_id != request_id]
        if self.live.pop(request_id, None) is not None:
            try:
                self._engine.abort_request([request_id])
            except Exception:  # already finished inside vLLM
                logger.debug("abort of %s ignored", request_id, exc_info=True)

    def fail_live(self, error: EngineError) -> None:
        """End every live request with ``error`` (a step failed, or the engine stops)."""
        for request_id, request in list(self.live.items()):
            request.push(error)
            self.abort(request_id)
