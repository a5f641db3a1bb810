"""Credentials never reach a run dir or a log line: config dumps and URLs go through here."""

from __future__ import annotations

import re
from typing import Any

# Whole words of a key name: `api_token`, `secret_access_key`, `password` (not `tokenizer`).
_SECRET = re.compile(r"(^|_)(secret|password|passwd|token|credentials?|access_key|api_key|"
                     r"private_key|session_key|key_id)($|_)", re.IGNORECASE)
_URL_CREDS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)


def redact_secrets(obj: Any) -> Any:
    """A copy with credential-looking values masked: never write secrets into a run dir."""
    if isinstance(obj, dict):
        return {k: ("***" if _SECRET.search(str(k)) and obj[k] not in (None, "")
                    else redact_secrets(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_secrets(v) for v in obj]
    if isinstance(obj, str):
        return redact_url(obj)
    return obj


def redact_url(url: str) -> str:
    """A path or URL fit for a log line: `s3://key:secret@host/x` -> `s3://***@host/x`."""
    return _URL_CREDS.sub(r"\g<scheme>***@", str(url))
