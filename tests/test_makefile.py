"""The Makefile's setup takes torch's CPU build: from torch's CPU index where it answers
(pip's default index serves the CUDA build, GBs of nvidia packages), else from pip's own
configuration (an offline machine's wheel folder). Run for real with a stand-in pip that
records its arguments and a local HTTP server as the index."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_calls(tmp: Path, index: str) -> list[str]:
    """The pip command lines ``make setup`` runs on a machine without torch."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    log = tmp / "pip.log"
    (bin_ / "pip").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    # no torch in this venv ("import torch" fails), the version line prints nothing
    (bin_ / "python").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    subprocess.run(
        ["make", "-s", "-B", f"{tmp}/venv/.installed-stamp", f"VENV={tmp}/venv", f"BIN={bin_}",
         f"PY={sys.executable}", f"TORCH_CPU_INDEX={index}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return log.read_text().splitlines()


def test_torch_comes_from_the_cpu_index_where_it_answers(tmp_path):
    (tmp_path / "www" / "torch").mkdir(parents=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=tmp_path / "www")  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}"
        calls = _setup_calls(tmp_path, index)
    finally:
        server.shutdown()
    assert calls[0] == f"install -q --index-url {index} torch==2.13.0"


def test_an_unreachable_index_leaves_torch_to_pips_configuration(tmp_path):
    calls = _setup_calls(tmp_path, "http://127.0.0.1:9")  # nothing listens on port 9
    assert calls[0] == "install -q torch==2.13.0"


@pytest.fixture(autouse=True)
def _needs_make():
    if subprocess.run(["make", "--version"], capture_output=True).returncode:
        pytest.skip("no make")
