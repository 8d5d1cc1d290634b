"""The proxy an HTTP(S) request goes through, from the environment as curl, requests and
obstore (so `s3://`) read it: `HTTPS_PROXY` for https:// URLs (a CONNECT tunnel, TLS end
to end with the server), `HTTP_PROXY` for http:// ones (the request sent to the proxy with
its absolute URL), lowercase names first; `NO_PROXY` lists hosts (with their domains, an
optional `:port`, or `*`) reached directly. A proxy URL is `http://[user:password@]host:port`
(the password goes as `Proxy-Authorization: Basic`, to the proxy only, never shown).
"""
from __future__ import annotations

import base64
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from ..errors import RemoteError
from ..redact import register_secret

_SETTING = {"https": "HTTPS_PROXY", "http": "HTTP_PROXY"}


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    setting: str  # the environment variable it came from, for messages
    headers: dict = field(default_factory=dict)  # Proxy-Authorization, when the URL has credentials

    @property
    def shown(self) -> str:
        return f"{self.setting} {self.host}:{self.port}"


def proxy_for(scheme: str, netloc: str) -> Proxy | None:
    """The proxy a request to scheme://netloc goes through, or None (none set, or NO_PROXY)."""
    proxies = urllib.request.getproxies_environment()
    url = proxies.get(scheme)
    if not url or urllib.request.proxy_bypass_environment(netloc.lower(), proxies):
        return None
    setting = _SETTING[scheme]
    parts = urlsplit(url if "://" in url else "http://" + url)
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise RemoteError(f"{setting}: not a proxy lazyload can use ({parts.scheme}://{parts.hostname or ''}); set "
                          "it to http://host:port (https:// URLs go through it by CONNECT, encrypted end to end), "
                          "or name the host in NO_PROXY.")
    headers = {}
    if parts.username is not None:
        user, password = unquote(parts.username), unquote(parts.password or "")
        register_secret(password, parts.password)
        credentials = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        register_secret(credentials)
        headers["Proxy-Authorization"] = f"Basic {credentials}"
    return Proxy(parts.hostname, port, setting, headers)
