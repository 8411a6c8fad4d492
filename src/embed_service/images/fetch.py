"""Image inputs given by URL (``http://``, ``https://``): fetched only from the hosts an operator listed.

Off by default: a URL is a 400 saying how to turn fetching on (``--allowed-media-domains``). With hosts
listed, each fetch is held to these rules, each refusal an ImageError naming the input and the rule:

- the scheme is http or https, the URL has no user name or password, and its host is one of
  ``--allowed-media-domains`` exactly (a subdomain is its own name: ``img.example.com`` is not allowed by
  ``example.com``), as vLLM's ``--allowed-media-domains`` matches;
- the host is resolved once; every address it resolves to must be a public one (not private, loopback,
  link-local, multicast, reserved, unspecified, shared (100.64.0.0/10), nor an IPv6 form of one: IPv4-mapped,
  6to4, NAT64), unless it lies in one of ``--allowed-media-networks``; the connection goes to a vetted
  address (no second lookup, so a DNS answer cannot change between the check and the connect), with the
  host's own name in the Host header and the TLS SNI, and TLS verified against that name;
- redirects are followed by hand, at most ``--media-max-redirects``, each hop checked as the first;
- the whole fetch (the lookup, every hop, the body) ends within ``--media-fetch-timeout`` seconds: a
  watchdog shuts the socket at the deadline, so a server that stalls or trickles cannot hold it longer;
- the body is read up to the byte limit (the image's, or what is left of the request's) and no further:
  a Content-Length over it is refused before the body is read; a status other than 2xx is refused.

The bytes then take the same path as base64 bytes (decode.py: format allow-list, pixel bounds).

The standard library's http.client does the HTTP, not httpx: it lets the connection be opened to the
vetted address while the request names the host (``connect`` overridden; TLS wrapped with
``server_hostname``), it never decodes a Content-Encoding (the cap counts the bytes that arrive), and it
adds no runtime dependency; httpx would pin an address only through its transport internals.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from embed_service.images.decode import REMOTE_REFUSED, ImageError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

REDIRECTS = {301, 302, 303, 307, 308}
NAT64 = ipaddress.ip_network("64:ff9b::/96")
SHARED = ipaddress.ip_network("100.64.0.0/10")
READ_SIZE = 64 * 1024

_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A process-wide thread pool: ``fetch`` for requests with URLs (so that a slow host holds none of the
    tokenization threads), ``dns`` for the lookups (getaddrinfo has no timeout of its own)."""
    with _pools_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"image-{name}")
        return _pools[name]


@functools.cache
def _system_tls() -> ssl.SSLContext:
    """The system's certificate authorities (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` name others), host names
    checked: made once, shared by every fetch."""
    return ssl.create_default_context()


def is_url(text: str) -> bool:
    head = text[:16].lower()
    return "://" in head and not head.startswith("data:")


@dataclass(frozen=True)
class FetchPolicy:
    """What ``--allowed-media-domains``, ``--allowed-media-networks``, ``--media-fetch-timeout`` and
    ``--media-max-redirects`` allow. No domains: URLs are refused."""

    domains: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()
    timeout: float = 10.0
    max_redirects: int = 3
    context: ssl.SSLContext | None = field(default=None, compare=False)
    """The TLS context (default: the system's CAs, host name checked)."""

    @classmethod
    def of(cls, domains: list[str], networks: list[str], timeout: float, max_redirects: int) -> FetchPolicy:
        return cls(
            frozenset(d.strip().strip("[]").lower().rstrip(".") for d in domains),
            tuple(ipaddress.ip_network(n, strict=False) for n in networks),
            timeout,
            max_redirects,
        )


def refusal(ip: Address, allowed: tuple[Network, ...] = ()) -> str | None:
    """Why `ip` may not be fetched from (a short reason), or None for a public address or one in `allowed`.
    IPv6 forms that carry an IPv4 address (IPv4-mapped, 6to4, NAT64) are judged by that address too."""
    if any(ip.version == n.version and ip in n for n in allowed):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            why = refusal(inner, allowed)
            return f"{why} (as {ip})" if why else None
    for name, hit in (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("shared (100.64.0.0/10)", ip in SHARED),
        ("reserved", ip.is_reserved),
        ("not global", not ip.is_global),
    ):
        if hit:
            return name
    return None


def fetch(url: str, what: str, policy: FetchPolicy, limit: int, limit_text: str, deadline: float) -> bytes:
    """The body of `url` (at most `limit` bytes; `limit_text` says which limit, for the refusal), held to
    `policy`, done by `deadline` (time.monotonic(): the request's, shared by all its fetches). Every refusal
    is an ImageError naming `what`."""
    if not policy.domains:
        raise ImageError(f"{what}: {REMOTE_REFUSED}")
    for _ in range(policy.max_redirects + 1):
        status, location, body = _get(url, what, policy, limit, limit_text, deadline)
        if location is None:
            if not 200 <= status < 300:
                raise FetchError(f"{what}: {_short(url)} answered HTTP {status}", "status")
            return body
        url = urljoin(url, location)
    raise FetchError(
        f"{what}: more than {policy.max_redirects} redirects; the limit is {policy.max_redirects} "
        "(--media-max-redirects)",
        "redirects",
    )


class FetchError(ImageError):
    """A fetch refused or failed; `reason` counts it in embed_image_fetches_total: ``not_allowed`` (a
    scheme, host or address the rules refuse), ``redirects``, ``too_large``, ``timeout``, ``status`` (not
    2xx) or ``failed`` (the lookup, the connection, TLS)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."


def _target(url: str, what: str, policy: FetchPolicy) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of an allowed URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise FetchError(f"{what}: not a valid URL: {_short(url)}", "not_allowed") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if scheme not in ("http", "https"):
        raise FetchError(f"{what}: the {scheme!r} scheme is not fetched; only http and https", "not_allowed")
    if parts.username is not None or parts.password is not None:
        raise FetchError(f"{what}: a URL with a user name or password is not fetched", "not_allowed")
    if not host.isascii():
        raise FetchError(f"{what}: write the host {host!r} in its ASCII (punycode) form", "not_allowed")
    if host not in policy.domains:
        raise FetchError(
            f"{what}: the host {host!r} is not one of --allowed-media-domains ({', '.join(sorted(policy.domains))})",
            "not_allowed",
        )
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return scheme, host, port or (443 if scheme == "https" else 80), path


def _resolve(host: str, port: int, what: str, policy: FetchPolicy, deadline: float) -> list[str]:
    """The host's addresses, each checked; a literal address is its own."""
    try:
        infos = pool("dns", 8).submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        answers = infos.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise _timeout(what, policy) from None
    except OSError as e:
        raise FetchError(f"{what}: the host {host!r} cannot be resolved ({e})", "failed") from None
    addresses: list[str] = []
    for *_, sockaddr in answers:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        why = refusal(ip, policy.networks)
        if why:
            raise FetchError(
                f"{what}: the host {host!r} resolves to {ip}, a {why} address; fetching from it needs its "
                "network in --allowed-media-networks",
                "not_allowed",
            )
        if str(ip) not in addresses:
            addresses.append(str(ip))
    if not addresses:
        raise FetchError(f"{what}: the host {host!r} has no address", "failed")
    return addresses


def _timeout(what: str, policy: FetchPolicy) -> ImageError:
    return FetchError(
        f"{what}: the request's image fetches did not finish within {policy.timeout:g} s; the limit is "
        f"{policy.timeout:g} s per request (--media-fetch-timeout)",
        "timeout",
    )


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to `host` (its Host header) opened to one of `addresses` (already vetted), each
    attempt within what is left before `deadline`. `watch` is a duplicate of the socket, which the watchdog
    shuts at the deadline whatever the connection is doing (a TLS handshake included)."""

    def __init__(self, host: str, port: int, addresses: list[str], deadline: float):
        super().__init__(host, port)
        self.addresses, self.deadline = addresses, deadline
        self.watch: socket.socket | None = None

    def _open(self) -> socket.socket:
        error: OSError = TimeoutError()
        for address in self.addresses:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            try:
                sock = socket.create_connection((address, self.port), left)
            except OSError as e:
                error = e
                continue
            self.watch = sock.dup()
            return sock
        raise error

    def connect(self) -> None:
        self.sock = self._open()

    def shut(self) -> None:
        if self.watch is not None:
            try:
                self.watch.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self) -> None:
        """After the response too is done with the socket. (Not in ``close``: http.client closes the
        connection when it hands the socket to a response that will close it, before its body is read.)"""
        self.close()
        if self.watch is not None:
            self.watch.close()


class _PinnedTLS(_Pinned):
    def __init__(self, host: str, port: int, addresses: list[str], deadline: float, context: ssl.SSLContext):
        super().__init__(host, port, addresses, deadline)
        self.context = context

    def connect(self) -> None:
        self.sock = self.context.wrap_socket(self._open(), server_hostname=self.host)


def _get(
    url: str, what: str, policy: FetchPolicy, limit: int, limit_text: str, deadline: float
) -> tuple[int, str | None, bytes]:
    """One hop: (status, the redirect's Location or None, the body (empty for a redirect))."""
    scheme, host, port, path = _target(url, what, policy)
    addresses = _resolve(host, port, what, policy, deadline)
    left = deadline - time.monotonic()
    if left <= 0:
        raise _timeout(what, policy)
    if scheme == "https":
        conn: _Pinned = _PinnedTLS(host, port, addresses, deadline, policy.context or _system_tls())
    else:
        conn = _Pinned(host, port, addresses, deadline)
    fired = threading.Event()

    def shut() -> None:  # at the deadline
        fired.set()
        conn.shut()

    held: list[http.client.HTTPResponse] = []
    watchdog = threading.Timer(left, shut)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "embed-service"})
        response = conn.getresponse()
        held.append(response)
        if response.status in REDIRECTS and response.getheader("Location"):
            return response.status, response.getheader("Location"), b""
        if not 200 <= response.status < 300:
            return response.status, None, b""
        length = response.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise FetchError(
                f"{what}: {_short(url)} has a Content-Length of {int(length)} bytes; {limit_text}",
                "too_large",
            )
        chunks, size = [], 0
        while chunk := response.read1(READ_SIZE):
            size += len(chunk)
            if size > limit:
                raise FetchError(
                    f"{what}: {_short(url)} sent more than {limit} bytes; {limit_text}", "too_large"
                )
            chunks.append(chunk)
        if fired.is_set():
            raise _timeout(what, policy)
        if response.length:  # the connection closed early
            raise FetchError(
                f"{what}: {_short(url)} closed after {size} of {size + response.length} bytes", "failed"
            )
        return response.status, None, b"".join(chunks)
    except FetchError:
        raise
    except ssl.SSLError as e:
        detail = getattr(e, "verify_message", None)
        reason = f"{e.reason}: {detail}" if detail else str(e.reason or e)
        raise FetchError(f"{what}: TLS with {host!r} failed ({reason})", "failed") from None
    except (OSError, http.client.HTTPException) as e:
        if fired.is_set() or isinstance(e, TimeoutError):
            raise _timeout(what, policy) from None
        raise FetchError(
            f"{what}: fetching {_short(url)} failed ({type(e).__name__}: {e})", "failed"
        ) from None
    finally:
        watchdog.cancel()
        watchdog.join()  # a watchdog that fired has let go of the socket before it is closed
        for response in held:
            response.close()
        conn.release()
