"""A webhook receiver for tests/test_alerts.cpp: after DELAY seconds (a receiver that is down at
first), listens on 127.0.0.1:PORT and appends each POST's body as one line to OUT, answering 200.

    python3 tests/alert_receiver.py PORT OUT DELAY
"""
import http.server
import sys
import time

port, out, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(out, "ab") as f:
            f.write(body.replace(b"\n", b" ") + b"\n")
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


time.sleep(delay)
http.server.HTTPServer(("127.0.0.1", port), Receiver).serve_forever()
