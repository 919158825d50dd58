// An agent in JavaScript that knows only a base URL and a key: plain fetch, no SDK.
// Usage: node agent.mjs "seven"   (AGENTJET_BASE_URL and AGENTJET_API_KEY in the environment)
const base = process.env.AGENTJET_BASE_URL;
const key = process.env.AGENTJET_API_KEY;
const word = process.argv[2];

async function chat(messages) {
  const response = await fetch(`${base}/chat/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
    body: JSON.stringify({ model: "agentjet-tiny", messages, max_tokens: 4, temperature: 1.0 }),
  });
  if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
  const body = await response.json();
  return (body.choices[0].message.content || "").trim();
}

const messages = [{ role: "user", content: `Write ${word} as a digit.` }];
const first = await chat(messages);
messages.push({ role: "assistant", content: first }, { role: "user", content: "Once more." });
const second = await chat(messages); // continues the conversation: the proxy names the earlier call
console.log(JSON.stringify({ first, second }));
