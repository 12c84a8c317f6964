"""Who may reach what: Host and Origin rules (DNS rebinding, CSRF), secret comparison.

The threat model is in docs/security.md. In short:
- A server that listens on a loopback address trusts local clients only. A web page the
  operator visits can still reach it: by DNS rebinding (the page's own name re-resolved to
  127.0.0.1, so its requests are same-origin, but they carry the page's name in `Host`), or by
  cross-site requests a browser sends without asking (CSRF: GET, and POST with a form or
  text/plain body). So such a server answers only requests whose `Host` is a local name, an IP
  address, the configured `--host`, or one of `--allowed-hosts`; and admin changes need a JSON
  body type, which a browser sends cross-site only after a CORS preflight this server never
  grants, and an `Origin`, when present, of the same site.
- Secrets (the API key, the admin token) are compared in constant time.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Mapping
from urllib.parse import urlsplit

LOCAL_NAMES = ("localhost",)  # and every *.localhost name (RFC 6761: always loopback)


def same_secret(given: str, expected: str) -> bool:
    """Constant-time equality (no timing hint about how much of the secret matched)."""
    return secrets.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of `Authorization: Bearer <token>`, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def secret_of(settings: object, name: str) -> str | None:
    """A configured secret (`api_key`, `admin_token`): str, pydantic SecretStr, or None."""
    value = getattr(settings, name, None)
    if value is not None and hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    return value or None


def hostname(host_header: str) -> str:
    """The name of a Host header (or of an Origin's netloc), without port, brackets or a
    trailing dot, lower-cased: "[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"."""
    host = host_header.strip().lower()
    if host.startswith("["):  # IPv6 literal
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return True


def is_loopback_address(host: str | None) -> bool:
    """True for 127.0.0.0/8 and ::1 (also as IPv4-mapped IPv6). Anything that is not an IP
    address — Starlette's TestClient reports "testclient" — counts as remote, on purpose."""
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listens_on_loopback(bind_host: str | None) -> bool:
    """Whether the server's `--host` is a loopback address or name (then only local clients
    can connect, and the Host rule applies to every request)."""
    if not bind_host:
        return False
    name = hostname(bind_host)
    return name in LOCAL_NAMES or name.endswith(".localhost") or is_loopback_address(name)


def extra_hosts(settings: object) -> tuple[str, ...]:
    raw = getattr(settings, "allowed_hosts", None) or ""
    return tuple(hostname(h) for h in raw.split(",") if h.strip())


def host_allowed(host_header: str | None, settings: object) -> bool:
    """Whether a request's Host may be served: absent (not a browser), a localhost name, an IP
    address (a rebinding page always has a DNS name), the configured `--host`, or one of
    `--allowed-hosts` ('*': any)."""
    if host_header is None:
        return True
    name = hostname(host_header)
    if name in LOCAL_NAMES or name.endswith(".localhost") or _is_ip(name):
        return True
    allowed = extra_hosts(settings)
    bind = getattr(settings, "host", None)
    return "*" in allowed or name in allowed or (bind is not None and name == hostname(bind))


def origin_allowed(origin: str | None, host_header: str | None, settings: object) -> bool:
    """Whether a request's Origin (sent by browsers) is this site: absent (not a browser), the
    same host and port as the request's Host (a same-origin page, e.g. /admin), or an allowed
    host. "null" (sandboxed frames, file://) is refused."""
    if origin is None:
        return True
    if origin == "null":
        return False
    netloc = urlsplit(origin).netloc.lower()
    if host_header is not None and netloc == host_header.strip().lower():
        return True
    return bool(netloc) and host_allowed(netloc, settings)


def is_json_content_type(content_type: str | None) -> bool:
    """application/json or application/*+json (parameters such as charset allowed)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
