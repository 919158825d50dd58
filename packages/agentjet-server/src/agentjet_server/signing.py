"""Sample signatures: proof that a pushed turn carries exactly the tokens this server sampled.

Every choice the server returns carries ``agentjet.signature``, an HMAC-SHA256 (keyed with a
secret kept in the state directory) over the prompt token ids, the completion token ids, their
log-probabilities and the policy version of each token. The client copies it into the ``Turn`` it
records. On ingestion the server recomputes it: a signed turn whose tokens, log-probs or versions
changed on the way (a capture bug, a hand-edited spool, a client built on another tokenizer) is
rejected with the reason, instead of being trained as if it had been sampled. The check costs no
server memory and survives restarts (the key stays; ``--fresh`` makes a new one, so a discarded
run's samples no longer verify). Turns without a signature (pushed by code that built
them itself) are accepted and counted as unsigned.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

from agentjet_client.protocol import Turn

KEY_BYTES = 32
SIGNATURE_CHARS = 32  # 128 bits of the HMAC, hex


def _canonical(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
) -> bytes:
    """Length-prefixed little-endian encoding: the same bytes on every machine, for every field split."""
    parts = [b"agentjet-sample-v1"]
    for fmt, values in (("q", prompt_ids), ("q", completion_ids), ("d", logprobs), ("q", versions)):
        parts.append(struct.pack("<q", len(values)))
        parts.append(struct.pack(f"<{len(values)}{fmt}", *values))
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
        versions = turn.completion_versions or []
        return self.verify(
            turn.signature, turn.prompt_token_ids, turn.completion_token_ids, turn.completion_logprobs, versions
        )

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

    def sign(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
    ) -> str:
        digest = hmac.new(self._key, _canonical(prompt_ids, completion_ids, logprobs, versions), hashlib.sha256)
        return digest.hexdigest()[:SIGNATURE_CHARS]

    def verify(
        self,
        signature: str,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
    ) -> bool:
        return hmac.compare_digest(signature, self.sign(prompt_ids, completion_ids, logprobs, versions))
