"""The project's own files: the package metadata, JupyterLab's launcher (.ci/lab), the
Makefile and CI entry point."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
import urllib.request

import psutil
import pytest

from conftest import REPO


def test_license_is_an_spdx_expression_with_its_file():
    """The table form (`license = {text = ...}`) makes setuptools warn on every install that
    builds stop accepting it after 2027-02-18."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"] and (REPO / "LICENSE").exists()


@pytest.mark.slow
def test_lab_prints_its_url_once_it_answers_and_keeps_the_token_off_command_lines(tmp_path):
    """.ci/lab passes the token through the environment (any local user reads arguments with
    ps) and prints the URL only once the server answers it."""
    pytest.importorskip("jupyterlab")
    token = "f00d" * 12
    env = dict(os.environ, LAB_TOKEN=token, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    proc = subprocess.Popen([str(REPO / ".ci/lab"), sys.executable, str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line = next((ln for ln in proc.stdout if ln.startswith("JupyterLab: ")), None)
        assert line is not None, "no URL line"
        url = line.split(" ", 1)[1].strip()
        assert url.endswith(f"/lab?token={token}")
        base = url.split("/lab?")[0]
        urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)   # answers at once
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        for p in procs:
            assert token not in " ".join(p.cmdline()), p.cmdline()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
