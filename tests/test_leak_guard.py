"""tests/conftest.py's guard: a test that leaves a process or a non-daemon thread running fails, the
process is killed, and pytest still exits (a waiting non-daemon thread once held CI until its timeout)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LEAKY_TESTS = '''
import subprocess, sys, threading

def test_leaves_a_process(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    (tmp_path.parent / "leaked.pid").write_text(str(p.pid))

def test_leaves_a_thread():
    threading.Thread(target=threading.Event().wait, name="waits-for-ever").start()

def test_clean():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_a_leaked_process_or_thread_fails_its_test_and_pytest_still_exits(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    env = {**os.environ, "DILOCO_TEST_LEAK_GRACE_S": "1"}
    env.pop("DILOCO_TEST_PROCESS_TAG", None)
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                          str(tmp_path / "base"), str(tmp_path / "test_leaky.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 100
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "ERROR test_leaky.py::test_leaves_a_process" in out and "time.sleep(300)" in out, out
    assert "ERROR test_leaky.py::test_leaves_a_thread" in out and "'waits-for-ever'" in out, out
    assert "3 passed, 2 errors" in out, out
    pid = int((tmp_path / "base" / "leaked.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
