"""Admin authentication: one bearer token, compared in constant time.

Resolution at start-up (`resolve_admin_token`), before anything is loaded:

- `--admin-token` or `TRILLIUM_ADMIN_TOKEN` set: that token.
- no token, loopback admin host (127.0.0.0/8, ::1, localhost): a random
  token is generated and printed once on stderr (as Jupyter does), so a
  local operator can copy it and nobody else can guess it; the log gets
  only its `token_fingerprint`.
- `--admin-token-file PATH` (`read_token_file`): the token is the file's
  content, kept out of `ps` and /proc/<pid>/cmdline, where `--admin-token`
  is visible to every local user (a warning says so).
- no token, any other host: refused (`AdminConfigError`; `trillium serve`
  exits with code 2). An unauthenticated admin port on a network can
  swap the served weights.
- a token equal to the data-plane API key: refused too, so the data-plane
  key can never open the control plane (and the admin token never opens
  the data plane).

`check_bearer` is the per-request check; every admin route, including
/health and /metrics, goes through it.

`--admin-on-data-port` (`data_port_requires_token`): the admin routes are on
the data port too, for RL frameworks (slime, verl) that send admin calls to
the generation URL with no auth header. With a token set, every admin route
there requires it as well. Without one it is allowed only on a loopback data
host, where the routes there are open (a warning is logged); on any other
host it is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets


class AdminConfigError(ValueError):
    """The admin settings are unsafe or inconsistent; the server must not start."""


def is_loopback_host(host: str) -> bool:
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # WHY: a host name could resolve anywhere; only literals and localhost count


def resolve_admin_token(host: str, token: str | None, api_key: str | None = None) -> tuple[str, bool]:
    """(token, generated): the token to require, and whether it was made up here."""
    token = (token or "").strip() or None
    if token is None:
        if not is_loopback_host(host):
            raise AdminConfigError(
                f"refusing to serve the admin API on non-loopback address {host!r} without a token: "
                "pass --admin-token or set TRILLIUM_ADMIN_TOKEN (or use --admin-host 127.0.0.1)"
            )
        return secrets.token_urlsafe(32), True
    if api_key and hmac.compare_digest(token.encode(), api_key.encode()):
        raise AdminConfigError("the admin token must differ from the data-plane API key (--api-key)")
    return token, False


def token_fingerprint(token: str) -> str:
    """A short SHA-256 fingerprint of a secret, safe to log."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def read_token_file(path: str) -> str:
    """The token stored in `path` (surrounding whitespace stripped); AdminConfigError when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminConfigError(f"--admin-token-file {path}: {exc}") from None
    if not token:
        raise AdminConfigError(f"--admin-token-file {path} is empty")
    return token


def check_bearer(authorization: str | None, token: str) -> bool:
    """True when the Authorization header carries exactly `Bearer <token>`."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def data_port_requires_token(host: str, token_given: bool) -> bool:
    """Whether the admin routes mounted on the data port (`--host`) need the token;
    AdminConfigError when they would be open on a non-loopback address."""
    if token_given:
        return True
    if not is_loopback_host(host):
        raise AdminConfigError(
            f"refusing --admin-on-data-port on non-loopback address {host!r} without an admin token: "
            "pass --admin-token or set TRILLIUM_ADMIN_TOKEN (every admin route then requires it), "
            "or use --host 127.0.0.1"
        )
    return False
