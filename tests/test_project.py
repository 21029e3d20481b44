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


def _make(*args, **env):
    return subprocess.run(["make", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))


def test_setup_installs_the_cpu_torch_unless_asked_for_cuda():
    """A fresh Linux machine with only the public index would take the CUDA build of several
    GB for `torch==2.13.0`: without a GPU, setup asks for the CPU build (2.13.0+cpu: a local
    wheel cache, else PyTorch's CPU index); TORCH=cuda asks for the index's build; another
    value is one error."""
    import platform
    cpu = _make("-n", "-B", ".venv/.sonata-installed", "TORCH=cpu").stdout
    cuda = _make("-n", "-B", ".venv/.sonata-installed", "TORCH=cuda").stdout
    if platform.system() == "Linux":
        assert '"torch==2.13.0+cpu"' in cpu and "--extra-index-url https://download.pytorch.org/whl/cpu" in cpu
    assert '"torch==2.13.0"' in cuda and "+cpu" not in cuda
    bad = _make("-n", "-B", ".venv/.sonata-installed", "TORCH=gpu")
    assert bad.returncode != 0 and "TORCH must be cpu or cuda" in bad.stderr


def test_setup_reruns_when_the_makefile_changes_and_clean_clears_numba_caches():
    assert _make("-q", "-W", "Makefile", ".venv/.sonata-installed").returncode == 1   # out of date
    assert "find sonata -name '*.nbi' -delete -o -name '*.nbc' -delete" in _make("-n", "clean").stdout


def test_setup_without_venv_says_so_in_one_line(tmp_path):
    r = _make("setup", f"VENV={tmp_path / 'v'}", "PY=false")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines and "python3-venv" in lines[0] and not (tmp_path / "v").exists()


def test_ci_run_without_root_and_browser_says_so_before_apt(tmp_path):
    """Not root and no browser: one error line, exit 2, apt-get never run."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")
    (fake / "apt-get").write_text(f"#!/bin/sh\ntouch {tmp_path}/apt-ran\n")
    (fake / "make").write_text(f"#!/bin/sh\ntouch {tmp_path}/make-ran\n")     # never the real suite
    for f in fake.iterdir():
        f.chmod(0o755)
    r = subprocess.run(["bash", str(REPO / ".ci/run")], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", SONATA_CHROMIUM="no-such-chromium"))
    assert r.returncode == 2 and "needs root" in r.stderr, r.stderr
    assert not (tmp_path / "apt-ran").exists() and not (tmp_path / "make-ran").exists()


def test_every_phony_make_target_has_a_recipe():
    """A target named in .PHONY that make cannot build is a promise the Makefile breaks."""
    text = (REPO / "Makefile").read_text()
    phony = next(ln for ln in text.splitlines() if ln.startswith(".PHONY:")).split()[1:]
    missing = [t for t in phony if not any(ln.startswith(f"{t}:") for ln in text.splitlines())]
    assert not missing, f"Makefile: .PHONY names {missing} with no rule"


def test_the_tree_is_lint_clean():
    """`make lint`: pyflakes finds no unused import, unused local or undefined name."""
    pytest.importorskip("pyflakes")
    r = subprocess.run([sys.executable, "-m", "pyflakes", "sonata", "tests", "benchmarks"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
