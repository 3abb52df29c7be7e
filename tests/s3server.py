"""A real S3-compatible HTTP server on loopback (moto's server mode) behind a small fault-injecting
reverse proxy, for checkpoint tests. Nothing leaves 127.0.0.1."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moto.server import ThreadedMotoServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Faults:
    """What the proxy does to the next requests. Thread-safe counters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fail_next = 0
        self.fail_status = 503
        self.fail_only = ""  # when set, only requests whose path contains it are failed
        self.delay_s = 0.0
        self.requests = 0
        self.injected = 0
        self.get_bytes = 0  # response bytes of GETs relayed, to check what a lazy restore downloads
        self.seen: list[tuple[str, str]] = []  # (method, path with query) of every request

    def take_failure(self, path: str = "") -> int | None:
        with self.lock:
            self.requests += 1
            if self.fail_next > 0 and self.fail_only in path:
                self.fail_next -= 1
                self.injected += 1
                return self.fail_status
            return None


class S3Server:
    """moto on one port, the proxy on another; clients talk to `endpoint_url` (the proxy)."""

    def __init__(self) -> None:
        self.moto_port = free_port()
        self.faults = Faults()
        self.moto: ThreadedMotoServer | None = None
        self.start_moto()
        upstream = self

        class Proxy(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _relay(self) -> None:
                with upstream.faults.lock:
                    upstream.faults.seen.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                status = upstream.faults.take_failure(self.path)
                if upstream.faults.delay_s:
                    time.sleep(upstream.faults.delay_s)
                if status is not None:
                    payload = (f"<?xml version='1.0'?><Error><Code>{'ServiceUnavailable' if status == 503 else 'InternalError'}"
                               f"</Code><Message>injected</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", upstream.moto_port, timeout=30)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:
                    # Upstream down: drop the connection, as a dead endpoint would.
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if self.command == "GET":
                    with upstream.faults.lock:
                        upstream.faults.get_bytes += len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD response has no body but reports the object's length, as S3 does.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        self.proxy.daemon_threads = True
        self.proxy_thread = threading.Thread(target=self.proxy.serve_forever, daemon=True)
        self.proxy_thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def start_moto(self) -> None:
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.moto.start()

    def stop_moto(self) -> None:
        if self.moto is not None:
            self.moto.stop()
            self.moto._server.server_close()  # free the port so a restart can bind it
            self.moto = None

    def close(self) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.stop_moto()
