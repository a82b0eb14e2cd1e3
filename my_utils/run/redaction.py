"""Secrets kept out of what a run records: tokens and keys in command lines, configs and launch records, shown as
``<redacted>`` and recorded, compared and named by a hash of their value."""

from __future__ import annotations

import hashlib
import os
import re

# Names of settings whose values are secrets (split into words: "hf_token" -> hf, token).
SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "credential", "credentials", "apikey"})
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")})
# Values that are secrets whatever their name: Hugging Face, OpenAI-style, GitHub and AWS access keys.
# Token-shaped values, matched as whole tokens only: "sk-..." inside "task-..." or "disk-..." is a file name.
SECRET_VALUE = re.compile(r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
                          r"|AKIA[0-9A-Z]{16})(?![A-Za-z0-9])")
REDACTED = "<redacted>"


def looks_secret(name: str) -> bool:
    """Whether a setting or environment variable called ``name`` holds a secret (HF_TOKEN, --api-key...)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return any(w in SECRET_WORDS for w in words) or any(pair in SECRET_PAIRS for pair in zip(words, words[1:]))


def redact_secrets(obj):
    """``obj`` (a command line, a config) as shown to people: secrets replaced by ``<redacted>``: values of keys and
    ``--options`` whose name looks secret, token-shaped strings, and the values of secret-looking environment
    variables wherever they appear. Everything else is returned unchanged."""
    return _replace_secrets(obj, lambda secret: REDACTED)


def hash_secrets(obj):
    """``obj`` as it is recorded, compared and named: the secrets ``redact_secrets`` hides each replaced by
    ``secret_hash`` of its value, so that two different secrets differ and the same one matches, and none is
    written."""
    return _replace_secrets(obj, secret_hash)


HASHED = re.compile(r"sha256:[0-9a-f]{12}")


def secret_hash(value) -> str:
    """``sha256:`` and 12 hex digits of ``value``'s hash; a value already in this form is kept (hashing is done
    once, so a recorded config hashes to itself)."""
    text = str(value)
    return text if HASHED.fullmatch(text) else "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _replace_secrets(obj, replace):
    """``obj`` with every secret ``redact_secrets`` describes replaced by ``replace(secret)``."""
    env_secrets = [v for k, v in os.environ.items() if looks_secret(k) and len(v) >= 8]

    def scrub(text: str) -> str:
        for value in env_secrets:
            text = text.replace(value, replace(value))
        return SECRET_VALUE.sub(lambda m: replace(m.group(0)), text)

    if isinstance(obj, dict):
        return {k: replace(v) if looks_secret(str(k)) and v is not None else _replace_secrets(v, replace)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out, hide_next = [], False
        for item in obj:
            if hide_next:
                out.append(replace(item))
                hide_next = False
                continue
            if isinstance(item, str) and item.startswith("-") and looks_secret(item.split("=", 1)[0]):
                if "=" in item:
                    name, value = item.split("=", 1)
                    item = name + "=" + replace(value)
                else:
                    hide_next = True
            out.append(_replace_secrets(item, replace))
        return type(obj)(out) if isinstance(obj, tuple) else out
    if isinstance(obj, str):
        return scrub(obj)
    return obj
