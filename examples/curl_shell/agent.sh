#!/usr/bin/env bash
# An agent in shell: curl and jq, knowing only a base URL and a key. No SDK, nothing AgentJet.
# Usage: bash agent.sh seven   (AGENTJET_BASE_URL and AGENTJET_API_KEY in the environment)
set -euo pipefail
word="$1"

body() {  # $1: the messages (JSON), $2: stream (true/false)
  jq -n --argjson m "$1" --argjson s "$2" \
    '{model: "agentjet-tiny", messages: $m, max_tokens: 4, temperature: 1.0, stream: $s}'
}

post() {  # $1: the request body; prints the response body, fails with the server's error on a 4xx/5xx
  curl -sS --fail-with-body "$AGENTJET_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $AGENTJET_API_KEY" -H "Content-Type: application/json" -d "$1"
}

messages=$(jq -n --arg w "$word" '[{role: "user", content: ("Write " + $w + " as a digit.")}]')
first=$(post "$(body "$messages" false)" | jq -r '.choices[0].message.content // ""')

# the second call continues the conversation, streamed: server-sent events, one delta per line
messages=$(jq -n --argjson m "$messages" --arg a "$first" \
  '$m + [{role: "assistant", content: $a}, {role: "user", content: "Once more."}]')
second=$(post "$(body "$messages" true)" | sed -n 's/^data: //p' | grep -v '^\[DONE\]$' \
  | jq -j '.choices[0].delta.content // ""')

jq -n -c --arg f "$first" --arg s "$second" '{first: $f, second: $s}'
