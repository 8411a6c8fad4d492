"""API keys: where they come from, and the one comparison that checks them.

A key is compared as the sha256 digest of both sides with `hmac.compare_digest`, so neither the time taken
nor an early exit tells a caller how much of a guess was right, whatever the keys' lengths.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from embed_service.config import ServerSettings

log = logging.getLogger(__name__)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The accepted keys, held as digests; empty when the server is open."""

    def __init__(self, keys: Iterable[str]):
        self.digests = [_digest(k.encode("utf-8")) for k in dict.fromkeys(keys)]

    def __bool__(self) -> bool:
        return bool(self.digests)

    def __len__(self) -> int:
        return len(self.digests)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the keys (the scheme is case-insensitive)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(
            token.strip().encode("latin-1", "replace")
        )  # header text is latin-1: the bytes as sent
        matched = False
        for d in self.digests:  # every key is compared: the time does not say which one matched
            matched |= hmac.compare_digest(given, d)
        return matched


def split_keys(text: str) -> list[str]:
    return [k.strip() for k in text.split(",") if k.strip()]


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--api-key-file {path}: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SystemExit(f"--api-key-file {path}: holds no key (one key per line)")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("--api-key-file %s can be read by other users: chmod 600 it", path)
    return keys


def given_as_flag(argv: Sequence[str]) -> bool:
    return any(a == "--api-key" or a.startswith("--api-key=") for a in argv)


def load_api_keys(settings: ServerSettings, argv: Sequence[str] | None = None) -> ApiKeys:
    """The keys of ``--api-key`` / ``EMBED_API_KEY`` (comma-separated) and of ``--api-key-file``."""
    keys = split_keys(settings.api_key or "")
    if settings.api_key_file:
        keys += read_key_file(settings.api_key_file)
    if given_as_flag(sys.argv if argv is None else argv):
        # /proc/<pid>/cmdline is readable by every local user.
        log.warning(
            "--api-key on the command line is visible to every user of this machine (pid %d): "
            "pass the key in EMBED_API_KEY or --api-key-file instead",
            os.getpid(),
        )
    return ApiKeys(keys)
