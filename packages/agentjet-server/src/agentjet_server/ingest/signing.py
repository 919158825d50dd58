"""Sample signatures: proof that a pushed turn carries exactly the tokens this server sampled.

Every choice the server returns carries ``agentjet.signature``: a random nonce and an HMAC-SHA256
(keyed with a secret kept in the state directory) over the nonce and everything of the sample the
learner uses: the prompt token ids, the completion token ids, their log-probabilities, the policy
version of each token, the finish reason, the agent that asked (``agentjet.agent`` on the request; the
client's capture sends it, per-agent rewards depend on it) and whether it was sampled from a processed
distribution (``sampled_from``). The client copies the signature into the ``Turn`` it records. On
ingestion the server recomputes it: a signed turn whose tokens, log-probs, versions, finish reason or
agent changed on the way (a capture bug, a hand-edited spool, a client built on another tokenizer) is
rejected with the reason, instead of being trained as if it had been sampled.
The check survives restarts (the key stays; ``--fresh`` makes a new one, so a discarded run's
samples no longer verify). ``request_messages`` are not signed: the learner never reads them (they
are for people, in ``inspect``).

Unsigned turns (pushed by code that built them itself) are accepted and counted as unsigned, unless
the server runs with ``--require-signed`` (the default whenever API keys are set). Each signature
is trained at most once: a signed turn pushed again in another trajectory is a replay, rejected
(the store keeps the signatures it accepted, in the log and its compacted ids).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agentjet_client.protocol import Turn

KEY_BYTES = 32
NONCE_CHARS = 16  # 64 random bits, hex: two samples with the same tokens still have different signatures
MAC_CHARS = 32  # 128 bits of the HMAC, hex
SIGNATURE_CHARS = NONCE_CHARS + MAC_CHARS


DEFAULT_AGENT = "default"  # what a turn's agent is when the request named none


@dataclass(frozen=True)
class Sample:
    """What a signature covers."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    finish_reason: str
    agent: str = DEFAULT_AGENT
    processed: bool = False  # sampled from a processed distribution: ``logprobs`` are its (the behaviour's)
    adapter: str | None = None  # the adapter that sampled it (its versions are that adapter's)

    @classmethod
    def of(cls, turn: Turn) -> Sample:
        return cls(
            turn.prompt_token_ids,
            turn.completion_token_ids,
            turn.completion_logprobs,
            turn.completion_versions or [],
            turn.finish_reason,
            turn.agent,
            turn.sampled_from == "processed",
            turn.adapter,
        )

    def canonical(self) -> bytes:
        """Length-prefixed little-endian encoding: the same bytes on every machine, for every field split.
        Raises ``struct.error`` for numbers outside 64 bits (the wire types refuse those first)."""
        parts = [b"agentjet-sample-v2"]
        numbers = (("q", self.prompt_ids), ("q", self.completion_ids), ("d", self.logprobs), ("q", self.versions))
        for fmt, values in numbers:
            parts.append(struct.pack("<q", len(values)))
            parts.append(struct.pack(f"<{len(values)}{fmt}", *values))
        for text in (self.finish_reason, self.agent):
            encoded = text.encode("utf-8", "surrogatepass")
            parts.append(struct.pack("<q", len(encoded)) + encoded)
        if self.processed:  # appended only then: the bytes of every other sample are as before
            parts.append(b"processed")
        if self.adapter is not None:  # likewise: a server without adapters signs the bytes it always did
            encoded = self.adapter.encode("utf-8", "surrogatepass")
            parts.append(b"adapter" + struct.pack("<q", len(encoded)) + encoded)
        return b"".join(parts)


class SampleSigner:
    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a sample-signing key needs at least 16 bytes")
        self._key = key

    @classmethod
    def random(cls) -> SampleSigner:
        """A key for a server without a state directory: signatures verify until it stops."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def existing(cls, path: Path) -> SampleSigner | None:
        """The key in ``path`` if there is one (read only: for tools that look at a state dir)."""
        try:
            key = path.read_bytes()
        except OSError:
            return None
        return cls(key) if len(key) == KEY_BYTES else None

    def verify_turn(self, turn: Turn) -> bool | None:
        """Whether a turn is what this key's server sampled; None if it carries no signature."""
        if turn.signature is None:
            return None
        return self.verify(turn.signature, Sample.of(turn))

    @classmethod
    def load(cls, path: Path, *, renew: bool = False) -> SampleSigner:
        """The key in ``path``, created (readable by the owner only) if missing or ``renew``."""
        if not renew:
            try:
                key = path.read_bytes()
            except FileNotFoundError:
                pass
            else:
                if len(key) == KEY_BYTES:
                    return cls(key)
        key = secrets.token_bytes(KEY_BYTES)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return cls(key)

    def sign(self, sample: Sample) -> str:
        """``<nonce><mac>``: a fresh random nonce, then the HMAC over the sample and the nonce. The
        nonce makes every sample's signature unique, so "trained once" can go by signature even
        when two episodes sample the very same tokens."""
        return self._sign(sample, secrets.token_hex(NONCE_CHARS // 2))

    def _sign(self, sample: Sample, nonce: str) -> str:
        digest = hmac.new(self._key, sample.canonical() + nonce.encode("ascii"), hashlib.sha256)
        return nonce + digest.hexdigest()[:MAC_CHARS]

    def verify(self, signature: str, sample: Sample) -> bool:
        """Constant-time; False (not an error) for a signature that is not even hex text."""
        if len(signature) != SIGNATURE_CHARS:
            return False
        try:
            expected = self._sign(sample, signature[:NONCE_CHARS]).encode("ascii")
            return hmac.compare_digest(signature.encode("ascii"), expected)
        except (UnicodeEncodeError, struct.error):
            return False
