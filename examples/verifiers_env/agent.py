"""A verifiers environment (``countdown_env.py`` beside this file, written to verifiers' own API) trained
unchanged: its dataset, its multi-turn protocol and its rubric, each model call captured token-exact
(``agentjet_client.envs.verifiers``).

    agentjet-client run --code-dir examples/verifiers_env --episodes 4000
    agentjet-client run --env verifiers:countdown_env --env-args '{"digits": "3,8"}'   # from this folder

Needs ``pip install 'agentjet-client[verifiers]'``. Set ``AGENTJET_DIGITS`` (e.g. ``3,8``) to train on a subset.
"""

import os

from agentjet_client.envs.verifiers import verifiers_agent

agent = verifiers_agent(
    "countdown_env",
    env_args={"digits": os.environ.get("AGENTJET_DIGITS", "0,1,2,3,4,5,6,7,8,9")},
    name="countdown",
    max_tokens=4,
    # verifiers counts a turn that says nothing as a failed rollout, and a small model can end a turn at its
    # first token: at least one token before the end (vLLM's min_tokens; AgentJet's server honours it too)
    min_tokens=1,
)
