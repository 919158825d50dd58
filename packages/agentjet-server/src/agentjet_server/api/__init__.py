"""The HTTP API, one module per API family; ``app.create_app`` assembles ``ROUTES`` and ``HANDLERS``.

- ``auth``: bearer keys (client keys infer, push and read; admin keys also steer);
- ``chat``: chat and text completions, ``/v1/models``, and the streaming and disconnect glue;
- ``dialects``: OpenAI's Responses API and Anthropic's Messages API, over the chat service;
- ``trajectories``: pushes, recent and single trajectories, ``/v1/status`` and ``/healthz``;
- ``admin``: live configuration, pause and resume, checkpoint, stop, clients;
- ``train``: training modes beside RL on the served model (supervised fine-tuning);
- ``tinker``: the Tinker SDK's API (``/api/v1/...``) over the workbench (``tinker/``);
- ``observe``: the dashboard page, its overview and history, and ``/metrics``;
- ``errors``: OpenAI's error shape, picked by exception class.

Routes are small functions of the request; what they share (the runtime, settings, the body gate)
is the ``Api`` on ``app.state.api`` (``context``).
"""

from __future__ import annotations

from agentjet_server.api import admin, chat, dialects, observe, tinker, train, trajectories
from agentjet_server.api.context import Api
from agentjet_server.api.errors import HANDLERS

ROUTES = [
    *chat.ROUTES,
    *dialects.ROUTES,
    *trajectories.ROUTES,
    *observe.ROUTES,
    *admin.ROUTES,
    *train.ROUTES,
    *tinker.ROUTES,
]

__all__ = ["HANDLERS", "ROUTES", "Api"]
