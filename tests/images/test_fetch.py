"""Image inputs by URL: refused by default; with --allowed-media-domains fetched from those hosts only,
each hop's addresses vetted (loopback allowed here only through --allowed-media-networks), within a
timeout, a redirect count and the byte limits. Images are served by a real HTTP server on 127.0.0.1 in this
process; the vector of a fetched image equals the vector of the same bytes sent as a data URL (whose
equality with transformers tests/images/test_server.py holds), through a real server and the Python API."""

from __future__ import annotations

import ipaddress
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from embed_service.images.decode import ImageError
from embed_service.images.fetch import FetchPolicy, fetch, refusal
from tests.images.pictures import encode, from_array, noise, shapes
from tests.images.test_server import LIMITS, clip_path, data_url, post, vectors  # noqa: F401
from tests.models.test_clip import min_cos
from tests.server import ServerProcess

SERVER_TIMEOUT = 4.0
"""The test server's --media-fetch-timeout: far above what a loopback fetch of these pictures takes on a
loaded machine, so only the pictures served late (or never) pass it."""

PICTURES = {
    "shapes.png": encode(shapes(60, 40), "PNG"),
    "noise.jpg": encode(from_array(noise(50, 70, 3, 7), "RGB"), "JPEG"),
    "third.png": encode(from_array(noise(250, 270, 3, 2), "RGB"), "PNG"),  # ~200 KB
}


class Images(ThreadingHTTPServer):
    daemon_threads = True
    release = threading.Event()
    """Set at teardown: lets the stalled handlers go."""
    hosts: list[str]


class Handler(BaseHTTPRequestHandler):
    server: Images

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.hosts.append(self.headers.get("Host", ""))
        path = self.path
        if path.startswith("/img/") and path[5:] in PICTURES:
            self.answer(200, PICTURES[path[5:]], {"Content-Type": "image/png"})
        elif m := re.fullmatch(r"/hops/(\d+)/(.+)", path):  # n redirects (n >= 1), then the picture
            n = int(m[1])
            self.answer(302, b"", {"Location": f"/hops/{n - 1}/{m[2]}" if n > 1 else f"/img/{m[2]}"})
        elif path == "/away":
            self.answer(302, b"", {"Location": "http://not-listed.invalid/img/shapes.png"})
        elif path == "/endless":  # no Content-Length: a body until the client goes
            self.send_response(200)
            self.end_headers()
            block = PICTURES["shapes.png"] * 4
            try:
                while not self.server.release.is_set():
                    self.wfile.write(block)
            except OSError:
                pass
        elif path == "/huge":  # claims 1 TB, sends nothing
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
            self.wfile.flush()
            self.server.release.wait()
        elif path == "/slow.png":  # the picture, 0.55 of the server's fetch timeout late
            self.server.release.wait(0.55 * SERVER_TIMEOUT)
            self.answer(200, PICTURES["shapes.png"], {"Content-Type": "image/png"})
        elif path == "/stall":  # headers, then nothing
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.flush()
            self.server.release.wait()
        elif path == "/trickle":  # a byte every 0.1 s, each well within a socket's timeout, without end
            self.send_response(200)
            self.end_headers()
            try:
                while not self.server.release.wait(0.1):
                    self.wfile.write(b"x")
                    self.wfile.flush()
            except OSError:
                pass
        else:
            self.answer(404, b"no such picture", {})

    def answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


def serve(tls: ssl.SSLContext | None = None) -> Iterator[Images]:
    server = Images(("127.0.0.1", 0), Handler)
    server.hosts, server.release = [], threading.Event()
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def images() -> Iterator[Images]:
    yield from serve()


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Path:
    """A certificate authority and a certificate it signed for the name "localhost" only (not 127.0.0.1),
    made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificates; it is not installed")
    d = tmp_path_factory.mktemp("tls")
    (d / "ext").write_text(
        "subjectAltName=DNS:localhost\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid\n"
    )
    for command in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=test-ca "
        "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign",
        "req -newkey rsa:2048 -nodes -keyout leaf.key -out leaf.csr -subj /CN=localhost",
        "x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out leaf.pem -days 2 -extfile ext",
    ):
        subprocess.run(["openssl", *command.split()], cwd=d, check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def tls_images(ca) -> Iterator[Images]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(ca / "leaf.pem", ca / "leaf.key")
    names: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    for server in serve(context):
        server.sni = names  # type: ignore[attr-defined]
        yield server


def url(images: Images, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{images.server_address[1]}{path}"


@pytest.mark.parametrize(
    "address, why",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback (as ::ffff:7f00:1)"),
        ("2002:7f00:1::", "loopback (as 2002:7f00:1::)"),  # 6to4 of 127.0.0.1
        ("64:ff9b::a00:1", "private (as 64:ff9b::a00:1)"),  # NAT64 of 10.0.0.1
        ("169.254.169.254", "link-local"),  # the cloud metadata address
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("100.64.0.1", "shared (100.64.0.0/10)"),  # carrier-grade NAT: not public
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "private"),  # reserved, and in Python's private list
        ("192.0.2.1", "private"),  # documentation
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
        ("::ffff:8.8.8.8", None),
    ],
)
def test_the_address_classifier(address, why):
    assert refusal(ipaddress.ip_address(address)) == why


def test_allowed_networks_let_their_addresses_through():
    allowed = (ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("fd00::/8"))
    assert refusal(ipaddress.ip_address("127.0.0.1"), allowed) is None
    assert refusal(ipaddress.ip_address("::ffff:127.0.0.1"), allowed) is None  # judged as 127.0.0.1
    assert refusal(ipaddress.ip_address("fd00::5"), allowed) is None
    assert refusal(ipaddress.ip_address("127.0.0.2"), allowed) == "loopback"


TRICKLE_S = 0.5  # the direct fetches' policy timeout, and the trickling fetch's deadline


def policy(**kw) -> FetchPolicy:
    args = {"domains": ["127.0.0.1", "localhost"], "networks": ["127.0.0.1/32"], "timeout": 0.5}
    args.update(kw)
    return FetchPolicy.of(args["domains"], args["networks"], args["timeout"], 3)


def test_fetch_from_an_allowed_loopback_sends_the_hosts_name(images):
    got = fetch(url(images, "/img/shapes.png"), "input 0", policy(), 10**6, "", time.monotonic() + 60)
    assert got == PICTURES["shapes.png"]
    assert images.hosts[-1] == f"127.0.0.1:{images.server_address[1]}"
    # the name "localhost" is sent as the Host header while the connection goes to the vetted address
    p = policy(networks=["127.0.0.0/8", "::1/128"])
    assert (
        fetch(url(images, "/hops/1/noise.jpg", "localhost"), "input 0", p, 10**6, "", time.monotonic() + 60)
        == PICTURES["noise.jpg"]
    )
    assert images.hosts[-1] == f"localhost:{images.server_address[1]}"


def test_a_name_that_resolves_to_loopback_is_refused_without_the_network_opt_in(images):
    with pytest.raises(
        ImageError, match=r"input 3: the host 'localhost' resolves to .*, a loopback address; "
    ):
        fetch(
            url(images, "/img/shapes.png", "localhost"),
            "input 3",
            policy(networks=[]),
            10**6,
            "",
            time.monotonic() + 60,
        )


def test_the_deadline_holds_against_a_body_that_trickles_without_end(images):
    """Each byte comes well within a socket timeout; only the deadline's watchdog ends the fetch. (60 s is
    a bound for a loaded machine, not a speed: without the watchdog the fetch never ends.)"""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            fetch(url(images, "/trickle"), "input 0", policy(), 10**6, "", time.monotonic() + TRICKLE_S)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the fetch outlived its 0.5 s deadline"
    assert re.match(r"input 0: the request's image fetches did not finish within 0.5 s", str(outcome[0])), (
        outcome
    )


def test_no_domains_no_fetch(images):
    with pytest.raises(
        ImageError, match="input 0: remote image URLs are not fetched by default.*--allowed-media"
    ):
        fetch(url(images, "/img/shapes.png"), "input 0", FetchPolicy(), 10**6, "", time.monotonic() + 60)


def test_https_goes_to_the_vetted_address_with_the_hosts_name_for_sni_and_verification(ca, tls_images):
    context = ssl.create_default_context(cafile=str(ca / "ca.pem"))
    p = FetchPolicy(
        frozenset({"localhost", "127.0.0.1"}),
        (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")),
        5.0,
        3,
        context,
    )
    link = url(tls_images, "/hops/1/shapes.png", "localhost").replace("http:", "https:")
    assert fetch(link, "input 0", p, 10**6, "", time.monotonic() + 60) == PICTURES["shapes.png"]
    assert (
        tls_images.sni[-1] == "localhost"
        and tls_images.hosts[-1] == f"localhost:{tls_images.server_address[1]}"
    )
    # the certificate names localhost, not 127.0.0.1: the same server by its address is refused
    with pytest.raises(ImageError, match=r"input 2: TLS with '127.0.0.1' failed \(CERTIFICATE_VERIFY_FAILED"):
        fetch(
            url(tls_images, "/img/shapes.png").replace("http:", "https:"),
            "input 2",
            p,
            10**6,
            "",
            time.monotonic() + 60,
        )
    # and so is one whose authority the client does not know (the system's)
    system = FetchPolicy(p.domains, p.networks, 5.0, 3)
    with pytest.raises(ImageError, match=r"input 0: TLS with 'localhost' failed \(CERTIFICATE_VERIFY_FAILED"):
        fetch(link, "input 0", system, 10**6, "", time.monotonic() + 60)


def expected_refusals(images: Images) -> list[tuple[str, str]]:
    """(URL, what the 400 says) for every rule; the byte limit is 300,000 (LIMITS)."""
    port = images.server_address[1]
    return [
        # exact names: a subdomain of a listed host is not listed
        (
            "http://img.example.com/cat.png",
            r"the host 'img.example.com' is not one of --allowed-media-domains \(127.0.0.1, 127.0.0.2, example.com\)",
        ),
        (
            f"http://127.0.0.2:{port}/img/shapes.png",
            r"resolves to 127.0.0.2, a loopback address; .*--allowed-media-networks",
        ),
        (
            url(images, "/hops/4/shapes.png"),
            r"more than 3 redirects; the limit is 3 \(--media-max-redirects\)",
        ),
        (url(images, "/away"), r"the host 'not-listed.invalid' is not one of --allowed-media-domains"),
        (
            url(images, "/endless"),
            r"sent more than 300000 bytes; the limit is 300000 bytes per image \(--max-image-bytes\)",
        ),
        (
            url(images, "/huge"),
            r"has a Content-Length of 1000000000000 bytes; the limit is 300000 bytes per image",
        ),
        (
            url(images, "/stall"),
            rf"fetches did not finish within {SERVER_TIMEOUT:g} s; the limit is {SERVER_TIMEOUT:g} s per request "
            r"\(--media-fetch-timeout\)",
        ),
        (
            url(images, "/trickle"),
            rf"did not finish within {SERVER_TIMEOUT:g} s; the limit is {SERVER_TIMEOUT:g} s per",
        ),
        (url(images, "/missing.png"), r"answered HTTP 404"),
        (
            f"http://user:pw@127.0.0.1:{port}/img/shapes.png",
            r"a URL with a user name or password is not fetched",
        ),
        (f"ftp://127.0.0.1:{port}/img/shapes.png", r"the 'ftp' scheme is not fetched; only http and https"),
    ]


@pytest.fixture(scope="module")
def fetching_server(clip_path) -> Iterator[ServerProcess]:  # noqa: F811
    with ServerProcess(
        "--model", str(clip_path), "--dtype", "float32", *LIMITS,
        "--allowed-media-domains", "127.0.0.1,127.0.0.2",
        "--allowed-media-domains", "example.com",
        "--allowed-media-networks", "127.0.0.1/32",
        "--media-fetch-timeout", str(SERVER_TIMEOUT),
    ) as server:  # fmt: skip
        yield server


def test_fetched_images_embed_as_their_data_urls(fetching_server, images):
    names = list(PICTURES)[:2]
    items: list = [{"image": data_url(PICTURES[n])} for n in names]
    want = vectors(post(fetching_server, {"input": items}))
    by_url = [
        {"type": "image_url", "image_url": {"url": url(images, f"/img/{names[0]}")}},
        {"image": url(images, f"/hops/3/{names[1]}")},  # three redirects: the limit
    ]
    got = vectors(post(fetching_server, {"input": ["a text", *by_url]}))
    assert min_cos(got[1:], want) >= 0.999999
    r = post(
        fetching_server,
        {"images": [url(images, f"/img/{n}") for n in names], "input_type": "image"},
        "/v2/embed",
    )
    assert r.status_code == 200, r.text
    assert min_cos(np.array(r.json()["embeddings"]["float"], np.float32), want) >= 0.999999


def test_every_fetch_refusal_is_a_400_naming_the_input_and_the_server_keeps_serving(fetching_server, images):
    for link, pattern in expected_refusals(images):
        r = post(fetching_server, {"input": ["a text", {"type": "image_url", "image_url": {"url": link}}]})
        assert r.status_code == 400, (link, r.text)
        message = r.json()["error"]["message"]
        print("\n", message)
        assert re.match("input 1: .*" + pattern, message), message
    # fetched bytes count into the request's budget: three of ~200 KB pass 600,000 bytes
    r = post(fetching_server, {"input": [{"image": url(images, "/img/third.png")}] * 3})
    assert r.status_code == 400, r.text
    assert re.search(
        r"input 2: .*the limit is 600000 bytes per request \(--max-request-image-bytes\)", r.text
    )
    # and it still serves, data URLs and URLs
    good = [{"image": data_url(PICTURES["shapes.png"])}, {"image": url(images, "/img/shapes.png")}]
    got = vectors(post(fetching_server, {"input": good}))
    assert min_cos(got[:1], got[1:]) >= 0.999999
    metrics = httpx.get(fetching_server.url + "/metrics", timeout=30).text
    counted = dict(re.findall(r'embed_image_fetches_total\{model="clip",result="(\w+)"\} ([0-9.]+)', metrics))
    for result, n in {"not_allowed": 5, "redirects": 1, "too_large": 3, "timeout": 2, "status": 1}.items():
        assert float(counted[result]) == n, (result, counted)
    assert float(counted["ok"]) >= 3, counted


def test_a_request_s_fetches_share_one_deadline(fetching_server, images):
    """Two pictures, each 0.55 of the timeout late: each alone is in time, the two together are not (was: a
    deadline per image, so a request of k URLs could take k times the timeout)."""
    one = post(fetching_server, {"input": [{"image": url(images, "/slow.png")}]})
    assert one.status_code == 200, one.text
    r = post(fetching_server, {"input": [{"image": url(images, "/slow.png")}] * 2})
    assert r.status_code == 400, r.text
    assert re.match(
        rf"input 1: the request's image fetches did not finish within {SERVER_TIMEOUT:g} s; the limit is "
        rf"{SERVER_TIMEOUT:g} s per request \(--media-fetch-timeout\)",
        r.json()["error"]["message"],
    ), r.text


def test_the_python_api_fetches_as_the_server_does(clip_path, images):  # noqa: F811
    from embed_service import Embedder
    from embed_service.engine.errors import InvalidInputError

    data = PICTURES["noise.jpg"]
    with Embedder(str(clip_path), dtype="float32", allowed_media_domains="127.0.0.1,localhost",
                  allowed_media_networks=["127.0.0.1/32"]) as e:  # fmt: skip
        got = e.encode([{"image": url(images, "/hops/2/noise.jpg")}, data])  # a str would be a text
        assert min_cos(got[:1], got[1:]) >= 0.999999
    with Embedder(str(clip_path), dtype="float32", allowed_media_domains=["localhost"]) as e:
        with pytest.raises(InvalidInputError, match=r"input 0: the host 'localhost' resolves to .*loopback"):
            e.encode([{"image": url(images, "/img/noise.jpg", "localhost")}])
        with pytest.raises(InvalidInputError, match=r"input 1: the host '127.0.0.1' is not one of"):
            e.encode(["a text", {"image": url(images, "/img/noise.jpg")}])


def test_the_settings_take_comma_lists_from_variables_and_refuse_a_bad_network(monkeypatch):
    from pydantic import ValidationError

    from embed_service.config import Settings

    monkeypatch.setenv("EMBED_ALLOWED_MEDIA_DOMAINS", "img.example.com, CDN.example.com.")
    monkeypatch.setenv("EMBED_ALLOWED_MEDIA_NETWORKS", "10.1.2.3/24")
    s = Settings()
    assert s.allowed_media_domains == ["img.example.com", "CDN.example.com."]
    assert s.allowed_media_networks == ["10.1.2.0/24"]
    p = FetchPolicy.of(s.allowed_media_domains, s.allowed_media_networks, s.media_fetch_timeout, 3)
    assert p.domains == {"img.example.com", "cdn.example.com"}  # names compare as DNS does
    assert refusal(ipaddress.ip_address("10.1.2.200"), p.networks) is None
    with pytest.raises(ValidationError, match=r"allowed_media_networks[\s\S]*not-a-network"):
        Settings(allowed_media_networks="10.0.0.0/8,not-a-network")
    with pytest.raises(ValidationError, match="media_fetch_timeout"):
        Settings(media_fetch_timeout=0)
