"""scripts/device/pack_carry.sh: .device_carry folders packed into one xz archive that the
printed Python line unpacks where they were (bytes and modes kept), and bad names refused."""

import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "device", "pack_carry.sh")

pytestmark = pytest.mark.skipif(shutil.which("xz") is None or shutil.which("bash") is None,
                                reason="needs bash and xz")


def pack(tmp_path, *names):
    env = dict(os.environ, CARRY_DIR=str(tmp_path / "carry"),
               PACK_OUT=str(tmp_path / "packed" / "carry.tar.xz"))
    return subprocess.run(["bash", SCRIPT, *names], env=env, capture_output=True, text=True,
                          timeout=120)


def make_carry(tmp_path):
    rng = os.urandom
    carry = tmp_path / "carry"
    (carry / "cli").mkdir(parents=True)
    (carry / "cli" / "fp8mla").write_bytes(b"\x7fELF" + rng(200_000))
    os.chmod(carry / "cli" / "fp8mla", 0o755)
    (carry / "py" / "pkg").mkdir(parents=True)
    (carry / "py" / "pkg" / "__init__.py").write_text("x = 1\n")
    (carry / "other").mkdir()
    (carry / "other" / "not_packed.txt").write_text("left out\n")
    return carry


def test_packs_and_the_printed_line_unpacks_the_folders(tmp_path):
    carry = make_carry(tmp_path)
    r = pack(tmp_path, "cli", "py")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1].strip()
    assert line.startswith("python3 -c "), r.stdout
    device = tmp_path / "device"
    device.mkdir()
    code = shlex.split(line)[2]
    subprocess.run([sys.executable, "-c", code], cwd=device, check=True, timeout=60)
    got = device / ".device_carry"
    assert sorted(os.listdir(got)) == ["cli", "py"]
    assert (got / "cli" / "fp8mla").read_bytes() == (carry / "cli" / "fp8mla").read_bytes()
    assert stat.S_IMODE(os.stat(got / "cli" / "fp8mla").st_mode) == 0o755
    assert (got / "py" / "pkg" / "__init__.py").read_text() == "x = 1\n"


@pytest.mark.parametrize("names", [[], ["missing"], ["../carry"], ["cli/fp8mla"], [".hidden"]])
def test_refuses_what_is_not_a_carried_folder(tmp_path, names):
    make_carry(tmp_path)
    (tmp_path / "carry" / ".hidden").mkdir()
    r = pack(tmp_path, *names)
    assert r.returncode == 2, (names, r.stdout, r.stderr)
    assert not (tmp_path / "packed" / "carry.tar.xz").exists()
