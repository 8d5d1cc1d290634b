"""What lazyload shows of a location, a credential or a server's words: every error message
(`LazyLoadError`), every line of the "lazyload" logger and everything the CLI prints passes
through `redact`, so no path that names a secret can show it.

`redact` removes the credential values registered by the stores (a token, a secret key, a
presigned URL's signature: `register_secret`), the user:password of any URL, the value of
every query parameter of any URL (`?X-Amz-Signature=***&sig=***`), fields that read like a
credential (`Authorization: Bearer ...`, `aws_secret_access_key = ...`, `Key-Pair-Id=...`),
and escapes control characters (a shard name or a reason phrase cannot rewrite a terminal).
`printable` escapes a server's or a repo's text whole (newlines too) before it is quoted.
"""
from __future__ import annotations

import logging
import re
import threading

MASK = "***"
MIN_SECRET = 8  # shorter values are not registered: they would mask ordinary words

# Any URL: scheme, an optional user:password@, the rest of its authority and path, then its
# query or fragment (every parameter's value masked).
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,15}://)([^\s/?#@]*@)?([^\s?#\"'<>]*)([?#][^\s\"'<>]*)?")
_TRAILING = ".,;:)]}"  # punctuation after a URL in a sentence, not part of its query
# A field that reads like a credential, up to the end of its value: a header (`Authorization:
# Bearer ...`), a setting (`aws_secret_access_key = ...`), a query parameter quoted without its
# URL (`sig=...`). The bare names (token, sig, policy) only where they stand alone: `cls_token:`
# in a message about a model's parameter is no credential.
_FIELD = re.compile(
    r"(?<![\w.-])((?i:(?:proxy-)?authorization|[\w-]*(?:secret|password|passwd|signature|credential|access_key|"
    r"access[-_]token|auth[-_]token|session[-_]token|security[-_]token|refresh[-_]token|api[-_]?key|hf[-_]token)|"
    r"token|sig|policy|key-pair-id))([\"']?\s*[:=]\s*)((?i:Bearer |Basic |AWS4-HMAC-SHA256 )?"
    r"(?![a-z]+(?:[\s,&;\"']|$))[^\s,&;\"']+)")  # its value: not a lowercase word (prose: `token: expired`)
# Control characters but tab and newline (C0, DEL, C1) and the bidirectional overrides.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROL_ALL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()


def register_secret(*values: str | None) -> None:
    """Never show these values (credentials a store was given); too short ones are ignored."""
    global _secrets
    with _lock:
        new = {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET} - set(_secrets)
        if new:  # longest first: a secret holding another is masked whole
            _secrets = tuple(sorted({*_secrets, *new}, key=len, reverse=True))


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` as lazyload may show it: no registered or given secret, no URL's userinfo or
    query values, no credential field, control characters escaped (tab and newline kept)."""
    for secret in (*secrets, *_secrets):
        if secret and secret in text:
            text = text.replace(secret, MASK)
    text = _URL.sub(_masked_url, text)
    text = _FIELD.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    return _CONTROL.sub(_escape, text)


def printable(text: str, limit: int = 200) -> str:
    """Text a server or a checkpoint chose (a reason phrase, an ETag, a file name), safe to
    quote: every control character escaped, newlines too; at most `limit` characters."""
    text = _CONTROL_ALL.sub(_escape, str(text))
    return text if len(text) <= limit else text[:limit] + "..."


def _escape(match: re.Match) -> str:
    return ascii(match.group(0))[1:-1]


def _masked_url(match: re.Match) -> str:
    scheme, userinfo, rest, query = match.groups()
    shown = scheme + (MASK + "@" if userinfo else "") + rest
    if not query:
        return shown
    tail = len(query) - len(query.rstrip(_TRAILING))
    query, after = (query[:-tail], query[-tail:]) if tail else (query, "")
    params = re.split(r"([&;])", query[1:])
    masked = "".join(p if p in "&;" else (p.partition("=")[0] + "=" + MASK if "=" in p else MASK if p else "")
                     for p in params)
    return shown + query[0] + masked + after


class _RedactingFilter(logging.Filter):
    """The "lazyload" logger's records, redacted before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, None
        return True


_LOGGER = logging.getLogger("lazyload")
if not any(isinstance(f, _RedactingFilter) for f in _LOGGER.filters):
    _LOGGER.addFilter(_RedactingFilter())
