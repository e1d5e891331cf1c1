"""moto's S3 server with each request applied whole before the next: `python tests/moto_serial.py PORT`.

S3 makes a conditional PUT (If-None-Match: *) atomic.  moto's threaded server checks for the key and
stores the object in two steps, so two racing conditional PUTs can both succeed there — a fault of the
stand-in, not of S3.  A lock around moto's WSGI application gives every request S3's atomicity; the
server stays threaded (keep-alive connections, concurrent clients), only moto's own work is serial."""
import os
import signal
import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def serial(app):
    """`app` with one request inside it at a time (the response body is built inside the call)."""
    lock = threading.Lock()

    def wsgi(environ, start_response):
        with lock:
            return list(app(environ, start_response))

    return wsgi


def main() -> None:
    port = int(sys.argv[1])
    os.environ.setdefault("MOTO_PORT", str(port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple("127.0.0.1", port, serial(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
