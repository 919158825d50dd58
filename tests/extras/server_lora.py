"""agentjet-server[lora] alone: ``up --lora-rank`` serves through a peft adapter and trains it: one GRPO
group of two episodes with different rewards makes one step and a new policy version."""

import time

from _smoke import Server, get

from agentjet_client import SwarmClient

with Server("--lora-rank", "4", "--lr", "1e-3", "--batch-groups", "1", "--group-size", "2") as server:
    with SwarmClient(server.url) as client:
        trajectories = []
        for reward in (0.0, 1.0):
            episode = client.episode("smoke-lora")
            episode.openai().chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Write seven as a digit."}], max_tokens=4
            )
            episode.close()
            trajectories.append(episode.to_trajectory(reward))
        answers = client.submit(trajectories).results
        assert [a.status for a in answers] == ["accepted", "accepted"], answers
    deadline = time.monotonic() + 180
    while (status := get(server.url + "/v1/status"))["policy_version"] < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status["policy_version"] == 1 and status["learner"]["last_error"] is None, status["learner"]
    reply = server.chat(seed=3)
    assert reply["choices"][0]["agentjet"]["policy_version"] == 1, reply
print(f"lora: a LoRA step took the policy to v1 (loss {status['learner']['last_loss']:.4f}); v1 serves")
