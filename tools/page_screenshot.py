#!/usr/bin/env python3
"""A screenshot of apus's page while a request runs (the README's): headless Chromium opened on a
link that runs a request, captured after a wall-clock delay through the DevTools protocol (a
--screenshot capture comes at load, before the request). Needs websocket-client (PyPI).

Usage: page_screenshot.py URL OUT.png [--wait SECONDS] [--size 1100x900]
"""

import argparse
import base64
import json
import subprocess
import tempfile
import time
import urllib.request

import websocket


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--wait", type=float, default=6.0)
    ap.add_argument("--size", default="1100x900")
    a = ap.parse_args()
    port = 9333
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
             "--window-size=" + a.size.replace("x", ","), a.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json"))
                    page = next(p for p in pages if p["type"] == "page")
                    break
                except Exception:
                    time.sleep(0.1)
            time.sleep(a.wait)
            ws = websocket.create_connection(page["webSocketDebuggerUrl"])
            ws.send(json.dumps({"id": 1, "method": "Page.captureScreenshot", "params": {"format": "png"}}))
            while True:
                reply = json.loads(ws.recv())
                if reply.get("id") == 1:
                    break
            with open(a.out, "wb") as f:
                f.write(base64.b64decode(reply["result"]["data"]))
        finally:
            browser.kill()


if __name__ == "__main__":
    main()
