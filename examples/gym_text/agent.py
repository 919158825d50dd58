"""A gymnasium text environment played by the model, turn by turn (``agentjet_client.envs.gym``).

``DigitGuess-v0`` (below, a plain gymnasium ``Env`` with text spaces) asks for a number word as a
digit; a wrong answer gets "No." and the question again, up to three tries. Reward 1 for the right
digit at the first try, 0.5 at the second, 0.25 at the third. The agent is the adapter: observations
become user messages, replies become actions, each call continuing the conversation before it.

    agentjet-client run --code-dir examples/gym_text --episodes 2000
"""

import os

import gymnasium
from gymnasium import spaces

from agentjet_client.envs.gym import gym_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CHOSEN = [int(d) for d in os.environ.get("AGENTJET_DIGITS", ",".join(map(str, range(10)))).split(",")]


class DigitGuess(gymnasium.Env):
    """The secret digit is the task's (``options={"digit": d}``); three tries."""

    def __init__(self) -> None:
        self.observation_space = spaces.Text(max_length=64)
        self.action_space = spaces.Text(max_length=64)
        self.digit, self.tries = 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.digit = (options or {}).get("digit", int(self.np_random.integers(10)))
        self.tries = 0
        return f"Write {WORDS[self.digit]} as a digit.", {}

    def step(self, action):
        self.tries += 1
        if action.strip() == str(self.digit):
            return "Right.", 0.5 ** (self.tries - 1), True, False, {}
        return f"No. Write {WORDS[self.digit]} as a digit.", 0.0, False, self.tries >= 3, {}


gymnasium.register("DigitGuess-v0", entry_point=DigitGuess)

TASKS = [{"id": f"digit-{d}", "options": {"digit": d}} for d in CHOSEN]
agent = gym_agent("DigitGuess-v0", tasks=TASKS, eval_tasks=TASKS, name="digit_guess", max_turns=3, max_tokens=4)
