"""A request's way to tokens and back, for every API the server speaks.

``prompt`` renders and bounds a request (``PromptBuilder``); ``choice`` samples choices on the engine and
reads each one's answer (``Sampler``, ``ChoiceState``); ``chat`` and ``text`` shape chat and text
completions, whole or streamed, over that one sampling loop; ``dialects`` translates a chat completion
(or its stream) into OpenAI's Responses and Anthropic's Messages shapes.
"""

from __future__ import annotations

from agentjet_server.serving.chat import ChatService
from agentjet_server.serving.choice import ChoiceState, Sampler
from agentjet_server.serving.prompt import PreparedRequest, PromptBuilder
from agentjet_server.serving.text import TextService

__all__ = ["ChatService", "ChoiceState", "PreparedRequest", "PromptBuilder", "Sampler", "TextService"]
