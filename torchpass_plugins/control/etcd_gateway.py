"""How torchpass reaches etcd v3: its JSON gateway (``/v3/...`` over HTTP or HTTPS, keys and values in base64),
with the standard library and never through a proxy, trying the members in turn from the last one that
answered, logged in as the etcd user where one is named. A request that no member can serve (no quorum:
fewer than half of the members up) is retried until the caller's deadline: nothing is decided without a
quorum, and the caller resumes when one is back. The store's semantics live in ``etcd_store``; this is the
transport and the addresses that name a cluster.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

_AUTHENTICATE = "/v3/auth/authenticate"
RETRY_S = 0.2  # between rounds over every endpoint while none answers
_REQUEST_S = 5.0  # one HTTP request; a member without quorum answers an error after etcd's own timeout
PASSWORD_VARIABLE = "TORCHPASS_ETCD_PASSWORD"  # the etcd user's password: in the environment, never on a command line
SCHEME = "etcd://"  # a store address that names an etcd cluster: etcd://HOST:PORT,HOST:PORT,.../NAME


@dataclass(frozen=True)
class Credentials:
    """How to talk to the members, as etcd's own clients take it: TLS (the CA file that signed the members'
    certificates; a client certificate and key where they ask for one) and an etcd user (the password is
    read from ``TORCHPASS_ETCD_PASSWORD``). Files are named by path: every process of the job reads them."""

    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""

    def tls(self) -> ssl.SSLContext | None:
        if not (self.cacert or self.cert):
            return None
        context = ssl.create_default_context(cafile=self.cacert or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key or None)
        return context


NO_CREDENTIALS = Credentials()  # plain HTTP, no user: a cluster on a trusted network or on 127.0.0.1


def address(members: str, name: str, credentials: Credentials = NO_CREDENTIALS) -> str:
    """The store address of job ``name`` in the cluster whose client addresses are ``members`` (comma-separated),
    with the credentials' files and user (not the password) as its query."""
    query = urllib.parse.urlencode({k: v for k, v in asdict(credentials).items() if v})
    return f"{SCHEME}{members}/{name}" + (f"?{query}" if query else "")


def members_of(store_address: str) -> list[str]:
    """The members' ``HOST:PORT`` of an etcd store address."""
    return store_address.removeprefix(SCHEME).split("/", 1)[0].split(",")


def parse(store_address: str) -> tuple[list[str], str, Credentials]:
    """The members, the job's name and the credentials an etcd store address names."""
    location, _, query = store_address.partition("?")
    return members_of(location), location.rsplit("/", 1)[1], Credentials(**dict(urllib.parse.parse_qsl(query)))


class Gateway:
    """One client's connection to the members at ``endpoints`` (``host:port`` of their client URLs). Not
    shared between threads: it remembers the member that answered last and the user's login token."""

    def __init__(self, endpoints: list[str], credentials: Credentials) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint (host:port)")
        self.endpoints, self.credentials = list(endpoints), credentials
        context = credentials.tls()
        self._urls = [f"{'https' if context else 'http'}://{e}" for e in endpoints]
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),  # never through an http_proxy
                                                   urllib.request.HTTPSHandler(context=context))
        self._auth_token: str | None = None
        self._first = 0  # the endpoint that answered last

    def call(self, path: str, body: dict, timeout: timedelta, fresh_token: bool = False) -> dict:
        """The reply of the first member that serves ``path``; ``DistStoreError`` if one refuses it as asked,
        or none serves it within ``timeout``."""
        if self.credentials.user and self._auth_token is None and path != _AUTHENTICATE:
            login = {"name": self.credentials.user, "password": os.environ.get(PASSWORD_VARIABLE, "")}
            self._auth_token, fresh_token = self.call(_AUTHENTICATE, login, timeout)["token"], True
        deadline = time.monotonic() + timeout.total_seconds()
        data = json.dumps(body).encode()
        while True:
            errors = []
            for i in range(len(self._urls)):
                index = (self._first + i) % len(self._urls)
                try:
                    with self._open(index, path, data, _REQUEST_S) as reply:
                        answer = json.loads(reply.read())
                    self._first = index
                    return answer
                except urllib.error.HTTPError as exc:
                    if exc.code == 401 and self._auth_token is not None and not fresh_token:  # expired: log in
                        self._auth_token = None
                        return self.call(path, body, timeout)
                    if exc.code < 500:  # refused as asked: asking again will not help
                        why = exc.read().decode(errors="replace")[:300]
                        raise dist.DistStoreError(f"etcd at {self._urls[index]} refused {path}: {exc} {why}") from exc
                    errors.append(f"{self._urls[index]}: {exc}")  # up, without a quorum or a leader
                except (OSError, http.client.HTTPException, ValueError) as exc:  # down, or lost mid-reply
                    errors.append(f"{self._urls[index]}: {exc}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"etcd: no member answered within {timeout}: {'; '.join(errors)}")
            time.sleep(RETRY_S)

    def watch_for_put(self, key: str, revision: int, seconds: float) -> bool:
        """Whether ``key`` (base64) was put at ``revision`` or later within ``seconds``; False also when the
        member goes away or refuses. The caller looks again either way, so a member that is down, paused or
        cut off from the others delays a wake-up by one round at most, and no put is missed (etcd replays
        the history from ``revision``)."""
        body = {"create_request": {"key": key, "start_revision": str(revision)}}
        ends = time.monotonic() + seconds
        try:
            with self._open(self._first, "/v3/watch", json.dumps(body).encode(), seconds) as reply:
                while time.monotonic() < ends:
                    result = json.loads(reply.readline() or b"{}").get("result")
                    if result is None or result.get("canceled"):
                        return False
                    if any(event.get("type", "PUT") == "PUT" for event in result.get("events", ())):
                        return True
        except (OSError, http.client.HTTPException, ValueError):  # gone, refused, silent for the round, cut short
            pass
        return False

    def _open(self, index: int, path: str, data: bytes, seconds: float):
        """A request to member ``index`` (its reply, to be read and closed), logged in where a user is set."""
        headers = {"Content-Type": "application/json"}
        if self._auth_token and path != _AUTHENTICATE:
            headers["Authorization"] = self._auth_token
        request = urllib.request.Request(self._urls[index] + path, data=data, headers=headers)
        return self._opener.open(request, timeout=seconds)
