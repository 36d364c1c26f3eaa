"""The benches' HTTP reads (core/bench/scrape.py): a page's status and body (an error status, nothing
answering), and one figure of Prometheus text."""

from __future__ import annotations

import http.server
import math
import threading

from inferhal.core.bench.scrape import get, metric
from inferhal.core.parallel.launch import free_port


class _Pages(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        code, body = (200, b"up") if self.path == "/health" else (404, b"no")
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_get_answers_status_and_body_an_error_status_and_zero_when_nothing_answers():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        assert get(base + "/health") == (200, "up")
        assert get(base + "/missing")[0] == 404
    finally:
        srv.shutdown()
        srv.server_close()
    assert get(f"http://127.0.0.1:{free_port()}/health", timeout=2)[0] == 0


def test_metric_reads_the_first_series_of_a_name_with_or_without_labels():
    text = ("# HELP inferhal_x_total x\ninferhal_x_total_more 9\ninferhal_x_total{model_name=\"m\"} 3.0\n"
            "inferhal_x_total{model_name=\"n\"} 4.0\ninferhal_y 2.5\n")
    assert metric(text, "inferhal_x_total") == 3.0
    assert metric(text, "inferhal_y") == 2.5
    assert math.isnan(metric(text, "inferhal_z"))
