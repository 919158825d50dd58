"""An OpenEnv echo environment, served over HTTP and WebSocket by OpenEnv's own server
(``openenv.core.env_server.http_server.create_app``): it echoes each message back. Its reset names a
number word; a message that is that word's digit earns 0.5; after two messages the episode is done.

    python examples/openenv_echo/echo_env.py --port 8200
"""

from __future__ import annotations

import argparse
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class EchoAction(Action):
    message: str = Field(..., description="what to echo back")


class EchoObservation(Observation):
    echoed_message: str = Field(default="", description="the message, echoed, and the question again")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._word = "seven"

    def reset(self, seed: int | None = None, episode_id: str | None = None, word: str = "seven") -> EchoObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._word = word
        return EchoObservation(echoed_message=f"Write {word} as a digit.", done=False, reward=0.0)

    def step(self, action: EchoAction) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        right = action.message.strip() == str(WORDS.index(self._word))
        return EchoObservation(
            echoed_message=f"{action.message.strip()}. Write {self._word} as a digit.",
            done=self._state.step_count >= 2,
            reward=0.5 if right else 0.0,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=256)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
